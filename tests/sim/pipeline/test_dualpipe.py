"""DualPipe's order, its Table 2 closed forms and the max-plus timing's invariants (sim.pipeline.dualpipe)."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import numpy as np
import pytest

from sim.pipeline.dualpipe import (
    PARAMETER_COPIES,
    DualPipeOp,
    dualpipe_order,
    held_chunks,
    run_dualpipe,
    stage_seconds,
)
from sim.pipeline.schedule import run_pipeline


def _equal(p: int, m: int, f: float, b: float, w: float, fb: float, send: float = 0.0):
    """Every stage and direction alike: forward f, whole backward b (weight part w), overlapped pair fb."""
    f_, b_, w_, fb_ = (np.full((p, 2), x) for x in (f, b, w, fb))
    return run_dualpipe(f_, b_, w_, fb_, np.full(p - 1, send), m)


def _short(order: list[DualPipeOp]) -> list[str]:
    """Ops as "F0.1" (kind, direction, micro-batch) or "F0.3&B1.1" for a pair."""
    return [f"F{o.direction}.{o.micro_batch}&B{o.backward_direction}.{o.backward_micro_batch}" if o.kind == "F&B"
            else f"{o.kind}{o.direction}.{o.micro_batch}" for o in order]


def _swap_directions(op: str) -> str:
    parts = op.split("&")
    return "&".join(p[0] + str(1 - int(p[1])) + p[2:] for p in parts)


# DualPipe.step (dualpipe/dualpipe.py @ 3da1bbea) read by hand for 4 ranks and 8 micro-batches (4 per direction).
# Rank 0 (half_rank 0): step 1 two F0; step 2 F0 F1; step 3 B1 (zero bubble) W F1; step 4 (one round, not a middle
# rank) F0&B1, F1&B0; step 5 B1, F1&B0; step 6 B1 then B0 split (h even: split after the first B1); step 7 W, B0
# split; step 8 W.
RANK0 = ["F0.0", "F0.1", "F0.2", "F1.0", "I1.0", "W1.0", "F1.1", "F0.3&B1.1", "F1.2&B0.0", "B1.2", "F1.3&B0.1",
         "B1.3", "I0.2", "W0.2", "I0.3", "W0.3"]
# Rank 1 (half_rank 1, a middle rank): step 2 twice F0 F1; step 4 two rounds, the first F0 then a whole B1 (not
# overlapped), F1&B0, then F0&B1, F1&B0; step 6 B1 B0, then both split (h odd: split before the second B1); step 8
# two W.
RANK1 = ["F0.0", "F1.0", "F0.1", "F1.1", "F0.2", "B1.0", "F1.2&B0.0", "F0.3&B1.1", "F1.3&B0.1", "B1.2", "B0.2",
         "I1.3", "I0.3", "W1.3", "W0.3"]


def test_order_follows_the_repository():
    assert _short(dualpipe_order(4, 8, 0)) == RANK0
    assert _short(dualpipe_order(4, 8, 1)) == RANK1
    # the second half of the ranks runs the same steps with the directions swapped (phase ^= is_in_second_half)
    assert _short(dualpipe_order(4, 8, 2)) == [_swap_directions(op) for op in RANK1]
    assert _short(dualpipe_order(4, 8, 3)) == [_swap_directions(op) for op in RANK0]
    steps = [o.step for o in dualpipe_order(4, 8, 0)]
    assert steps == [1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 14), (6, 12), (8, 20), (16, 32)])
def test_every_op_runs_once(p, m):
    for s in range(p):
        order = dualpipe_order(p, m, s)
        forwards = [(o.direction, o.micro_batch) for o in order if o.kind in ("F", "F&B")]
        backwards = [(o.direction, o.micro_batch) for o in order if o.kind in ("B", "I")] + \
            [(o.backward_direction, o.backward_micro_batch) for o in order if o.kind == "F&B"]
        every = sorted((d, i) for d in (0, 1) for i in range(m // 2))
        assert sorted(forwards) == every and sorted(backwards) == every
        split = [(o.direction, o.micro_batch) for o in order if o.kind == "I"]
        assert [(o.direction, o.micro_batch) for o in order if o.kind == "W"] == split  # FIFO
        for d in (0, 1):  # each direction's micro-batches in order, forward and backward
            assert [i for dd, i in forwards if dd == d] == list(range(m // 2))
        assert all(o.backward_direction == 1 - o.direction for o in order if o.kind == "F&B")


# (F, B, W, F&B) with the input-gradient backward as long as a forward (B - W = F), W <= F, max(F, B) <= F&B <= F+B
TABLE_REGIME = [(1.0, 2.0, 1.0, 2.5), (1.0, 2.0, 1.0, 3.0), (1.0, 2.0, 1.0, 2.0), (2.0, 3.0, 1.0, 4.0),
                (1.5, 2.5, 1.0, 3.2), (1.0, 1.5, 0.5, 1.75)]


@pytest.mark.parametrize("p", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("extra", [0, 2, 6, 24])  # micro-batches beyond the minimum 2p
@pytest.mark.parametrize("f, b, w, fb", TABLE_REGIME)
def test_bubble_is_table_2s(p, extra, f, b, w, fb):
    m = 2 * p + extra
    sched = _equal(p, m, f, b, w, fb)
    table = (p / 2 - 1) * (fb + b - 3 * w)  # DeepSeek-V3 report Table 2 / DualPipe README
    assert sched.bubble_s.max() == pytest.approx(table, rel=1e-12, abs=1e-12)
    # Per stage: every (direction, micro-batch) runs F and a whole backward (B, or I + W), some as overlapped pairs.
    # From the step counts, stage s (half_rank h) runs m - 3p/2 + h + 1 pairs, the middle ones (h = p/2 - 1) one
    # fewer (their first step-4 round is not overlapped): m - p - 1. The makespan is the middle stages' busy time
    # plus the table's bubble.
    half_rank = np.minimum(np.arange(p), p - 1 - np.arange(p))
    pairs = np.where(half_rank == p // 2 - 1, m - p - 1, m - 3 * p // 2 + half_rank + 1)
    busy = m * (f + b) - pairs * (f + b - fb)
    np.testing.assert_allclose(sched.busy_s, busy, rtol=1e-12)
    assert sched.makespan_s == pytest.approx(m * (f + b) - (m - p - 1) * (f + b - fb) + table, rel=1e-12)
    np.testing.assert_allclose(sched.bubble_s, table - np.maximum(p // 2 - 2 - half_rank, 0) * (f + b - fb),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sched.bubble_fraction, sched.bubble_s / sched.makespan_s, rtol=1e-12)


@pytest.mark.parametrize("p", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("m_factor", [1, 2, 5])
def test_activations_and_parameters_are_table_2s(p, m_factor):
    m = 2 * p * m_factor
    sched = _equal(p, m, 1.0, 2.0, 1.0, 2.5)
    # Table 2: PP + 1 (one chunk's activations of one micro-batch each) per device at most: the two middle stages
    # hold p + 1, the others p (for p = 2 both stages are middle ones)
    middle = {p // 2 - 1, p // 2}
    assert sched.in_flight.tolist() == [p + 1 if s in middle else p for s in range(p)]
    assert sched.in_flight.max() == p + 1
    # the same peaks when a split backward's weight gradient keeps its inputs until its W runs
    for s, order in enumerate(sched.orders):
        held = most = 0
        for op in order:
            held += {"F": 1, "B": -1, "I": 0, "W": -1, "F&B": 0}[op.kind]
            most = max(most, held)
        assert most == sched.in_flight[s]
    # 2x parameters: the p stages hold every model chunk twice, once per direction
    held = [g for s in range(p) for g in held_chunks(p, s)]
    assert sorted(held) == sorted(list(range(p)) * 2) and PARAMETER_COPIES == 2
    assert [held_chunks(p, s)[0] for s in range(p)] == list(range(p))


def test_neither_bubble_nor_activations_grow_with_micro_batches():
    # the report: "for DualPipe, neither the bubbles nor activation memory will increase as the number of
    # micro-batches grows" (from the minimum 2p on)
    p = 8
    base = _equal(p, 2 * p, 1.0, 2.0, 1.0, 2.5)
    for m in (18, 20, 32, 64, 160):
        sched = _equal(p, m, 1.0, 2.0, 1.0, 2.5)
        np.testing.assert_allclose(sched.bubble_s, base.bubble_s, rtol=1e-12)
        assert sched.in_flight.tolist() == base.in_flight.tolist()
        assert sched.makespan_s == pytest.approx(base.makespan_s + (m - 2 * p) * 2.5, rel=1e-12)  # one pair each


def test_table_2_rows_side_by_side():
    # F = 1, B = 2 (whole backward), W = 1, F&B = 2.5 on PP 8, 16 micro-batches in all: 1F1B idles (PP-1)(F+B) = 21
    # per stage, interleaved with v = 2 chunks 21 / 2, DualPipe (PP/2-1)(F&B+B-3W) = 4.5 at most
    p, m, f, b = 8, 16, 1.0, 2.0
    plain = run_pipeline(np.full((p, 1), f), np.full((p, 1), b), np.zeros(p), m)
    np.testing.assert_allclose(plain.makespan_s - plain.busy_s, (p - 1) * (f + b), rtol=1e-12)
    inter = run_pipeline(np.full((p, 2), f / 2), np.full((p, 2), b / 2), np.zeros(p), m, 2)
    np.testing.assert_allclose(inter.makespan_s - inter.busy_s, (p - 1) * (f + b) / 2, rtol=1e-12)
    dual = _equal(p, m, f, b, 1.0, 2.5)
    assert dual.bubble_s.max() == pytest.approx(4.5, rel=1e-12)
    assert dual.in_flight.max() == p + 1 and plain.in_flight.max() == p


@pytest.mark.parametrize("d", [0.0, 0.25, 1.0, 3.0])
def test_send_delay_two_stages_by_hand(d):
    # p = 2, m = 4, F = B = 1, W = 0 (so I = 1), F&B = 2. Stage 0: F0.0 [0,1], F1.0 [1+d, 2+d], F0.1 [2+d, 3+d],
    # B1.0 [3+d, 4+d]; the pair F1.1&B0.0 waits for B0.0's gradient from stage 1 (4+2d): [4+2d, 6+2d]; B1.1 [6+2d,
    # 7+2d]; I0.1 waits for its gradient sent at 7+2d: [7+3d, 8+3d]; W0.1 takes no time. Stage 1 is its mirror.
    # For d > 1 the FIFO channel 0 -> 1 still carries F0.1 (sent 3+d, done 3+2d) when B1.0's gradient is ready at
    # 4+d: it leaves at 3+2d, the pair starts at 3+3d, B1.1's gradient leaves at 6+3d, and the step ends at 7+4d.
    sched = _equal(2, 4, 1.0, 1.0, 0.0, 2.0, d)
    assert sched.makespan_s == pytest.approx(max(8 + 3 * d, 7 + 4 * d), rel=1e-12)
    assert sched.start[0, 1, 0, 0] == pytest.approx(4 + 2 * d + max(d - 1, 0))  # B0.0 inside the pair
    assert sched.start[0, 0, 1, 0] == pytest.approx(1 + d)  # F1.0 after stage 1's activations arrived


@pytest.mark.parametrize("p, m", [(2, 6), (4, 8), (4, 12), (6, 14), (8, 16)])
def test_uneven_stages_respect_dependencies(p, m):
    rng = np.random.default_rng(2412 + 100 * p + m)
    fwd, whole = rng.uniform(0.5, 2.0, (p, 2)), rng.uniform(1.0, 3.0, (p, 2))
    wgt = whole * rng.uniform(0.1, 0.6, (p, 2))
    pair = np.maximum(fwd, whole) + rng.uniform(0.0, 1.0, (p, 2)) * np.minimum(fwd, whole)
    send = rng.uniform(0.0, 0.5, p - 1)
    sched = run_dualpipe(fwd, whole, wgt, pair, send, m)
    seconds = {"F": fwd, "B": whole, "I": whole - wgt, "W": wgt, "F&B": pair}
    arrive = {}
    for s_from, s_to, kind, d, i, t0, t1 in sched.sends:
        k = "FB".index(kind)
        assert abs(s_to - s_from) == 1 and t0 >= sched.end[s_from, k, d, i] - 1e-12
        assert t1 - t0 == pytest.approx(send[min(s_from, s_to)])
        arrive[kind, d, s_to, i] = t1
    assert len(sched.sends) == 2 * m * (p - 1)  # each micro-batch crosses p - 1 boundaries each way
    first, last = (0, p - 1), (p - 1, 0)

    def ready(kind: str, d: int, i: int, s: int) -> float:
        if kind == "F":
            return 0.0 if s == first[d] else arrive["F", d, s, i]
        return sched.end[s, 0, d, i] if s == last[d] else arrive["B", d, s, i]

    busy = np.zeros(p)
    for s, order in enumerate(sched.orders):
        prev_end = 0.0
        for op in order:
            d, i = op.direction, op.micro_batch
            if op.kind == "F&B":
                t0, t1 = sched.start[s, 0, d, i], sched.end[s, 0, d, i]
                need = max(ready("F", d, i, s), ready("B", op.backward_direction, op.backward_micro_batch, s))
                assert (sched.start[s, 1, op.backward_direction, op.backward_micro_batch]) == t0
            else:
                k = {"F": 0, "B": 1, "I": 1, "W": 2}[op.kind]
                t0, t1 = sched.start[s, k, d, i], sched.end[s, k, d, i]
                need = 0.0 if op.kind == "W" else ready("F" if op.kind == "F" else "B", d, i, s)
            # each op starts as soon as the stage is free and its inputs are there: no unexplained idle time
            assert t0 == pytest.approx(max(prev_end, need), abs=1e-12)
            assert t1 - t0 == pytest.approx(seconds[op.kind][s, d])
            busy[s] += t1 - t0
            prev_end = t1
    np.testing.assert_allclose(sched.busy_s, busy, rtol=1e-12)
    channels = defaultdict(list)
    for s_from, s_to, _, _, _, t0, t1 in sched.sends:
        channels[s_from, s_to].append((t0, t1))
    for rows in channels.values():  # one FIFO per (from, to): both directions' traffic that way shares it
        for (_, e), (b, _) in pairwise(rows):
            assert b >= e - 1e-12


def test_stage_seconds_maps_chunks_to_directions():
    per_chunk = [1.0, 2.0, 3.0, 4.0]  # e.g. chunk 0 with the embedding, chunk 3 with the head
    np.testing.assert_array_equal(stage_seconds(per_chunk, 4), [[1, 4], [2, 3], [3, 2], [4, 1]])
    with pytest.raises(ValueError, match=r"shape \[4\]"):
        stage_seconds([1.0, 2.0], 4)


@pytest.mark.parametrize("kwargs, match", [
    ({"micro_batches": 7}, "even number of micro-batches"),
    ({"micro_batches": 6}, "at least 2 x stages = 8"),
    ({"micro_batches": 0}, "positive integer"),
    ({"forward_s": np.ones((3, 2)), "backward_s": np.ones((3, 2)), "weight_s": np.ones((3, 2)),
      "overlapped_s": np.ones((3, 2)), "send_s": np.zeros(2)}, "even number of stages"),
    ({"forward_s": np.ones(4)}, "forward_s must have shape"),
    ({"forward_s": np.ones((4, 1))}, "forward_s must have shape"),
    ({"backward_s": np.ones((4, 3))}, "backward_s must have shape"),
    ({"weight_s": np.full((4, 2), 3.0)}, "cannot exceed"),
    ({"overlapped_s": -np.ones((4, 2))}, "overlapped_s must hold finite"),
    ({"send_s": np.zeros(4)}, r"send_s must have shape \[3\]"),
    ({"send_s": [0.1, np.nan, 0.1]}, "send_s must hold finite"),
])
def test_bad_inputs(kwargs, match):
    args = {"forward_s": np.ones((4, 2)), "backward_s": np.full((4, 2), 2.0), "weight_s": np.ones((4, 2)),
            "overlapped_s": np.full((4, 2), 2.5), "send_s": np.zeros(3), "micro_batches": 8} | kwargs
    with pytest.raises(ValueError, match=match):
        run_dualpipe(**args)


def test_order_rejects_a_stage_outside():
    with pytest.raises(ValueError, match=r"s must be in \[0, 4\)"):
        dualpipe_order(4, 8, 4)
