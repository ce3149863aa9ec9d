"""Questions asked of many runs: the sweep engine, the experiment scripts' options and loading,
decision rules and ``testbed regress`` with its golden file (``golden/``), figures read off
finished runs, and the claims ledger and its verdicts. It may import ``run`` and the rooms below
it; never ``report`` or ``cli``.
"""
