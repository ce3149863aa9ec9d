"""deepep's simulated dispatch and combine against DeepEP's published normal-kernel bandwidths.

    python benchmarks/deepep_bandwidth.py [--seed 0]

DeepEP's README (V1; docs/published.md): H800 (~160 GB/s NVLink), one
400 Gb/s ConnectX-7 per GPU, 4,096 tokens per GPU, hidden 7,168, top-8 of 256 experts
(across nodes: top-4 node groups), fp8 dispatch, bf16 combine; bandwidth is the bottleneck
link's. This script routes tokens as DeepEP's own tests do (tests/test_intranode.py and
test_internode.py: scores |N(0, 1)| + 1 per token and expert; across nodes a node's score
is its best expert's, the top min(nodes, 4) nodes kept, the top 8 experts among theirs),
plans the deepep ops of that routing (``testbed.policy.planner``, its fanout told) and times
the dispatch's and the combine's exchange on the simulator's analytic network
(``sim.step.schedule.run_analytic``; the dispatch without its fanout all-gather, as DeepEP's
bench times the dispatch kernel without its notify). The bandwidth printed is DeepEP's
*logical* one, from the same routing, divided by the simulated time:

- intranode: the rows a GPU receives, its own included ((token, GPU) pairs), x hidden x
  (1 + 4/128) bytes (fp8 with its per-128 scales) for the dispatch, x 2 (bf16) for the combine;
- internode: the (token, node) pairs a GPU sends, its own node included, x the same.

The machine is the built-in h800 profile (testbed/scenario/profiles/h800.toml): NVLink
160 GB/s per direction (what DeepSeek-V3 and DeepEP's README give as achievable of H800's
200 GB/s), NIC 48 GB/s (a 400 Gb/s NDR NIC's rate NCCL's maintainers report), the GH100's
132 SMs; each figure's source is in the profile. Nothing is fitted to the published figures: they are
only printed beside the simulated ones. Not modelled: the fp8 scales' bytes on the wire
(the testbed's fp8 rows carry none: 3% fewer bytes), DeepEP's chunked pipelining (the hop
and the forward are one batch, fully overlapped), and any limit the kernels' 20-24 SMs put
on the bandwidth.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import simpy

from sim.hardware.fabric import build_fabric
from sim.network.analytic_timer import AnalyticTimer
from sim.network.collective_model import CollectiveModel
from sim.network.network import Network
from sim.step.phases import Phase
from sim.step.schedule import run_analytic
from testbed.core.errors import run_as_command
from testbed.policy import deepep
from testbed.policy.planner import Planner
from testbed.scenario.profile import MachineProfile, load_profile
from testbed.scenario.scenario import Scenario

TOKENS, HIDDEN, EXPERTS, TOP_K, GPUS_PER_NODE = 4096, 7168, 256, 8, 8
FP8_ROW = HIDDEN * (1 + 4 / 128)  # bytes of an fp8 row with its per-128-element fp32 scales (DeepEP's fp8_factor x 2)
BF16_ROW = HIDDEN * 2
#: published-figures.md section 4: (type, EP, dispatch GB/s, combine GB/s, the bottleneck link)
PUBLISHED = [("intranode", 8, 153.0, 158.0, "NVLink"), ("internode", 16, 43.0, 43.0, "RDMA"),
             ("internode", 32, 58.0, 57.0, "RDMA")]


def h800_like() -> MachineProfile:
    """The built-in h800 profile (module doc)."""
    return load_profile("h800")


def scenario(ep: int) -> Scenario:
    nodes = ep // GPUS_PER_NODE
    return Scenario.from_dict({
        "model": {"hidden_size": HIDDEN, "ffn_hidden_size": 2048, "num_experts": EXPERTS, "top_k": TOP_K,
                  "num_layers": 1, "dtype": "bf16"},
        "cluster": {"gpus_per_node": GPUS_PER_NODE, "nodes_per_microcluster": nodes, "microclusters": 1,
                    "rail_optimized": True},
        "parallelism": {"ep_size": ep},
        "router": {"capacity_factor": 0.0},  # dropless, as DeepEP's tests
        "comm": {"token_strategy": "deepep", "payload_dtype": "fp8"},
        "workload": {"tokens_per_rank": TOKENS},
        "pager": {"enabled": False},
    })


def deepep_routing(ep: int, rng: np.random.Generator) -> np.ndarray:
    """[W, T, K] expert ids as DeepEP's tests draw them (module doc)."""
    nodes = ep // GPUS_PER_NODE
    out = np.empty((ep, TOKENS, TOP_K), dtype=np.int64)
    for rank in range(ep):
        scores = np.abs(rng.standard_normal((TOKENS, EXPERTS))) + 1
        if nodes > 1:
            groups = min(nodes, 4)
            best = scores.reshape(TOKENS, nodes, -1).max(axis=2)
            kept_nodes = np.argpartition(-best, groups - 1, axis=1)[:, :groups]
            allowed = np.zeros((TOKENS, nodes), dtype=bool)
            np.put_along_axis(allowed, kept_nodes, True, axis=1)
            scores = np.where(np.repeat(allowed, EXPERTS // nodes, axis=1), scores, 0.0)
        out[rank] = np.argpartition(-scores, TOP_K - 1, axis=1)[:, :TOP_K]
    return out


def simulate(ep: int, profile: MachineProfile, rng: np.random.Generator) -> dict:
    """Simulated seconds and DeepEP's logical bytes of rank 0's dispatch and combine."""
    s = scenario(ep)
    planner = Planner(s)
    lay = planner.layout
    experts = deepep_routing(ep, rng)
    keep = np.ones(experts.shape, dtype=bool)
    node_of = deepep.node_of_member(lay, planner.grids[0])
    fanout = np.stack([deepep.fanout_of_tokens(experts[r], keep[r], lay.experts_per_rank, node_of)
                       for r in range(ep)])
    kept = np.zeros((ep, EXPERTS), dtype=np.int64)
    for r in range(ep):
        np.add.at(kept[r], experts[r].ravel(), 1)
    planner.tell_fanout(0, fanout)
    network = Network(simpy.Environment(), build_fabric(s, profile), "analytic")
    timer = AnalyticTimer(CollectiveModel(network, profile, ep))
    seconds = {}
    for stage in ("dispatch", "combine"):
        hops = [op for op in planner.token_ops(stage, 0, kept) if op.label != "token fanout (deepep)"]
        tl = run_analytic([Phase(stage, 0, "ops", "comm", (), ops=hops)], ep, timer, 0.0, 0.0)
        seconds[stage] = float(tl.end[0, 0] - tl.start[0, 0])
    p = lay.ep_size
    if ep == GPUS_PER_NODE:  # intranode: the rows rank 0 receives, its own included
        rows = int(fanout[:, 0].sum())
    else:  # internode: rank 0's (token, node) pairs, its own node included
        rows = int(fanout[0, p:].sum())
    return {"dispatch": (rows * FP8_ROW, seconds["dispatch"]), "combine": (rows * BF16_ROW, seconds["combine"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="seed of the routing's scores (default 0)")
    args = ap.parse_args(argv)

    def work() -> int:
        profile = h800_like()
        rng = np.random.default_rng(args.seed)
        print(f"profile {profile.name}: NVLink {profile.links.nvlink.bandwidth_GBps:g} GB/s, "
              f"NIC {profile.links.nic.bandwidth_GBps:g} GB/s per direction; routing seed {args.seed}")
        print(f"{'type':<10} {'EP':>3} {'stage':<9} {'link':<7} {'published GB/s':>15} {'simulated GB/s':>15} "
              f"{'error':>7} {'sim time us':>12}")
        for kind, ep, dispatch, combine, link in PUBLISHED:
            got = simulate(ep, profile, rng)
            for stage, published in (("dispatch", dispatch), ("combine", combine)):
                nbytes, seconds = got[stage]
                simulated = nbytes / seconds / 1e9
                print(f"{kind:<10} {ep:>3} {stage:<9} {link:<7} {published:>15.0f} {simulated:>15.1f} "
                      f"{(simulated - published) / published:>+7.0%} {seconds * 1e6:>12.0f}")
        return 0
    return run_as_command("deepep_bandwidth", work, "stopped")


if __name__ == "__main__":
    sys.exit(main())
