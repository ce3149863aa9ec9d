"""The step report's vectorised parts give, to the bit, what the straightforward loops over
phases, ranks and ops gave (the paper-scale run's figures must not move when it gets faster)."""

import numpy as np
import pytest

from sim.step.phases import Phase
from sim.step.schedule import Timeline
from sim.step.step_report import (
    COUNTER_BINS,
    _counter_changes,
    link_counters,
    memory_timeline,
    trace_events,
)
from testbed.policy.collectives import ByteLedger, CollectiveOp
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


def matrix_memory(phases, base):
    """The [P, W] formula the report used: base + cumsum of the deltas, transients on top."""
    world = len(base)
    delta, transient = np.zeros((len(phases), world)), np.zeros((len(phases), world))
    for p, ph in enumerate(phases):
        if ph.mem_delta is not None:
            delta[p] = ph.mem_delta
        if ph.mem_transient is not None:
            transient[p] = ph.mem_transient
    after = base + np.cumsum(delta, axis=0)
    return np.maximum(after - delta + transient, after)


def random_phases(rng, n, world):
    phases = []
    for _ in range(n):
        kind = rng.integers(4)
        delta = (None if kind == 0 else rng.integers(-2**20, 2**30, world) if kind == 1
                 else rng.normal(0, 1e9, world) if kind == 2 else float(rng.integers(2**20)))
        transient = rng.random(world) * 1e8 / 3 if rng.random() < 0.6 else None
        phases.append(Phase("expert_sync", -1, "ops", "comm", (), mem_delta=delta, mem_transient=transient))
    return phases


@pytest.mark.parametrize("seed", range(4))
def test_memory_timeline_is_the_matrix_formula(seed):
    rng = np.random.default_rng(seed)
    world = 7
    phases = random_phases(rng, 60, world)
    base = rng.integers(0, 2**34, world)
    want = matrix_memory(phases, base)
    peak, shown = memory_timeline(phases, base, shown=3)
    assert np.array_equal(peak, want.max(axis=0))
    assert np.array_equal(shown, want[:, :3])
    assert memory_timeline(phases, base, shown=50)[1].shape == (60, world)  # more shown than there are


def test_counter_keeps_the_samples_that_change_it_in_time_order():
    ts = np.array([0.0, 1.0, 3.0, 2.0, 4.0, 4.0, 5.0])
    v = np.array([1.0, 1.0, 2.0, 1.0, 2.0, 3.0, 3.0])
    # in time: 0:1, 1:1 (repeat), 2:1 (repeat, though listed after 3:2), 3:2, 4:2 (repeat), 4:3, 5:3 (repeat)
    assert _counter_changes(ts, v).tolist() == [0, 2, 5]
    assert _counter_changes(np.zeros(0), np.zeros(0)).tolist() == []


def loop_link_load(tl, layout, edges):
    """The per-op, per-bin loop the link counters were."""
    load = np.zeros((COUNTER_BINS, 3))
    for op, s, e in tl.ops:
        src, dst, nbytes = op.transfers()
        if not len(nbytes) or e <= s:
            continue
        per_level = np.bincount(layout.level_matrix[src, dst], weights=nbytes, minlength=3)[:3]
        lo, hi = np.searchsorted(edges, [s, e], side="right") - 1
        for b in range(max(lo, 0), min(hi, COUNTER_BINS - 1) + 1):
            overlap = min(e, edges[b + 1]) - max(s, edges[b])
            if overlap > 0:
                load[b] += per_level * overlap / (e - s)
    return load


def random_ops(rng, world, n):
    ops = []
    for _ in range(n):
        kind = ["all_to_all_v", "all_gather", "reduce_scatter", "all_reduce", "p2p"][rng.integers(5)]
        if kind == "p2p":
            members = tuple(int(x) for x in rng.integers(0, world, 2))
        else:
            members = tuple(sorted(int(x) for x in rng.choice(world, rng.integers(1, world + 1), replace=False)))
        p = len(members)
        matrix = rng.integers(0, 1000, (p, p)) * (rng.random((p, p)) < 0.7) if kind == "all_to_all_v" else None
        size = int(rng.integers(0, 5000)) if rng.random() < 0.9 else 0
        ops.append(CollectiveOp(kind, members, "dispatch", size=0 if matrix is not None else size, matrix=matrix))
    return ops


@pytest.mark.parametrize("seed", range(3))
def test_link_counters_are_the_loop_over_ops(seed):
    rng = np.random.default_rng(seed)
    layout = Layout(Scenario.from_dict({}))
    ops = random_ops(rng, layout.world, 80)
    start = rng.random(len(ops)) * 1e-3
    end = start + rng.random(len(ops)) * 5e-4 * (rng.random(len(ops)) < 0.95)  # some take no time
    tl = Timeline(np.zeros((1, layout.world)), np.full((1, layout.world), 2e-3),
                  [(op, float(s), float(e)) for op, s, e in zip(ops, start, end)], t0=0.0)
    capacity = np.array([3e11, 1e11, 5e10, 2e10])
    t_end = max(e for _, _, e in tl.ops)
    edges = np.linspace(tl.t0, max(t_end, tl.t0 + 1e-12), COUNTER_BINS + 1)
    want = loop_link_load(tl, layout, edges) / np.diff(edges)[:, None] / capacity[:3]
    for op_levels in (None, ByteLedger(layout).op_bytes):
        events = link_counters(tl, layout, capacity, pid=layout.world, op_levels=op_levels)
        got = np.array([[e["args"][k] for k in ("nvlink", "leaf", "spine")] for e in events])
        assert np.array_equal(got, want)
        assert [e["ts"] for e in events] == (edges[:-1] * 1e6).tolist()


def test_trace_spans_and_memory_counters_of_the_shown_ranks():
    rng = np.random.default_rng(5)
    world, n = 6, 40
    phases = random_phases(rng, n, world)
    start = np.cumsum(rng.random((n, world)), axis=0)
    end = start + rng.random((n, world)) * (rng.random((n, world)) < 0.8)
    tl = Timeline(start, end, [], t0=0.0)
    base = rng.integers(0, 2**34, world)
    _, memory = memory_timeline(phases, base, shown=4)
    events = trace_events(3, phases, tl, None, 4, memory, np.ones(4))
    spans = [e for e in events if e["ph"] == "X"]
    want = [(p, r) for p in range(n) for r in range(4) if end[p, r] > start[p, r]]
    assert [(e["pid"], e["ts"], e["dur"]) for e in spans] == \
        [(r, start[p, r] * 1e6, (end[p, r] - start[p, r]) * 1e6) for p, r in want]
    assert all(e["args"] == {"step": 3, "layer": -1, "kind": "ops"} for e in spans)
    full = matrix_memory(phases, base)
    for r in range(4):
        counter = [(e["ts"], e["args"]["GiB"]) for e in events if e["name"] == "memory" and e["pid"] == r]
        keep = _counter_changes(end[:, r] * 1e6, full[:, r] / 2**30)
        assert counter == [(end[p, r] * 1e6, full[p, r] / 2**30) for p in keep]
        assert len(keep) < n  # repeats were left out
