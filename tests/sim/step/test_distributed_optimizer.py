"""Megatron-Core's distributed optimizer on the simulator (issue 25, item 5;
``testbed.policy.distributed_optimizer``, ``sim.step.param_gather``): with ZeRO >= 1 and
Adam each gradient bucket is reduce-scattered and its updated parameters all-gathered, the
expert shards' over their replicas likewise; ``transformer.grad_reduce_dtype`` sizes the
reduce-scatter; ``overlap_grad_reduce`` and ``overlap_param_gather`` hide them behind the
backward and the next forward. ZeRO-1's traffic per step is worked out by hand from the
parameter counts on 8 GPUs of the h200 profile (NCCL: ring reduce-scatter and all-gather)
over two nodes: DP 8 for the dense weights, EP 4 with two replicas of every expert."""

import numpy as np
import pytest

from real.backend import RealBackend
from sim.backend import ClusterSim, SimBackend, decide_step, routing_source
from sim.hardware.compute import ComputeModel
from sim.step.schedule import run_analytic
from testbed.core.errors import ScenarioError
from testbed.core.stages import BACKWARD
from testbed.model.whole_model import shape_of
from testbed.policy.collectives import ByteLedger
from testbed.policy.distributed_optimizer import is_param_gather
from testbed.policy.planner import Planner, packed_bytes
from testbed.run.features import check_features
from testbed.run.results import summarize
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

H, E, F, S, V, L = 64, 8, 128, 128, 1000, 2
W, EP = 8, 4  # dense DP 8; each expert on W / EP = 2 replicas


def scenario(hidden: int = H, ffn: int = F, tokens: int = 256, bucket=1, **transformer) -> Scenario:
    """Two MoE layers of two attention sublayers and one dense FFN each (moe_every 2), bf16,
    untied embeddings; ``bucket`` = comm.grad_bucket_bytes (1: every layer its own bucket)."""
    return Scenario.from_dict({
        "model": {"hidden_size": hidden, "ffn_hidden_size": ffn, "num_experts": E, "num_layers": L, "dtype": "bf16"},
        "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 1, "profile": "h200"},
        "parallelism": {"ep_size": EP},
        "pager": {"enabled": False},
        "comm": {"grad_bucket_bytes": bucket},
        "workload": {"tokens_per_rank": tokens},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": S, "vocab_size": V,
                        "moe_every": 2, **transformer},
        "run": {"steps": 2, "warmup_steps": 1},
    })


