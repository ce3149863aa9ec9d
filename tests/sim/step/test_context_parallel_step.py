"""Context parallelism on the simulator (issue 25, item 2): attention's core on a GPU's own
tokens under the load-balanced causal split, its ring of CP steps each beside the send of
the next KV block (``sim.step.context_parallel_ring``), the ring's buffers, and the
activations of the GPU's own tokens. Closed forms on a tiny model on the h200 profile: one
node of 4 GPUs a CP group of 2 (NVLink: every step's core outlasts its send), or 8 GPUs over
two nodes a group of 8 (its sends cross the NICs and outlast the core)."""

import numpy as np
import pytest

from sim.backend import ClusterSim, decide_step, routing_source
from sim.hardware.compute import ComputeModel
from sim.step.phases import Phase
from sim.step.schedule import run_analytic
from testbed.model.whole_model import layer_activation_bytes, shape_of
from testbed.policy.context_parallel import is_ring_batch, kv_block_bytes
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

H, S, HEADS = 512, 16384, 8


def scenario(cp: int, gpus_per_node: int = 4) -> Scenario:
    """8 GPUs of the h200 profile, ``gpus_per_node`` a node; 2 MoE layers, one attention each;
    S / cp tokens a GPU (one sequence per CP group), one KV head. One expert on every GPU, so
    that every GPU's MoE layers take the same time and the GPUs enter each block together."""
    return Scenario.from_dict({
        "model": {"hidden_size": H, "ffn_hidden_size": 512, "num_experts": 1, "top_k": 1, "num_layers": 2,
                  "dtype": "bf16"},
        "cluster": {"gpus_per_node": gpus_per_node, "nodes_per_microcluster": 8 // gpus_per_node, "microclusters": 1,
                    "profile": "h200"},
        "parallelism": {"ep_size": 1, "cp_size": cp},
        "pager": {"enabled": False},
        "workload": {"tokens_per_rank": S // cp},
        "transformer": {"enabled": True, "num_heads": HEADS, "num_kv_heads": 1, "seq_len": S, "vocab_size": 1000,
                        "moe_every": 1},
        "run": {"steps": 1, "warmup_steps": 0},
    })


def step_phases(s: Scenario):
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    phases = sim.builder.build(decide_step(sim.controller, 0, np.asarray(routing_source(s)(0))))
    return sim, phases, run_analytic(phases, s.world_size, sim.timer, 0.0, sim.copy_latency)


def block_phases(phases, stage: str, layer: int) -> list[int]:
    """The phases of MoE layer ``layer``'s block in ``stage``: the forward's before its route
    (the output head's come after the last layer's combine), the backward's after its
    route_backward (the head's come first); not the host's cost of the stage (the measured
    profile's, ``Phase.fitted``)."""
    at = [p for p, ph in enumerate(phases) if ph.layer == layer and not ph.fitted]
    if stage == "dense":
        route = next(p for p in at if phases[p].stage == "route")
        return [p for p in at if p < route and phases[p].stage == "dense"]
    route = next(p for p in at if phases[p].stage == "route_backward")
    return [p for p in at if p > route and phases[p].stage == "dense_backward"]


def alone(sim, ops) -> float:
    """Seconds of one ring step's sends alone on the fabric."""
    tl = run_analytic([Phase("dense", 1, "ops", "comm", (), ops=ops)], sim.layout.world, sim.timer, 0.0, 0.0)
    return float(tl.end.max())


def test_the_attention_core_is_the_gpus_share_at_the_kernel_of_its_rows():
    """Per GPU 2 x 2 x (S / CP) x S x n d x 1/2 FLOPs (1/CP of the sequence's, the same on every
    GPU), at the attention curve's efficiency for S / CP rows; the backward's twice that."""
    s = scenario(2)
    sim = ClusterSim(s, load_profile("h200"))
    dense = sim.builder.dense
    c = ComputeModel(load_profile("h200"), "bf16", s.world_size)
    core = 2 * 2 * (S // 2) * S * H * 0.5 / (c.peak * c.profile.compute.efficiency_at("attention", S // 2)) * c.scale
    assert dense.ring_core_s(1, backward=False) == [pytest.approx(core, rel=1e-12)]
    assert dense.ring_core_s(1, backward=True) == [pytest.approx(2 * core, rel=1e-12)]
    assert ClusterSim(scenario(1), load_profile("h200")).builder.dense.ring_core_s(1, False) == []  # no ring


@pytest.mark.parametrize("cp, gpus_per_node", [(2, 4), (8, 1)])
def test_each_ring_step_takes_the_longer_of_its_core_and_its_send(cp, gpus_per_node):
    """Layer 1's dense forward: its compute less the core, then CP steps, step i < CP - 1
    max(core / CP, the send of a block alone), the last core / CP; its backward CP steps of
    max(2 core / CP, the send of its 1, 2, ..., 2, 1 blocks). CP 2 inside a node (NVLink:
    the core outlasts the sends), CP 8 over 8 nodes of one GPU (every send crosses the NICs
    and outlasts the core; a ring with some sends over NVLink and some over NICs has its
    GPUs drift apart, each waiting for its own neighbours only)."""
    s = scenario(cp, gpus_per_node)
    sim, phases, tl = step_phases(s)
    dense = sim.builder.dense
    ops = sim.controller.planner.dense_tp_ops(1, backward=False)
    back = sim.controller.planner.dense_tp_ops(1, backward=True)
    core, = dense.ring_core_s(1, backward=False)
    sends = [alone(sim, batch) for batch in ops if is_ring_batch(batch)]
    backward_sends = [alone(sim, batch) for batch in back if is_ring_batch(batch)]
    assert len(sends) == cp - 1 and len(backward_sends) == cp
    want = dense.forward_s[1] - core + sum(max(core / cp, t) for t in sends) + core / cp
    want_back = dense.backward_s[1] - 2 * core + sum(max(2 * core / cp, t) for t in backward_sends)
    for stage, expected in (("dense", want), ("dense_backward", want_back)):
        mine = block_phases(phases, stage, 1)
        assert tl.end[mine].max() - tl.start[mine].min() == pytest.approx(expected, rel=1e-9), stage
    if cp == 2:  # NVLink: the sends hide
        assert max(sends + backward_sends) < core / cp
    else:  # across the nodes' NICs: the sends show
        assert min(sends + backward_sends) > 2 * core / cp


def test_the_ring_holds_the_blocks_in_flight():
    """Forward step i holds i + 2 blocks (TE keeps every block received until the attention
    returns; the last step CP), the backward 4 (a block and its gradients to send, and to
    receive)."""
    s = scenario(8)
    _, phases, _ = step_phases(s)
    block = kv_block_bytes(s)
    ring = [ph for ph in phases if ph.layer == 0 and ph.kind == "compute" and ph.mem_transient is not None
            and ph.stage in ("dense", "dense_backward")]
    forward = [float(ph.mem_transient[0]) / block for ph in ring if ph.stage == "dense"]
    backward = [float(ph.mem_transient[0]) / block for ph in ring if ph.stage == "dense_backward"]
    assert forward == [2, 3, 4, 5, 6, 7, 8, 8]
    assert backward == [4] * 8


def test_the_activations_are_those_of_the_gpus_own_tokens():
    """A layer keeps Korthikanti's activations of the GPU's S / CP tokens (flash attention:
    nothing of S x S), whatever part of the sequence they are."""
    s = scenario(2)
    dense = ClusterSim(s, load_profile("h200")).builder.dense
    want = layer_activation_bytes(shape_of(s), seq_len=S // 2, micro_batch=1, moe=True, dtype_bytes=2)
    assert dense.layer_activation(moe=True) == want
    whole = ClusterSim(scenario(1), load_profile("h200")).builder.dense
    assert whole.layer_activation(moe=True) == 2 * want
