"""Megatron-Core's combined 1F1B (``overlap.moe_expert_parallel_comm``): the steady-state
forward and backward of a stage run as one overlapped pair (``sim.pipeline.schedule``,
``OverlappedPair``) in DualPipe's pair time (``sim.pipeline.stage_work.overlapped_seconds``),
after one warm-up forward more; refused where Megatron-Core refuses it
(``testbed.policy.combined_1f1b``)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.pipeline.schedule import OverlappedPair, run_pipeline, schedule_order
from sim.pipeline.stage_work import ChunkWork, overlapped_seconds
from testbed.core.errors import ScenarioError
from testbed.policy.combined_1f1b import check_combined_1f1b
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

ROUNDING = 1e-12  # float64 sums of a few hundred seconds-sized terms


def _equal(p, m, v, f, b, pair=None):
    """Every stage and chunk alike, sends free: forward f, backward b, a pair ``pair`` seconds (None: plain)."""
    pair_s = None if pair is None else np.full((p, v, v), pair)
    return run_pipeline(np.full((p, v), f), np.full((p, v), b), np.zeros(p), m, v, pair_s=pair_s)


def _pairs_per_stage(p, m, v):
    """Megatron's get_pp_rank_microbatches with the overlap: (p-s-1)*2 + (v-1)*p + 1 warm-up forwards (p - s for
    v = 1), at most m v; every other forward is in a pair."""
    warm = [min(p - s if v == 1 else 2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p)]
    return [m * v - w for w in warm]


CASES = [(1, 4, 1), (1, 9, 1), (2, 4, 2), (4, 8, 2), (4, 16, 2), (2, 6, 4), (8, 16, 2), (4, 12, 3), (4, 4, 2)]
TIMES = [(1.0, 2.0, 2.5), (1.0, 1.0, 1.0), (2.0, 1.0, 2.5), (1.0, 2.0, 2.9), (0.5, 1.5, 1.5)]


@pytest.mark.parametrize("p, m, v", CASES)
@pytest.mark.parametrize("f, b, pair", TIMES)
def test_each_pair_of_the_last_stage_saves_f_plus_b_less_the_pair(p, m, v, f, b, pair):
    # The last stage runs the most pairs and is the critical path: the step is 1F1B's less its pairs' savings.
    plain, combined = _equal(p, m, v, f, b), _equal(p, m, v, f, b, pair)
    pairs = _pairs_per_stage(p, m, v)
    assert combined.pairs.tolist() == pairs and max(pairs) == pairs[-1]
    expect = plain.makespan_s - pairs[-1] * (f + b - pair)
    assert combined.makespan_s == pytest.approx(expect, rel=ROUNDING, abs=ROUNDING)
    # each stage's bubble as before: the makespan less its busy time, a pair counted once
    busy = m * v * (f + b) - np.array(pairs) * (f + b - pair)
    np.testing.assert_allclose(combined.busy_s, busy, rtol=ROUNDING)
    np.testing.assert_allclose(combined.bubble_fraction, 1 - busy / combined.makespan_s, rtol=1e-9, atol=ROUNDING)


@pytest.mark.parametrize("p, m, v", CASES)
def test_pairs_hold_no_more_micro_batches_than_interleaved_1f1b(p, m, v):
    # The extra warm-up forward takes what 1F1B's first steady-state forward took; a pair frees its backward's
    # micro-batch as it takes its forward's. (m == p: Megatron's old all-warm-up case holds m v, the pairs less.)
    combined = _equal(p, m, v, 1.0, 2.0, 2.5)
    expect = [min(p - s if v == 1 else 2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p)]
    assert combined.in_flight.tolist() == expect
    assert np.all(combined.in_flight <= _equal(p, m, v, 1.0, 2.0).in_flight)


def test_no_pipelining_pairs_the_next_micro_batch_with_the_last_backward():
    # combined_1f1b_schedule_for_no_pipelining: F0; F(i+1) with B(i); the last backward alone
    assert schedule_order(1, 4, 1, 0, overlap=True) == [
        ("F", 0, 0), OverlappedPair(0, 1, 0, 0), OverlappedPair(0, 2, 0, 1), OverlappedPair(0, 3, 0, 2),
        ("B", 0, 3)]


def test_interleaved_pairs_follow_megatron_order():
    # stage 0 of p 4, v 2, m 8: 11 warm-up forwards (10 + the extra one), then forward k + 11 with backward k
    order = schedule_order(4, 8, 2, 0, overlap=True)
    plain = schedule_order(4, 8, 2, 0)
    forwards = [op for op in plain if op[0] == "F"]
    backwards = [op for op in plain if op[0] == "B"]
    assert order[:11] == forwards[:11]
    assert order[11:16] == [OverlappedPair(*forwards[11 + k][1:], *backwards[k][1:]) for k in range(5)]
    assert order[16:] == backwards[5:]
    for op in order[11:16]:  # the halves are different micro-batches or chunks: independent
        assert (op.forward_chunk, op.forward_micro_batch) != (op.backward_chunk, op.backward_micro_batch)


def test_one_chunk_a_stage_chains_the_pairs():
    # Why Megatron needs virtual chunks with p > 1: the last stage's pair k waits for stage p-2's pair k-1,
    # which waits for the last stage's pair k-1, so the last stage starts a pair every 2 x pair seconds.
    p, m, f, b, pair = 4, 8, 1.0, 2.0, 2.5
    combined = _equal(p, m, 1, f, b, pair)
    starts = [combined.start[p - 1, 0, op.forward_chunk, op.forward_micro_batch]
              for op in combined.orders[p - 1] if isinstance(op, OverlappedPair)]
    np.testing.assert_allclose(np.diff(starts), 2 * pair, rtol=ROUNDING)
    assert combined.makespan_s > _equal(p, m, 1, f, b).makespan_s


def test_pair_seconds_by_hand():
    # compute-bound: 0.6 + 1.5 of compute beside 0.4 + 0.5 of collectives; comm-bound: 0.2 + 0.5 beside 0.8 + 1.5
    fwd, bwd = ChunkWork(1.0, 9.0, 0.0, 0.6, 9.0, 0.0), ChunkWork(9.0, 2.0, 0.0, 9.0, 1.5, 0.0)
    assert overlapped_seconds(fwd, bwd) == pytest.approx(2.1, rel=ROUNDING)
    fwd, bwd = ChunkWork(1.0, 9.0, 0.0, 0.2, 9.0, 0.0), ChunkWork(9.0, 2.0, 0.0, 9.0, 0.5, 0.0)
    assert overlapped_seconds(fwd, bwd) == pytest.approx(2.3, rel=ROUNDING)


# ---- through the simulator ---------------------------------------------------------------------------------

def scenario(tmp_path, pp=1, micro=4, chunks=1, combined=True, **over):
    """4 nodes of 8 H200s in 2 micro-clusters; 8 MoE layers of 16 experts on EP 8, each after a dense layer;
    8 sequences of 1,024 tokens per GPU in bf16; no paging (tests/sim/pipeline/test_pipeline_run.py's)."""
    d = {
        "model": {"hidden_size": 1024, "ffn_hidden_size": 2048, "num_layers": 8, "num_experts": 16, "dtype": "bf16"},
        "cluster": {"profile": "h200", "gpus_per_node": 8, "nodes_per_microcluster": 2, "microclusters": 2},
        "parallelism": {"ep_size": 8, "pp_size": pp, "pp_chunks": chunks},
        "pager": {"enabled": False},
        "transformer": {"enabled": True, "num_heads": 8, "seq_len": 1024, "vocab_size": 32000, "moe_every": 2,
                        "micro_batches": micro},
        "workload": {"tokens_per_rank": 8192},
        "overlap": {"moe_expert_parallel_comm": combined},
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)},
    }
    for name, values in over.items():
        d.setdefault(name, {}).update(values)
    return Scenario.from_dict(d)


