"""Closed forms and invariants of the max-plus pipeline schedule (sim.pipeline.schedule)."""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import pairwise

import numpy as np
import pytest

from sim.pipeline.schedule import run_pipeline, schedule_order


def _equal(p: int, m: int, t_f: float, t_b: float, send: float = 0.0, v: int = 1):
    """Every stage and chunk alike: a whole-stage forward t_f, backward t_b, split evenly over v chunks."""
    return run_pipeline(np.full((p, v), t_f / v), np.full((p, v), t_b / v), np.full(p, send), m, v)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (4, 1), (3, 5), (1, 3)])
@pytest.mark.parametrize("t_f, t_b", [(1.0, 1.0), (1.0, 2.0), (0.5, 1.5)])
def test_1f1b_makespan_and_bubble(p, m, t_f, t_b):
    # The last stage runs F, B alternately without a gap once micro-batch 0 reached it ((p-1) t_f), and the last
    # backward then climbs p-1 stages ((p-1) t_b): (m + p - 1)(t_f + t_b), also for m < p (then the warm-up is
    # all m forwards and the schedule is GPipe's, same length).
    sched = _equal(p, m, t_f, t_b)
    assert sched.makespan_s == pytest.approx((m + p - 1) * (t_f + t_b), rel=1e-12)
    np.testing.assert_allclose(sched.busy_s, m * (t_f + t_b))
    np.testing.assert_allclose(sched.bubble_fraction, (p - 1) / (m + p - 1), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 4, 2), (4, 8, 3), (2, 6, 4), (8, 16, 2)])
@pytest.mark.parametrize("t_f, t_b", [(1.0, 1.0), (1.0, 2.0), (2.0, 1.0), (1.0, 0.25)])
def test_interleaved_bubble_is_narayanans(p, m, v, t_f, t_b):
    # Narayanan et al. §2.2.2: bubble time (p-1)(t_f+t_b)/v next to m(t_f+t_b) of work. Running it shows the
    # formula is exact for any t_b / t_f (and for m == p, where all forwards run first) as long as every stage and
    # chunk has the same times and sends are free.
    sched = _equal(p, m, t_f, t_b, v=v)
    assert sched.makespan_s == pytest.approx(m * (t_f + t_b) + (p - 1) * (t_f + t_b) / v, rel=1e-12)
    np.testing.assert_allclose(sched.bubble_fraction, (p - 1) / (v * m + p - 1), rtol=1e-9)


def test_interleaving_beats_1f1b_bubble():
    plain, inter = _equal(4, 8, 1.0, 2.0), _equal(4, 8, 1.0, 2.0, v=2)
    assert np.all(inter.bubble_fraction < plain.bubble_fraction)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (5, 5), (3, 1)])
def test_1f1b_in_flight(p, m):
    sched = _equal(p, m, 1.0, 2.0)
    assert sched.in_flight.tolist() == [min(p - s, m) for s in range(p)]


def test_interleaved_in_flight_exceeds_1f1b():
    p, m, v = 4, 8, 2
    inter, plain = _equal(p, m, 1.0, 2.0, v=v), _equal(p, m, 1.0, 2.0)
    # Megatron's warm-up (p-s-1)*2 + (v-1)*p forwards, plus the first steady-state forward.
    assert inter.in_flight.tolist() == [(p - s - 1) * 2 + (v - 1) * p + 1 for s in range(p)]
    assert inter.in_flight[0] > plain.in_flight[0]


def test_interleaved_order_follows_megatron():
    order = schedule_order(4, 8, 2, 0)
    forwards = [(c, i) for kind, c, i in order if kind == "F"]
    backwards = [(c, i) for kind, c, i in order if kind == "B"]
    # micro-batches in groups of p, chunk by chunk; backwards walk the chunks in reverse
    assert forwards[:12] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3),
                             (0, 4), (0, 5), (0, 6), (0, 7)]
    assert backwards[:5] == [(1, 0), (1, 1), (1, 2), (1, 3), (0, 0)]
    assert [k for k, _, _ in order[:12]] == ["F"] * 10 + ["F", "B"]  # 10 warm-up forwards on stage 0
    assert [k for k, _, _ in schedule_order(4, 4, 2, 3)] == ["F"] * 8 + ["B"] * 8  # m == p: all warm-up


