"""Pipeline stages with several micro-batches a step on the real backend (issue 25, item 4):
PP 2 x EP 2 on 4 CPU ranks (stage 0: ranks 0-1, MoE layers 0-1 and the embedding; stage 1:
ranks 2-3, layers 2-3 and the head), ``transformer.micro_batches`` = 4, each stage in
Megatron-LM's non-interleaved 1F1B order (stage 0: F0 F1 B0 F2 B1 F3 B2 B3; stage 1: F0 B0
F1 B1 ...), the gradients of the four backwards accumulated and one optimizer step a step.

Against the one-stage run of the same tokens in one micro-batch (EP 2 on 2 ranks, all four
layers): the same loss every step, and the same routing - the trace holds each step's counts
as the micro-batches' summed, and each micro-batch's besides (``micro_routed``). The
simulator's replay of the pipelined scenario on that trace, each pipeline rank replaying each
micro-batch, moves the pipelined run's bytes exactly, every stage and link level; the one-stage
replay moves the same but for the route all-gathers, which a pipeline stage runs once per
micro-batch. Four stages on 8 ranks, with fewer and more micro-batches than stages, give the
one-stage losses too.

Scaling: micro-batch i's backward starts from its mean loss over its T/m tokens divided by
the ranks and by m, so the m gradients sum to that of the step's mean over its T tokens,
the one-stage run's (float32 reduction order aside: ``float_bound``). What must match exactly
for that is off: the router's Gumbel noise (each micro-batch draws its own), the Switch aux
loss (a micro-batch's is not a share of the whole batch's; Megatron computes it per
micro-batch too) and token drops (capacity is per micro-batch, as Megatron's dispatcher
applies it: dropless here)."""

import re

import numpy as np
import pytest

from real.backend import RealBackend
from testbed.core.errors import RunError
from testbed.run.backend import get_backend
from testbed.run.routing_trace import RoutingTrace
from testbed.scenario.scenario import Scenario

M = 4  # micro-batches a step


def scenario(tmp_path, **sections) -> Scenario:
    """4 CPU ranks (2 nodes of 2), PP 2, EP 2 in each stage; 4 MoE layers after a dense layer
    each (moe_every 2), grouped-query attention over sequences of 32 tokens; 128 tokens a rank
    and step, so each micro-batch is one sequence; Adam; bias balancing (the one bias moves by
    the step's counts, the micro-batches' summed) and a heat update every 2 steps."""
    d = {
        "model": {"hidden_size": 32, "ffn_hidden_size": 64, "num_layers": 4, "num_experts": 4},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2, "pp_size": 2},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": 32, "vocab_size": 256,
                        "moe_every": 2, "adam_learning_rate": 3e-3, "micro_batches": M},
        "router": {"noise": "none", "aux_loss_coef": 0.0, "capacity_factor": 0.0, "bias_update_rate": 0.01},
        "heat": {"update_interval": 2, "window_steps": 4},
        "pager": {"enabled": False},  # refused with pipelines (testbed.scenario)
        "comm": {"expert_sync": "allreduce"},  # two-stage's cached groups are refused with pipelines (real.backend)
        "workload": {"tokens_per_rank": 128},
        "run": {"steps": 4, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")},
        "checkpoint": {"enabled": True, "optimizer_interval": 2, "expert_interval": 2},
    }
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return Scenario.from_dict(d)


def one_stage(s: Scenario) -> Scenario:
    """The same tokens on one stage in one micro-batch: a stage's 2 ranks (one node) with every layer."""
    return s.replace(cluster={"nodes_per_microcluster": 1}, parallelism={"pp_size": 1},
                     transformer={"micro_batches": 1}, checkpoint={"enabled": False})