def test_without_stages_the_step_saves_each_pair_by_the_closed_form(tmp_path):
    # p = 1, m = 4, one chunk: F, B and the pair from the run; three pairs each save F + B - pair
    off = run_scenario(scenario(tmp_path, combined=False), "sim")["pipeline"]
    on = run_scenario(scenario(tmp_path), "sim")["pipeline"]
    (f,), (b,) = on["stage_forward_s"][0], on["stage_backward_s"][0]
    pair = on["stage_pair_s"][0][0][0]
    assert (on["stage_forward_s"], on["stage_backward_s"]) == (off["stage_forward_s"], off["stage_backward_s"])
    assert on["moe_expert_parallel_comm"] and not off["moe_expert_parallel_comm"]
    assert (on["overlapped_pairs"], on["stage_overlapped_pairs"], off["overlapped_pairs"]) == (3, [3], 0)
    assert off["makespan_s"] == pytest.approx(4 * (f + b), rel=ROUNDING)
    assert on["makespan_s"] == pytest.approx(off["makespan_s"] - 3 * (f + b - pair), rel=ROUNDING)
    assert pair < f + b  # the run's collectives hide behind the other micro-batch's compute
    assert on["stage_bubble_s"][0] == pytest.approx(0.0, abs=ROUNDING * on["makespan_s"])


