"""How much does placing expert-parallel groups by topology save, at each EP size?

Placement (M11: ``topology`` keeps an EP group inside a micro-cluster and its node
boundaries, ``strided`` and ``random`` ignore them) x EP size on 8 ranks as 2 GPUs per
node, 2 nodes per micro-cluster, 2 micro-clusters -> step time, token-stage time and
bytes per link level. The claim it tests: C11 (a topology-ignorant placement made
communication 3.2x slower).

    python experiments/sweep_placement.py --quick --json
"""

from __future__ import annotations

import sys

from testbed.cli.experiment import Experiment, bytes_by_level_figure, experiment_base, experiment_main
from testbed.study.decisions import ranking
from testbed.study.run_figures import token_time

PLACE, EP = "parallelism.placement", "parallelism.ep_size"


def build(opts):
    base = opts.base(data=experiment_base({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2,
                                                       "microclusters": 2}}))
    axes = {EP: [2, 4] if opts.quick else [2, 4, 8], PLACE: ["topology", "strided", "random"]}
    return opts.sweep("sweep_placement", base, axes=axes, baseline={EP: 2, PLACE: "topology"})


def analyse(result) -> dict:
    pts = result.points()
    head = {}
    for backend, key in (("sim", "sim_step_s"), ("real", "measured_step_s")):
        for ep in sorted({p[EP] for p in pts}):
            sel = {p[PLACE]: p for p in pts if p[EP] == ep and p[key] is not None}
            if "topology" not in sel:
                continue
            head[f"ranking_{backend}_ep{ep}"] = ranking(sel.values(), PLACE, key)
            t0 = token_time(sel["topology"].get(backend) or {})
            for other in ("strided", "random"):
                if other in sel and t0:
                    ratio = token_time(sel[other].get(backend) or {}) / t0
                    head[f"token_time_ratio_{other}_vs_topology_{backend}_ep{ep}"] = ratio
    return head


def figures(result, headline) -> list:
    return [bytes_by_level_figure(result, "Bytes per link level by placement")]


EXPERIMENT = Experiment(
    name="sweep_placement", question=__doc__.split("\n")[0], build=build, analyse=analyse, figures=figures,
    note="Token time: seconds in dispatch, combine and their backward. Bytes per level are the planner's payload "
         "for the routing each point ran (identical on both backends for the same routing).",
    columns=[("token time sim / real", lambda p: f"{(token_time(p.get('sim') or {}) or 0) * 1e3:.2f} / "
              f"{(token_time(p.get('real') or {}) or 0) * 1e3:.2f} ms")])

if __name__ == "__main__":
    sys.exit(experiment_main(EXPERIMENT))
