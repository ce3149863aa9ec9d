"""DeepEP's normal-kernel benchmark on the simulator: the dispatch's and the combine's
bandwidth of DeepEP's own test routing, to set beside DeepEP's published figures
(docs/published.md section 5; ``benchmarks/deepep_bandwidth.py`` prints them,
``experiments/validate_published.py`` judges them).

DeepEP's README (V1): H800 (~160 GB/s NVLink), one 400 Gb/s ConnectX-7 per GPU, 4,096
tokens per GPU, hidden 7,168, top-8 of 256 experts (across nodes: top-4 node groups), fp8
dispatch, bf16 combine; bandwidth is the bottleneck link's. Tokens are routed as DeepEP's
tests do (tests/test_intranode.py and test_internode.py: scores |N(0, 1)| + 1 per token and
expert; across nodes a node's score is its best expert's, the top min(nodes, 4) nodes kept,
the top 8 experts among theirs), the deepep ops of that routing planned
(``testbed.policy.planner``, its fanout told) and the dispatch's and the combine's exchange
timed on the analytic network (``sim.step.schedule.run_analytic``; the dispatch without its
fanout all-gather, as DeepEP's bench times the dispatch kernel without its notify). The
bandwidth is DeepEP's *logical* one, from the same routing, over the simulated time:

- intranode: the rows a GPU receives, its own included ((token, GPU) pairs), x hidden x
  (1 + 4/128) bytes (fp8 with its per-128 scales) for the dispatch, x 2 (bf16) for the combine;
- internode: the (token, node) pairs a GPU sends, its own node included, x the same.

The dispatch's token rows carry DeepEP's fp8 scales on the wire here (the testbed's own fp8
rows carry none, as its codec). The kernels run on DeepEP's tests' 24 SMs; across nodes their
forwarding rate bounds the forward besides NVLink (``sim.network.deepep_forward``). Not
modelled: DeepEP's chunked pipelining (the hop and the forward are one batch, fully
overlapped), and the intranode kernels' own SM limit. Seconds and bytes; the routing from the
caller's seeded generator.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import simpy

from sim.hardware.fabric import build_fabric
from sim.network.analytic_timer import AnalyticTimer
from sim.network.collective_model import CollectiveModel
from sim.network.deepep_forward import REFERENCE_SMS
from sim.network.network import Network
from sim.step.phases import Phase
from sim.step.schedule import run_analytic
from testbed.policy import deepep
from testbed.policy.planner import Planner
from testbed.scenario.profile import MachineProfile
from testbed.scenario.scenario import Scenario

TOKENS, HIDDEN, EXPERTS, TOP_K, GPUS_PER_NODE = 4096, 7168, 256, 8, 8
FP8_ROW = HIDDEN * (1 + 4 / 128)  # bytes of an fp8 row with its per-128-element fp32 scales (DeepEP's fp8_factor x 2)
BF16_ROW = HIDDEN * 2


def scenario(ep: int) -> Scenario:
    """EP ``ep`` GPUs, 8 a node, of DeepEP's test shape (module doc), dropless."""
    nodes = ep // GPUS_PER_NODE
    return Scenario.from_dict({
        "model": {"hidden_size": HIDDEN, "ffn_hidden_size": 2048, "num_experts": EXPERTS, "top_k": TOP_K,
                  "num_layers": 1, "dtype": "bf16"},
        "cluster": {"gpus_per_node": GPUS_PER_NODE, "nodes_per_microcluster": nodes, "microclusters": 1,
                    "rail_optimized": True},
        "parallelism": {"ep_size": ep},
        "router": {"capacity_factor": 0.0},  # dropless, as DeepEP's tests
        "comm": {"token_strategy": "deepep", "payload_dtype": "fp8", "deepep_sms": REFERENCE_SMS},
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


def _with_scales(op):
    """A dispatch op's token rows with DeepEP's per-128-element fp32 scales on the wire
    (``FP8_ROW`` a row, not the testbed codec's ``HIDDEN``): the bandwidth's bytes count the
    scales, so the timed bytes must carry them too. Index and probability rows unchanged."""
    if not op.label.startswith("tokens"):
        return op
    factor = FP8_ROW / HIDDEN
    return replace(op, matrix=np.rint(op.matrix * factor).astype(op.matrix.dtype),
                   row_bytes=round(op.row_bytes * factor))


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
        hops = [_with_scales(op) if stage == "dispatch" else op
                for op in planner.token_ops(stage, 0, kept) if op.label != "token fanout (deepep)"]
        tl = run_analytic([Phase(stage, 0, "ops", "comm", (), ops=hops)], ep, timer, 0.0, 0.0)
        seconds[stage] = float(tl.end[0, 0] - tl.start[0, 0])
    p = lay.ep_size
    if ep == GPUS_PER_NODE:  # intranode: the rows rank 0 receives, its own included
        rows = int(fanout[:, 0].sum())
    else:  # internode: rank 0's (token, node) pairs, its own node included
        rows = int(fanout[0, p:].sum())
    return {"dispatch": (rows * FP8_ROW, seconds["dispatch"]), "combine": (rows * BF16_ROW, seconds["combine"])}


def bandwidths_GBps(ep: int, profile: MachineProfile, rng: np.random.Generator) -> dict[str, float]:
    """{dispatch, combine}: DeepEP's logical GB/s (1e9 bytes/s) of EP ``ep`` (module doc)."""
    return {stage: nbytes / seconds / 1e9 for stage, (nbytes, seconds) in simulate(ep, profile, rng).items()}