def model_name(name: str, first_layer: int) -> str:
    """A stage's weight name (its layers numbered from 0) as the one-stage run names it."""
    return re.sub(r"^(router|layer)(\d+)", lambda m: f"{m[1]}{int(m[2]) + first_layer}", name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp_micro")
    s = scenario(tmp)
    one = RealBackend().run(one_stage(s), debug={"capture": True})
    pp = RealBackend().run(s, run_dir=tmp / "straight", debug={"capture": True})
    pp.routing.save(tmp / "straight")  # as the runner writes it into the run folder
    trace = {"trace": str(tmp / "straight")}
    flat = get_backend("sim").run(one_stage(s).replace(workload=trace))  # the step's counts, summed
    piped = get_backend("sim").run(s.replace(workload=trace, checkpoint={"enabled": False}))  # each micro-batch's
    return tmp, s, one, pp, (flat, piped)


@pytest.mark.slow
def test_every_step_loss_equals_the_one_stage_runs(runs, float_bound):
    _, s, one, pp, _ = runs
    assert len(pp.records) == s.run.steps
    for a, b in zip(one.records, pp.records, strict=True):
        assert b.loss == float_bound.approx(a.loss, float_bound.chain(s))
    assert pp.records[-1].loss < pp.records[0].loss
    # the last stage's outputs of each step, its micro-batches' in order, are the one-stage run's
    n = float_bound.chain(s)
    for rank in (2, 3):
        for got, want in zip(pp.captured[rank]["outputs"], one.captured[rank - 2]["outputs"], strict=True):
            float_bound.assert_close(got, want, n)


@pytest.mark.slow
def test_each_stage_runs_its_micro_batches_in_1f1b_order(runs):
    """Megatron-LM's warm-up: p - s - 1 forwards on stage s, then one forward and one backward,
    then the backwards left; the one-stage run: its one micro-batch's forward and backward."""
    _, _, one, pp, _ = runs
    stage0 = ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    stage1 = ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert [cap["order"] for cap in pp.captured] == [stage0, stage0, stage1, stage1]
    assert [cap["order"] for cap in one.captured] == [["F0", "B0"]] * 2


@pytest.mark.slow
def test_the_first_steps_accumulated_gradients_are_the_one_stage_runs(runs, float_bound):
    """Every weight's gradient of step 0 (summed over ranks: the synced experts', the routers'
    and the dense weights' - Adam would hide a gradient off by the factor m), stage k's layer j
    being the model's layer 2k + j."""
    _, s, one, pp, _ = runs
    n, E = float_bound.chain(s), s.model.num_experts
    for rank, cap in enumerate(pp.captured):
        stage, local = divmod(rank, 2)
        ref = one.captured[local]
        assert {"embedding" if stage == 0 else "head"} <= set(cap["named_grads"])
        for name, grad in cap["named_grads"].items():
            float_bound.assert_close(grad, ref["named_grads"][model_name(name, 2 * stage)], n, msg=name)
        assert len(cap["expert_grads"]) == 2 * 2  # its 2 experts of each of its 2 layers
        for inst, grad in cap["expert_grads"].items():
            float_bound.assert_close(grad, ref["expert_grads"][inst + 2 * stage * E], n, msg=str(inst))


@pytest.mark.slow
def test_the_routing_trace_holds_the_micro_batches_counts_and_their_sum(runs):
    """[steps, the model's 4 layers, a stage's 2 ranks, 4 experts]: stage k's ranks route layers
    2k, 2k + 1; each micro-batch routes its own 32 tokens (top-2: 64 slots a layer), their sum is
    the step's row, and the whole is the one-stage run's trace. Each micro-batch's counts are kept
    as well ([steps, m, layers, ranks, experts]) and read back from the run folder; the one-stage
    run, of one micro-batch, keeps none."""
    tmp, s, one, pp, _ = runs
    trace, micro_trace = pp.routing.routed, pp.routing.micro_routed
    assert trace.shape == (s.run.steps, 4, 2, 4) and pp.routing.tokens_per_rank == 128
    assert micro_trace.shape == (s.run.steps, M, 4, 2, 4)
    for rank, cap in enumerate(pp.captured):
        stage, local = divmod(rank, 2)
        micro = np.stack(cap["micro_routed"])  # [steps, m, 2 layers, E]
        assert micro.shape == (s.run.steps, M, 2, 4)
        assert (micro.sum(axis=-1) == 128 // M * s.model.top_k).all()
        assert np.array_equal(trace[:, 2 * stage:2 * stage + 2, local], micro.sum(axis=1))
        assert np.array_equal(micro_trace[:, :, 2 * stage:2 * stage + 2, local], micro)
        assert len({micro[:, i].tobytes() for i in range(M)}) == M  # the micro-batches route differently
    assert np.array_equal(trace, one.routing.routed) and one.routing.micro_routed is None
    saved = RoutingTrace.load(tmp / "straight")
    assert np.array_equal(saved.routed, trace) and np.array_equal(saved.micro_routed, micro_trace)


@pytest.mark.slow
def test_the_pipelined_replay_moves_the_same_bytes_every_stage_and_link_level(runs):
    """The simulator's replay of the trace on the pipelined scenario (each pipeline rank each
    micro-batch's counts, testbed.run.routing_trace) moves exactly the pipelined run's bytes,
    every stage and link level, route all-gathers included (once per micro-batch and layer). The
    replay of the one-stage scenario moves the one-stage run's bytes, which are the pipeline's but
    for those all-gathers (E int32 over each EP group, inside a node: NVLink); dropless, the token
    rows of the four micro-batches add up to the one micro-batch's. The stages' activations and
    gradients (T x H fp32 each way per rank pair and step) are counted apart, as the simulator's
    pipeline counts them: the same per GPU as its sends."""
    _, s, one, pp, (flat, piped) = runs
    for a, b, r, q in zip(one.records, pp.records, flat.records, piped.records, strict=True):
        assert b.bytes_by_stage == q.bytes_by_stage and b.bytes_by_level == q.bytes_by_level
        assert a.bytes_by_stage == r.bytes_by_stage and a.bytes_by_level == r.bytes_by_level
        route = r.bytes_by_stage["route"]
        assert route == 4 * 2 * 4 * 4  # layers x ranks x E x int32
        assert b.bytes_by_stage == dict(r.bytes_by_stage, route=M * route)
        assert b.bytes_by_level == dict(r.bytes_by_level, nvlink=r.bytes_by_level["nvlink"] + (M - 1) * route)
        assert b.page_moves == r.page_moves == q.page_moves == 0 and b.dropped_slots == r.dropped_slots == 0
        assert b.bytes_by_stage["dispatch"] > 0 and b.bytes_by_stage["dense_sync"] > 0
        assert b.extra["pipeline_sent_bytes"] == 4 * 128 * 32 * 4
    assert piped.extra["pipeline"]["send_bytes_per_gpu"] * s.world_size == 4 * 128 * 32 * 4
    assert piped.extra["pipeline"]["in_flight"] == [2, 1]  # 1F1B: stage 0 holds two micro-batches, stage 1 one


@pytest.mark.slow
def test_the_sync_issued_from_the_last_micro_batchs_backward_gives_the_same_losses(runs, tmp_path, float_bound):
    """overlap.sync_with_backward (M22): the buckets' all-reduces go from the last micro-batch's
    backward, once every micro-batch's gradient is in (Megatron-LM overlaps the grad reduce so)."""
    _, s, one, _, _ = runs
    s2 = s.replace(overlap={"sync_with_backward": True}, checkpoint={"enabled": False})
    during = RealBackend().run(s2)
    for a, b in zip(one.records, during.records, strict=True):
        assert b.loss == float_bound.approx(a.loss, float_bound.chain(s))


@pytest.mark.slow
def test_a_killed_run_resumes_with_the_same_losses(runs):
    """Each rank of each stage checkpoints into its own folder after the step's last micro-batch:
    a run killed after 3 steps continues from the checkpoint at 2 as the run never stopped."""
    tmp, s, _, straight, _ = runs
    with pytest.raises(RunError, match="rank 3 died"):
        RealBackend().run(s, run_dir=tmp / "killed", debug={"fail_at": {"rank": 3, "after_steps": 3}})
    resumed = RealBackend().run(s, run_dir=tmp / "killed", resume=True)
    first = resumed.extra["resumed_from"]
    assert first == 2
    for a, b in zip(straight.records[first:], resumed.records, strict=True):
        assert (a.step, a.loss, a.bytes_by_stage) == (b.step, b.loss, b.bytes_by_stage)
    assert np.array_equal(resumed.routing.routed, straight.routing.routed)  # steps 0-1 from the checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("m", [2, 8])
def test_four_stages_give_the_one_stage_losses(tmp_path, float_bound, m):
    """PP 4 x EP 2 on 8 ranks, one MoE layer a stage: with fewer micro-batches than stages (m = 2:
    the first stages' warm-up is all their forwards) and more (m = 8: stage 0 warms up with 3),
    every step's loss is the one-stage run's on 2 ranks."""
    s = scenario(tmp_path, cluster={"nodes_per_microcluster": 4}, parallelism={"pp_size": 4},
                 transformer={"micro_batches": m}, workload={"tokens_per_rank": 256}, run={"steps": 3},
                 checkpoint={"enabled": False})
    pp = RealBackend().run(s)
    one = RealBackend().run(one_stage(s))
    for a, b in zip(one.records, pp.records, strict=True):
        assert b.loss == float_bound.approx(a.loss, float_bound.chain(s))
    assert pp.records[0].extra["pipeline_sent_bytes"] == 2 * 3 * 2 * 256 * 32 * 4  # 3 boundaries, both ways
