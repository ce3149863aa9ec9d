"""How many micro-batches (of which chunk) a pipeline rank keeps in flight, and the activation bytes that follow
(issue 25: the published runs over 80 GB): ``sim.pipeline.schedule`` (1F1B, interleaved 1F1B),
``sim.pipeline.dualpipe`` and ``sim.pipeline.stage_memory.in_flight_bytes``, worked out by hand on small
equal-stage cases, and the activation bytes of one MoE layer (``testbed.model.whole_model``) against
Megatron-Core's tensors (``testbed.model.recompute_modules``).

Megatron-LM at d98e8a64, ``megatron/core/pipeline_parallel/schedules.py``: without interleaving stage s runs
p - s - 1 warm-up forwards (at most m), then one forward before each backward, so it holds min(p - s, m)
micro-batches of its whole stage; interleaved (``get_pp_rank_microbatches``) it runs (p - s - 1) x 2 + (v - 1) x p
warm-up forwards of *model chunks* (at most m v; all of them when m == p), then one more, each a chunk of
L / (p v) layers. DualPipe (DeepSeek-V3 report, arXiv 2412.19437, Table 2; deepseek-ai/DualPipe ``DualPipe.step``):
p + 1 chunks (each L / p layers, one per direction a stage) on the two middle stages, p on the others.
"""

from __future__ import annotations

import numpy as np
import pytest

from sim.pipeline.dualpipe import dualpipe_order, run_dualpipe
from sim.pipeline.schedule import run_pipeline, schedule_order
from sim.pipeline.stage_memory import in_flight_bytes
from testbed.model.recompute_modules import LayerRecompute
from testbed.model.transformer_shape import TransformerShape
from testbed.model.whole_model import expert_row_elements, layer_activation_bytes
from testbed.run.memory_verdict import summary_memory_verdict


def _pipeline_in_flight(p: int, m: int, v: int) -> list[int]:
    return [int(x) for x in run_pipeline(np.ones((p, v)), np.ones((p, v)), np.zeros(p), m, v).in_flight]


@pytest.mark.parametrize("p, m, expected", [
    (4, 8, [4, 3, 2, 1]),  # p - s: warm-up p - s - 1, then one forward before the first backward
    (4, 2, [2, 2, 2, 1]),  # capped at m: stages 0 and 1 run both forwards as warm-up, stage 2 one and one more
    (1, 3, [1]),
])
def test_1f1b_holds_p_minus_s_whole_stage_micro_batches(p, m, expected):
    assert _pipeline_in_flight(p, m, 1) == expected


@pytest.mark.parametrize("p, m, v, expected", [
    (2, 4, 2, [5, 3]),  # stage 0: (2-0-1) x 2 + (2-1) x 2 = 4 warm-up chunks, + 1; stage 1: 0 + 2, + 1
    (4, 8, 2, [11, 9, 7, 5]),  # (3 - s) x 2 + 4 + 1
    (4, 8, 3, [15, 13, 11, 9]),  # (3 - s) x 2 + 8 + 1
    (2, 24, 4, [9, 7]),  # 2 + 6 + 1, 0 + 6 + 1
    (2, 2, 2, [4, 4]),  # m == p: every forward is warm-up (Megatron's all_warmup), m v = 4 chunks
])
def test_interleaved_holds_megatrons_warm_up_plus_one_chunks(p, m, v, expected):
    assert _pipeline_in_flight(p, m, v) == expected
    want = [min((p - s - 1) * 2 + (v - 1) * p + 1, m * v) if m != p else m * v for s in range(p)]
    assert expected == want


def test_interleaved_chunks_hold_their_own_bytes():
    """p = 2, m = 4, v = 2, stage 0's order: F(c0,0) F(c0,1) F(c1,0) F(c1,1) F(c0,2) | B(c1,0) F(c0,3) B(c1,1)
    F(c1,2) B(c0,0) F(c1,3) ...: at most {c0: 3, c1: 2} (after the warm-up) or {c0: 4, c1: 1} (after F(c0,3)):
    3 a0 + 2 a1 or 4 a0 + a1, whichever is larger."""
    order = schedule_order(2, 4, 2, 0)
    assert order[:8] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("F", 0, 2), ("B", 1, 0),
                         ("F", 0, 3), ("B", 1, 1)]
    assert in_flight_bytes(order, [10.0, 1.0]) == 41.0  # 4 x 10 + 1
    assert in_flight_bytes(order, [1.0, 10.0]) == 23.0  # 3 x 1 + 2 x 10
    # whole-stage chunks of a layers each over L = p v chunks: 5 chunks of L / 4 layers, 1.25 stages' worth,
    # against 1F1B's p = 2 micro-batches of L / 2 layers (1 stage's worth x 2)
    assert in_flight_bytes(order, [1.0, 1.0]) == 5.0


@pytest.mark.parametrize("p, m, expected", [
    (4, 8, [4, 5, 5, 4]),
    (4, 12, [4, 5, 5, 4]),
    (8, 16, [8, 8, 8, 9, 9, 8, 8, 8]),
])
def test_dualpipe_holds_p_plus_one_chunks_on_the_middle_stages(p, m, expected):
    one = np.ones((p, 2))
    sched = run_dualpipe(one, 2 * one, 0.5 * one, 2.5 * one, np.zeros(p - 1), m)
    assert [int(x) for x in sched.in_flight] == expected


