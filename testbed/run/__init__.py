"""Running a scenario on a backend and keeping what it measured: the backend registry (a backend is
found by name: ``testbed`` never imports ``sim`` or ``real``), the runner, the run store, the
results schema, routing traces, the size guards, and where a run's numbers come from. It may
import ``policy``, ``scenario`` and ``core``.
"""