def test_interleaved_run_pairs_and_pair_times(tmp_path):
    p, m, v = 2, 8, 2
    off = run_scenario(scenario(tmp_path, pp=p, micro=m, chunks=v, combined=False), "sim")
    on = run_scenario(scenario(tmp_path, pp=p, micro=m, chunks=v), "sim")
    pipe = on["pipeline"]
    assert pipe["stage_overlapped_pairs"] == _pairs_per_stage(p, m, v) == [11, 13]
    assert pipe["overlapped_pairs"] == 24 and pipe["schedule"] == "interleaved"
    assert pipe["makespan_s"] < off["pipeline"]["makespan_s"] and on["step_time_s"] < off["step_time_s"]
    # the pair never takes less than the longer of its compute and its collectives, nor more than F + B
    for r in range(p):
        fwd, bwd = pipe["stage_forward_s"][r], pipe["stage_backward_s"][r]
        fc, bc = pipe["stage_forward_compute_s"][r], pipe["stage_backward_compute_s"][r]
        for cf in range(v):
            for cb in range(v):
                pair = pipe["stage_pair_s"][r][cf][cb]
                compute, comm = fc[cf] + bc[cb], (fwd[cf] - fc[cf]) + (bwd[cb] - bc[cb])
                assert pair >= max(compute, comm) * (1 - ROUNDING)
                assert pair <= (fwd[cf] + bwd[cb]) * (1 + ROUNDING)
    # each stage's bubble: the makespan less its busy time, its pairs counted once
    busy = np.array(pipe["stage_busy_s"])
    np.testing.assert_allclose(pipe["stage_bubble_s"], pipe["makespan_s"] - busy, rtol=1e-9)
    assert np.all(busy < np.array(off["pipeline"]["stage_busy_s"]))


def test_closed_form_on_equal_stages_of_the_runs_chunk(tmp_path):
    # equal stages made of the interleaved run's last chunk (F, B and its pair with itself, read from the run)
    pipe = run_scenario(scenario(tmp_path, pp=2, micro=8, chunks=2), "sim")["pipeline"]
    f, b = pipe["stage_forward_s"][1][1], pipe["stage_backward_s"][1][1]
    pair = pipe["stage_pair_s"][1][1][1]
    for p, m, v in [(2, 8, 2), (4, 8, 2), (8, 16, 4), (1, 6, 1)]:
        plain, combined = _equal(p, m, v, f, b), _equal(p, m, v, f, b, pair)
        saved = _pairs_per_stage(p, m, v)[-1] * (f + b - pair)
        assert combined.makespan_s == pytest.approx(plain.makespan_s - saved, rel=ROUNDING)


# ---- refusals (Megatron-Core's TransformerConfig.__post_init__) ------------------------------------------

REFUSED = [
    ("parallelism.pp_chunks", {"pp": 2, "micro": 8, "chunks": 1}),
    ("parallelism.pipeline_schedule", {"pp": 2, "micro": 4, "parallelism": {"pipeline_schedule": "dualpipe"}}),
    ("parallelism.ep_size", {"parallelism": {"ep_size": 1}}),
    ("comm.token_strategy", {"comm": {"token_strategy": "allgather"}}),
    ("comm.token_strategy", {"comm": {"token_strategy": "hierarchical"}}),
    ("transformer.recompute", {"transformer": {"recompute": "full"}}),
    ("transformer.recompute_modules", {"transformer": {"recompute_modules": "moe_act,moe"}}),
    ("model.dtype", {"model": {"dtype": "fp32"}}),
    ("overlap.shared_experts", {"model": {"shared_experts": 1}}),
    ("transformer.mtp_layers", {"transformer": {"mtp_layers": 2}}),
]


@pytest.mark.parametrize("field, over", REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_megatrons_refusals_name_the_field(tmp_path, field, over):
    with pytest.raises(ScenarioError) as err:
        check_combined_1f1b(scenario(tmp_path, **over))
    assert err.value.field == field and "\n" not in str(err.value)
    assert "overlap.moe_expert_parallel_comm = true" in err.value.reason
    check_combined_1f1b(scenario(tmp_path, combined=False, **over))  # off: nothing to refuse


def test_what_megatron_allows_passes(tmp_path):
    for over in ({"pp": 2, "micro": 8, "chunks": 2}, {"comm": {"token_strategy": "deepep"}},
                 {"model": {"dtype": "fp16"}}, {"model": {"shared_experts": 1}, "overlap": {"shared_experts": False}},
                 {"transformer": {"recompute_modules": "moe_act,layernorm", "mtp_layers": 1}}):
        check_combined_1f1b(scenario(tmp_path, **over))


def test_a_refused_run_stops_before_its_folder(tmp_path):
    with pytest.raises(ScenarioError, match="parallelism.pp_chunks = 1"):
        run_scenario(scenario(tmp_path, pp=2, micro=8), "sim")
    assert not any(tmp_path.iterdir())