def test_dualpipe_in_flight_bytes_by_direction():
    """p = 4, m = 8 by hand from ``DualPipe.step``'s steps. Stage 1 (a middle one): step 2 F0 F1 F0 F1 ->
    {d0: 2, d1: 2}; step 4's first F0 alone -> {3, 2}, its B1 -> {3, 1}, then pairs. Stage 0: step 1 F0 F0,
    step 2 F0 F1 -> {3, 1}; step 3 I1 W F1 -> {3, 1}; step 4's F&B (F0, B1) -> {4, 0}."""
    assert in_flight_bytes(dualpipe_order(4, 8, 1), [10.0, 1.0]) == 32.0  # 3 x 10 + 2 x 1
    assert in_flight_bytes(dualpipe_order(4, 8, 1), [1.0, 10.0]) == 23.0  # 3 x 1 + 2 x 10
    assert in_flight_bytes(dualpipe_order(4, 8, 0), [10.0, 1.0]) == 40.0  # 4 x 10
    assert in_flight_bytes(dualpipe_order(4, 8, 0), [1.0, 10.0]) == 13.0  # 3 x 1 + 1 x 10


SMALL = TransformerShape(layers=2, hidden=64, heads=4, kv_heads=4, dense_ffn=128, vocab=10, ffn_matrices=3,
                         experts=8, expert_ffn=32, top_k=2, moe_every=1)
SEQ = 32


def test_an_moe_layer_keeps_no_dense_ffn():
    """An MoE layer of H = 64 (4 heads of 16, SwiGLU experts of F = 32, E = 8, top-2) at bf16, per token: of
    Korthikanti's 34 H bytes its attention and norms' 16 H (1,024; no FFN's input, first GEMM's or gelu's
    output) and the router's fp32 scores and byte map, 5 E = 40; each expert row its input, first GEMM's output
    and activation, H + 3 F = 160 elements (320 bytes); the MoE input (H, 128 bytes) is the phase builder's."""
    per_token = layer_activation_bytes(SMALL, SEQ, 1, moe=True) / SEQ
    assert per_token == 16 * 64 + 40
    assert expert_row_elements(64, 32, 3) == 64 + 3 * 32
    whole = per_token + 2 * 64 + SMALL.top_k * 2 * expert_row_elements(64, 32, 3)
    # Megatron-Core's tensors less flash attention's softmax statistics (4 n bytes) and the rows' fp32
    # probabilities (4 bytes a row), which the simulator leaves out
    megatron = LayerRecompute(SMALL, True, SEQ).kept_bytes()
    assert whole == megatron - 4 * 4 - SMALL.top_k * 4
    # sequence parallelism over 2: every tensor of the layer's own halved
    assert layer_activation_bytes(SMALL, SEQ, 1, moe=True, tp=2, sequence_parallel=True) == per_token * SEQ / 2


def test_a_dense_layer_is_unchanged():
    """A SwiGLU dense layer of F_d = 128 keeps s b H (18 + 6 F_d / H) bytes: 18 x 64 + 6 x 128 = 1,920 a token."""
    assert layer_activation_bytes(SMALL, SEQ, 1, moe=False) / SEQ == 18 * 64 + 6 * 128


def test_in_flight_activation_of_equal_stages():
    """The activations a rank holds: its in-flight chunks x one chunk's bytes. L = 8 MoE layers of ``SMALL`` at
    a micro-batch of SEQ tokens, 1,832 bytes a token each (the test above): 1F1B over p = 4 (2 layers a stage)
    holds 4 micro-batches of 2 layers on stage 0; interleaved with v = 2 (1 layer a chunk), m = 8, 11 chunks."""
    layer = (layer_activation_bytes(SMALL, SEQ, 1, moe=True) + SEQ * 2 * 64
             + SEQ * SMALL.top_k * 2 * expert_row_elements(64, 32, 3))
    assert layer == SEQ * 1832
    assert in_flight_bytes(schedule_order(4, 8, 1, 0), [2 * layer]) == 4 * 2 * layer
    assert in_flight_bytes(schedule_order(4, 8, 2, 0), [layer, layer]) == 11 * layer
    assert in_flight_bytes(schedule_order(4, 8, 2, 3), [layer, layer]) == 5 * layer


def test_the_verdict_names_chunks_where_the_schedule_keeps_chunks():
    """A stage of the interleaved schedule (or DualPipe) keeps model chunks, not whole-stage micro-batches."""
    summary = {"fits_in_device_memory": False, "device_memory_bytes": 80e9, "peak_memory_bytes": 81e9,
               "profile": "h100", "memory_breakdown_bytes": {"activations": 50e9, "parameters": 31e9},
               "pipeline": {"fullest_stage": 1, "in_flight": [11, 9, 7, 5], "schedule": "interleaved",
                            "stage_chunk_layers": [[2, 2], [2, 1], [2, 2], [2, 2]]}}
    line = summary_memory_verdict(summary)
    assert "(model chunks in flight: 9, one micro-batch through up to 2 layers each)" in line
    one = {**summary, "pipeline": {**summary["pipeline"], "schedule": "1f1b"}}
    assert "(micro-batches in flight: 9)" in summary_memory_verdict(one)