def by_hand(s: Scenario) -> tuple[list[int], list[int], int]:
    """(the fp32 router bytes and the bf16 dense bytes of each layer's gradient bucket, in
    backward order, and one expert shard's bf16 gradient bytes): from the parameter counts.
    A layer's block: two attentions and one dense FFN; layer 1 holds the output head
    (V x H), layer 0 the input embedding."""
    shape = shape_of(s)
    router = (H * E + E) * 4
    block = 2 * shape.attention_params + shape.dense_ffn_params
    dense = [(block + V * H) * 2, (block + V * H) * 2]  # layer 1 (head), layer 0 (embedding)
    shard = (E // EP) * 2 * H * F * 2  # two local experts of two H x F matrices
    return [router, router], dense, shard


def test_zero1_reduce_scatters_each_bucket_then_gathers_its_updated_parameters():
    """Per bucket (here a layer), in backward order: a reduce-scatter of its gradients over
    the 8 GPUs, (p - 1) size on the wire = 7/8 of the bucket from each GPU; then an
    all-gather of each GPU's 1/8 of the updated parameters, p (p - 1) size = the same bytes:
    the all-reduce's together. The expert shards: over their 2 replicas, the same way."""
    s = scenario(zero_stage=1)
    routers, dense, shard = by_hand(s)
    planner = Planner(s)
    ops = planner.dense_sync_ops()
    assert [(op.kind, op.layer, op.batch) for op in ops] == [
        ("reduce_scatter", 1, 0), ("all_gather", 1, 1), ("reduce_scatter", 0, 0), ("all_gather", 0, 1)]
    ledger = ByteLedger(planner.layout)
    for op, bucket in zip(ops, [r + d for r, d in zip(routers, dense) for _ in (0, 1)]):
        assert bucket % W == 0  # equal shards: no padding in this model
        assert op.members == tuple(range(W))
        assert op.size == (bucket if op.kind == "reduce_scatter" else bucket // W)
        assert ledger.op_bytes(op)[0] == (W - 1) * bucket
    assert [is_param_gather(op) for op in ops] == [False, True, False, True]
    experts = planner.expert_sync_ops(1, [])
    assert [(op.kind, op.members, op.size) for op in experts] == (
        [("reduce_scatter", (j, j + EP), shard) for j in range(EP)]
        + [("all_gather", (j, j + EP), shard // 2) for j in range(EP)])
    assert all(ledger.op_bytes(op)[0] == shard for op in experts)  # (2 - 1) x shard each
    plain = Planner(scenario()).dense_sync_ops()  # ZeRO 0: the all-reduces, as before
    assert [(op.kind, op.size) for op in plain] == [("all_reduce", r + d) for r, d in zip(routers, dense)]


@pytest.mark.parametrize("dtype", ["model", "fp32"])
def test_a_steps_zero1_bytes_are_the_closed_form_and_fp32_doubles_the_dense_reduce_scatter(dtype):
    """The step's dense_sync bytes: reduce-scatters (W - 1) (R + g D) with R the routers'
    fp32 gradients, D the bf16 dense ones and g = 1 (model) or 2 (fp32: each bf16 element
    summed in 4 bytes), all-gathers (W - 1) (R + D) (the parameters in their own dtype).
    expert_sync: the M10 discovery (W (W - 1) x ceil(L E / 8) bytes), then per layer and
    shard (2 - 1) x g x shard + (2 - 1) x shard. In the model dtype ZeRO 0's all-reduces
    move the same bytes."""
    s = scenario(zero_stage=1, grad_reduce_dtype=dtype)
    routers, dense, shard = by_hand(s)
    g = 2 if dtype == "fp32" else 1
    r, d = sum(routers), sum(dense)
    out = summarize(SimBackend().run(s).records, 1)["bytes_by_stage"]
    assert out["dense_sync"] == (W - 1) * (r + g * d) + (W - 1) * (r + d)
    discovery = W * (W - 1) * packed_bytes(L * E)
    assert out["expert_sync"] == discovery + L * EP * ((g + 1) * shard)
    if dtype == "model":
        zero0 = summarize(SimBackend().run(scenario()).records, 1)["bytes_by_stage"]
        assert zero0["dense_sync"] == out["dense_sync"] == 2 * (W - 1) * (r + d)
        assert zero0["expert_sync"] == out["expert_sync"]


# ---- time: a model whose gradient sync is a large share of its step -------------------------------

def timed(**transformer):
    """(sim, phases, timeline) of one step of a wider model (H 1024, 4,096 tokens a GPU,
    one bucket per layer)."""
    s = scenario(hidden=1024, ffn=1024, tokens=4096, **transformer)
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    phases = sim.builder.build(decide_step(sim.controller, 0, np.asarray(routing_source(s)(0))))
    return sim, phases, run_analytic(phases, s.world_size, sim.timer, 0.0, sim.copy_latency)


def step_s(tl) -> float:
    return float(tl.end.max() - tl.t0)


def tail_s(phases, tl) -> float:
    """Seconds from the end of the step's last backward phase to the step's end."""
    back = [p for p, ph in enumerate(phases) if ph.stage in BACKWARD]
    return float(tl.end.max() - tl.end[back].max())


def gathers(phases) -> list[int]:
    return [p for p, ph in enumerate(phases) if ph.kind == "ops" and all(is_param_gather(op) for op in ph.ops)]


def test_without_the_overlaps_the_gathers_follow_the_optimizer_in_order():
    sim, phases, tl = timed(zero_stage=1)
    opt = next(p for p, ph in enumerate(phases) if ph.stage == "optimizer")
    ag = gathers(phases)
    assert len(ag) == 2 * L  # every layer's dense bucket, then every layer's expert shards
    assert [(phases[p].stage, phases[p].layer) for p in ag] == [
        ("dense_sync", 1), ("dense_sync", 0), ("expert_sync", 1), ("expert_sync", 0)]
    assert all(p > opt and phases[p].stream == "comm" for p in ag)
    assert tl.start[ag[0]].min() >= tl.end[opt].max()
    assert all(tl.start[b].min() >= tl.end[a].max() for a, b in zip(ag, ag[1:]))
    rs = [p for p, ph in enumerate(phases) if ph.stage == "dense_sync" and p not in ag and ph.kind == "ops"]
    assert all(tl.start[p].min() >= tl.end[[q for q, ph in enumerate(phases) if ph.stage in BACKWARD]].max()
               for p in rs)  # the reduce-scatters after the whole backward


def test_with_the_overlaps_the_sync_hides_behind_the_backward_and_the_next_forward():
    """overlap_grad_reduce starts each bucket's reduce-scatter once its layer's backward is
    done; overlap_param_gather runs the all-gathers on the sync stream one layer ahead of the
    forward, each layer's forward starting only once its own have arrived. The step's tail
    (after the backward) loses the all-gathers and most of the reduce-scatters; the step is
    shorter, yet never shorter than the compute stream's work."""
    _, plain_phases, plain = timed(zero_stage=1)
    _, grad_phases, grad = timed(zero_stage=1, overlap_grad_reduce=True)
    _, phases, both = timed(zero_stage=1, overlap_grad_reduce=True, overlap_param_gather=True)
    assert step_s(both) < step_s(grad) < step_s(plain)
    assert tail_s(phases, both) < tail_s(grad_phases, grad) < tail_s(plain_phases, plain)
    compute = [p for p, ph in enumerate(phases) if ph.kind == "compute"]
    assert step_s(both) >= float((both.end[compute] - both.start[compute]).sum(axis=0).max())
    ag = gathers(phases)
    assert all(phases[p].stream == "sync" for p in ag)
    assert both.start[ag[0]].max() == both.t0  # the first layer's from the step's start
    for layer in range(L):
        mine = [p for p in ag if phases[p].layer == layer]
        first = next(p for p, ph in enumerate(phases) if ph.layer == layer and ph.stage == "dense"
                     and ph.kind == "compute")
        assert both.start[first].min() >= both.end[mine].max()  # its forward waits for its parameters
    # the next layer's all-gathers are issued when the forward reaches this one
    layer0 = next(p for p, ph in enumerate(phases) if ph.layer == 0 and ph.stage == "dense")
    assert min(both.start[p].min() for p in ag if phases[p].layer == 1) >= both.start[layer0].min()
    opt = next(p for p, ph in enumerate(phases) if ph.stage == "optimizer")
    assert all(p < opt for p in ag)  # none after the optimizer


def test_in_a_pipeline_stage_the_gathers_hide_behind_the_steps_forwards():
    """With micro-batches (here two, as gradient accumulation: ``sim.pipeline.run``) the stage's
    one simulated micro-batch stands for every micro-batch's forward, while Megatron-Core waits
    for an all-gather in the first one only: with overlap_param_gather they get no phase there,
    and their bytes are counted all the same."""
    s = scenario(hidden=1024, ffn=1024, tokens=4096, zero_stage=1, overlap_grad_reduce=True, micro_batches=2)
    grad = summarize(SimBackend().run(s).records, 1)
    both = summarize(SimBackend().run(s.replace(transformer={"overlap_param_gather": True})).records, 1)
    assert both["step_time_s"] < grad["step_time_s"]
    assert both["bytes_by_stage"] == grad["bytes_by_stage"]
    stage = s.replace(transformer={"micro_batches": 1, "overlap_param_gather": True})
    sim = ClusterSim(stage, load_profile("h200"), pipeline_stage=True)
    phases = sim.builder.build(decide_step(sim.controller, 0, np.asarray(routing_source(stage)(0))))
    assert gathers(phases) == []
    sim = ClusterSim(stage, load_profile("h200"))
    assert len(gathers(sim.builder.build(decide_step(sim.controller, 0, np.asarray(routing_source(stage)(0)))))) == 2 * L


def test_the_optimizer_updates_each_gpus_shard():
    """Adam's seconds (memory-bound) on a GPU's 1/8 of the dense and router parameters and
    1/2 of its experts' (their two replicas), against all of them under ZeRO 0."""
    s = scenario(hidden=1024, ffn=1024, tokens=4096, zero_stage=1)
    compute = ComputeModel(load_profile("h200"), "bf16", W)
    shape = shape_of(s)
    experts = L * (E // EP) * 2 * 1024 * 1024  # every local expert takes tokens
    dense = shape.params - L * E * 2 * 1024 * 1024 - L * 1024 * E  # attention, dense FFNs, embeddings
    routers = L * (1024 * E + E)

    def optimizer_s(sc):
        return summarize(SimBackend().run(sc).records, 1)["stage_time_s"]["optimizer"]
    assert optimizer_s(s) == pytest.approx(compute.adam_time(experts / 2 + (dense + routers) / W, 2, 12), rel=1e-9)
    assert optimizer_s(s.replace(transformer={"zero_stage": 0})) == pytest.approx(
        compute.adam_time(experts + dense + routers, 2, 12), rel=1e-9)


def test_overlap_grad_reduce_at_zero_0_is_sync_with_backward():
    _, _, megatron = timed(overlap_grad_reduce=True)
    s = scenario(hidden=1024, ffn=1024, tokens=4096).replace(overlap={"sync_with_backward": True})
    sim = ClusterSim(s, load_profile("h200"))
    phases = sim.builder.build(decide_step(sim.controller, 0, np.asarray(routing_source(s)(0))))
    testbed = run_analytic(phases, W, sim.timer, 0.0, sim.copy_latency)
    assert step_s(megatron) == step_s(testbed)
    _, _, plain = timed()
    assert step_s(megatron) < step_s(plain)


def test_bad_combinations_are_named_before_a_run_and_the_real_backend_refuses_the_fields(tmp_path):
    with pytest.raises(ScenarioError, match=r"transformer.overlap_param_gather = True: .*zero_stage >= 1"):
        SimBackend().check(scenario(overlap_grad_reduce=True, overlap_param_gather=True))
    with pytest.raises(ScenarioError, match=r"transformer.overlap_param_gather = True: .*overlap_grad_reduce"):
        run_scenario(scenario(zero_stage=1, overlap_param_gather=True).replace(run={"output_dir": str(tmp_path)}), "sim")
    assert not list(tmp_path.iterdir())  # refused before any run folder
    with pytest.raises(ScenarioError, match=r"transformer.overlap_param_gather = True: .*adam"):
        SimBackend().check(scenario(zero_stage=1, optimizer="sgd", overlap_grad_reduce=True,
                                    overlap_param_gather=True))
    with pytest.raises(ScenarioError, match="transformer.grad_reduce_dtype"):
        scenario(grad_reduce_dtype="bf16")
    for field, value in (("overlap_grad_reduce", True), ("grad_reduce_dtype", "fp32")):
        s = scenario(**{field: value})
        check_features(s, "sim")
        with pytest.raises(ScenarioError, match=rf"transformer.{field} = .*the real backend does not model"):
            check_features(s, "real")
    with pytest.raises(ScenarioError, match="transformer.zero_stage"):
        RealBackend().check(scenario(zero_stage=1))
