"""How do the token strategies and expert-sync strategies compare, simulated and measured?

Token strategy (M7: ``alltoall``, ``allgather``, ``hierarchical``) x expert sync (M8
``allreduce``, M9 ``two_stage``) on the quick-start scenario's cluster (8 ranks: 2 GPUs per
node, 2 nodes per micro-cluster, 2 micro-clusters) -> step time, time and bytes per
stage, with the ranking of the six on each backend. The claims it tests: C3 (two-stage
sync moves 42.7% of the all-reduce's bytes) and C16 (the all-to-all's share of a step).

    python experiments/compare_strategies.py --quick --json
"""

from __future__ import annotations

import sys

from testbed.cli.experiment import ROOT, Experiment, experiment_main
from testbed.scenario.scenario import Scenario
from testbed.scenario.sections import EXPERT_SYNC_STRATEGIES, TOKEN_STRATEGIES
from testbed.study.decisions import joined, ranking
from testbed.study.run_figures import token_share

TOKEN, SYNC = "comm.token_strategy", "comm.expert_sync"
DEFAULT_CONFIG = ROOT / "configs" / "quickstart.toml"


def strategy_scenarios(base: Scenario) -> list[Scenario]:
    """``base`` with every (token_strategy, expert_sync) pair, token strategy outermost."""
    return [base.replace(comm={"token_strategy": t, "expert_sync": s})
            for t in TOKEN_STRATEGIES for s in EXPERT_SYNC_STRATEGIES]


def build(opts):
    base = opts.base(DEFAULT_CONFIG)
    if opts.quick:
        base = base.replace(run={"steps": 5, "warmup_steps": 1})
    axes = {TOKEN: list(TOKEN_STRATEGIES), SYNC: list(EXPERT_SYNC_STRATEGIES)}
    return opts.sweep("compare_strategies", base, axes=axes, baseline={TOKEN: "alltoall", SYNC: "allreduce"})



def analyse(result) -> dict:
    pts = result.points()
    head = {}
    for backend, key in (("sim", "sim_step_s"), ("real", "measured_step_s")):
        if any(p[key] is not None for p in pts):
            head[f"ranking_{backend}"] = ranking(pts, joined(TOKEN, SYNC), key)
    return head


EXPERIMENT = Experiment(
    name="compare_strategies", question=__doc__.split("\n")[0], build=build, analyse=analyse,
    note="Ranking: fastest first. Token share: the fraction of the step in dispatch, combine and their backward.",
    columns=[("token share sim / real", lambda p: " / ".join(
        "—" if (v := token_share(p.get(b) or {})) is None else f"{100 * v:.0f}%" for b in ("sim", "real")))])


def main(argv: list[str] | None = None) -> int:
    return experiment_main(EXPERIMENT, argv)


if __name__ == "__main__":
    sys.exit(main())