def test_send_delay_single_micro_batch():
    # p = 2, m = 1: F on stage 0, send, F and B on stage 1, send back, B on stage 0.
    t_f, t_b, d = 1.0, 2.0, 0.3
    assert _equal(2, 1, t_f, t_b, d).makespan_s == pytest.approx(t_f + d + t_f + t_b + d + t_b)
    # any p: the round trip crosses 2(p-1) boundaries
    assert _equal(5, 1, t_f, t_b, d).makespan_s == pytest.approx(5 * (t_f + t_b) + 2 * 4 * d)


@pytest.mark.parametrize("m", range(1, 9))
def test_send_delay_two_stages(m):
    # p = 2 by hand: stage 0's B(k) ends at (k+2)(t_f+t_b) + 2d(floor(k/2) + 1): stage 0 issues F(k) only after
    # B(k-2), which waited for a round trip, so each pair of micro-batches adds one round trip 2d.
    t_f, t_b, d = 1.0, 2.0, 0.4
    expect = (m + 1) * (t_f + t_b) + 2 * d * math.ceil(m / 2)
    assert _equal(2, m, t_f, t_b, d).makespan_s == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("t_f, t_b, d", [(1.0, 2.0, 0.1), (1.0, 1.0, 1.5), (2.0, 1.0, 3.0)])
def test_send_delay_1f1b_closed_form(p, m, t_f, t_b, d):
    # Critical path: micro-batch 0's round trip (p(t_f+t_b) + 2(p-1)d); then, per p later micro-batches, one more
    # round trip from stage 0 (stage 0's B(k) is followed by F(k+p)); the r = (m-1) mod p left add a round trip
    # through the last r stages (r(t_f+t_b) + 2(r-1)d). Together: 2d(p-1 + (m-1) - ceil((m-1)/p)) of sends.
    # Exact while d <= t_f + t_b: larger sends make another path longer when m = 2 mod p (see the FIFO test).
    extra = 2 * d * (p - 1 + (m - 1) - math.ceil((m - 1) / p))
    expect = (m + p - 1) * (t_f + t_b) + extra
    assert _equal(p, m, t_f, t_b, d).makespan_s == pytest.approx(expect, rel=1e-12)


def test_fifo_channel_delays_second_send():
    # p = 2, m = 2, d > t_f + t_b: F(1)'s send queues behind F(0)'s (arrives t_f + 2d, not 2t_f + d), then F(1),
    # B(1) on stage 1, B(1)'s send, B(1) on stage 0. Without the FIFO it would be 3(t_f + t_b) + 2d.
    t_f, t_b, d = 1.0, 1.0, 10.0
    sched = _equal(2, 2, t_f, t_b, d)
    assert sched.makespan_s == pytest.approx(2 * t_f + 2 * t_b + 3 * d)
    fwd = [x for x in sched.sends if x[:3] == (0, 1, "F")]
    assert fwd[1][4] == pytest.approx(fwd[0][5])  # the second send starts when the first ends


