"""What does a local-first routing bias trade: bytes off the NICs against drops and loss?

M22's local-first bias (``router.local_bias`` b, added to the gate logits of the experts
whose replica for the token's EP group sits in its node) x b on 8 ranks as 2 GPUs per
node, 2 nodes per micro-cluster, 2 micro-clusters, one EP group of 8 -> bytes per link
level, the dropped-slot fraction, the loss (real ranks) and step time. The source warns
that too strong a bias breaks the load balance: the drops show it.

    python experiments/local_first_bias.py --quick --json
"""

from __future__ import annotations

import sys

from testbed.cli.experiment import Experiment, both, bytes_by_level_figure, experiment_base, experiment_main, figure
from testbed.scenario.topology import LEVELS

BIAS = "router.local_bias"


def build(opts):
    base = opts.base(data=experiment_base({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2,
                                                       "microclusters": 2},
                                           "parallelism": {"ep_size": 8}}))
    axes = {BIAS: [0.0, 1.0, 3.0] if opts.quick else [0.0, 0.5, 1.0, 2.0, 3.0]}
    return opts.sweep("local_first_bias", base, axes=axes, baseline={BIAS: 0.0})


def analyse(result) -> dict:
    head = {}
    pts = {p[BIAS]: p for p in result.points()}
    base = pts.get(0.0)
    for backend in ("sim", "real"):
        levels0 = figure(base, backend, "bytes_by_level") if base else None
        for b, p in sorted(pts.items()):
            levels = figure(p, backend, "bytes_by_level")
            if levels and levels0:
                for lv in LEVELS[:3]:
                    if levels0.get(lv):
                        head[f"{lv}_bytes_change_{backend}_bias{b:g}"] = levels[lv] / levels0[lv] - 1
            drop = figure(p, backend, "dropped_token_fraction")
            if drop is not None:
                head[f"dropped_{backend}_bias{b:g}"] = drop
            loss = figure(p, backend, "loss_last")
            if loss is not None:
                head[f"loss_last_{backend}_bias{b:g}"] = loss
    return head


def figures(result, headline) -> list:
    return [bytes_by_level_figure(result, "Bytes per link level by local-first bias (simulated)")]


EXPERIMENT = Experiment(
    name="local_first_bias", question=__doc__.split("\n")[0], build=build, analyse=analyse, figures=figures,
    note="Bytes per level are the planner's payload for the routing each point ran. On real ranks the bias acts on "
         "the learnt router; the simulator weights each rank's local experts e^b in its routing draws (the "
         "Gumbel-max trick's exact effect on a top-1 choice).",
    columns=[("dropped sim / real", lambda p: both(p, "dropped_token_fraction", lambda v: f"{100 * v:.1f}%")),
             ("loss (last step) real", lambda p: both(p, "loss_last", lambda v: f"{v:.4f}").split(" / ")[1])])

if __name__ == "__main__":
    sys.exit(experiment_main(EXPERIMENT))