@pytest.mark.parametrize("p, m, v", [(4, 8, 1), (3, 2, 1), (4, 8, 2), (3, 6, 3), (1, 4, 3)])
def test_random_instance_runs_all_ops_and_respects_dependencies(p, m, v):
    rng = np.random.default_rng(1234 + 100 * p + 10 * m + v)
    fwd, bwd, send = rng.uniform(0.5, 2.0, (p, v)), rng.uniform(0.5, 3.0, (p, v)), rng.uniform(0.0, 0.5, p)
    sched = run_pipeline(fwd, bwd, send, m, v)
    n = p * v
    for s in range(p):
        order = schedule_order(p, m, v, s)
        assert sorted(order) == sorted((k, c, i) for k in "FB" for c in range(v) for i in range(m))
        times = [(sched.start[s, "FB".index(k), c, i], sched.end[s, "FB".index(k), c, i]) for k, c, i in order]
        assert times[0][0] >= 0
        for (_, prev_end), (t0, _) in pairwise(times):
            assert t0 >= prev_end - 1e-12  # one op at a time, in schedule order
    assert not np.isnan(sched.start).any()
    np.testing.assert_allclose(sched.end - sched.start,
                               np.broadcast_to(np.stack([fwd, bwd], 1)[..., None], sched.start.shape))

    # arrival of each (direction, g, i): the k-th send of micro-batch i from a stage in a direction carries its
    # k-th chunk in that direction's chunk order
    arrive = {}
    by_key = defaultdict(list)
    for s_from, s_to, kind, i, t0, t1 in sched.sends:
        by_key[s_from, kind, i].append((t0, t1))
    for (s_from, kind, i), rows in by_key.items():
        chunks = range(v) if kind == "F" else range(v - 1, -1, -1)
        for c, (t0, t1) in zip([c for c in chunks if (kind == "F" and c * p + s_from < n - 1)
                                or (kind == "B" and c * p + s_from > 0)], rows):
            k = "FB".index(kind)
            assert t0 >= sched.end[s_from, k, c, i] - 1e-12
            assert t1 - t0 == pytest.approx(send[s_from if kind == "F" else (s_from - 1) % p])
            arrive[kind, c * p + s_from, i] = t1
    for i in range(m):
        for g in range(n):
            s, c = g % p, g // p
            if g > 0:  # F(g) after F(g-1)'s data arrived (on the same stage when p = 1: at its end)
                ready = arrive.get(("F", g - 1, i), sched.end[(g - 1) % p, 0, (g - 1) // p, i])
                assert sched.start[s, 0, c, i] >= ready - 1e-12
            ready = sched.end[s, 0, c, i] if g == n - 1 else arrive.get(
                ("B", g + 1, i), sched.end[(g + 1) % p, 1, (g + 1) // p, i])
            assert sched.start[s, 1, c, i] >= ready - 1e-12
    # every channel is FIFO: sends on one (boundary, direction) never overlap
    channels = defaultdict(list)
    for s_from, _, kind, _, t0, t1 in sched.sends:
        channels[s_from, kind].append((t0, t1))
    for rows in channels.values():
        for (_, e), (b, _) in pairwise(rows):
            assert b >= e - 1e-12
    assert len(sched.sends) == (0 if p == 1 else 2 * m * (n - 1))


@pytest.mark.parametrize("kwargs, match", [
    ({"micro_batches": 6, "chunks": 2, "forward_s": np.ones((4, 2)), "backward_s": np.ones((4, 2))}, "micro_batches=6"),
    ({"micro_batches": 0}, "micro_batches"),
    ({"micro_batches": 4, "chunks": 0}, "chunks"),
    ({"micro_batches": 4, "backward_s": -np.ones((4, 1))}, "backward_s"),
    ({"micro_batches": 4, "send_s": [0.1, 0.1, 0.1]}, "send_s"),
    ({"micro_batches": 4, "send_s": [0.1, -0.1, 0.1, 0.1]}, "send_s"),
    ({"micro_batches": 4, "chunks": 2}, "forward_s"),
    ({"micro_batches": 4, "forward_s": np.ones(4)}, "forward_s"),
])
def test_bad_inputs(kwargs, match):
    args = {"forward_s": np.ones((4, 1)), "backward_s": np.ones((4, 1)), "send_s": np.zeros(4)} | kwargs
    with pytest.raises(ValueError, match=match):
        run_pipeline(**args)


def test_schedule_order_rejects_uneven_interleaving():
    with pytest.raises(ValueError, match="m=6, p=4"):
        schedule_order(4, 6, 2, 0)
