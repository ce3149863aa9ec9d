"""What one simulated step tells the user, from its phases and their timeline.

Per rank: seconds per stage and per layer (busy time of each phase, waits for slower
members included, as the real backend measures them), *exposed* time (the step minus the
time its compute stream is busy: communication, copies and stragglers it could not
hide), page stall (time the experts waited for page loads beyond their other inputs, and
the in-order work's wait for the unhidden share of those loads, ``Phase.hold``), memory
over the step (``Phase.mem_delta`` / ``mem_transient`` on top of what the GPU held when
the step began), and the share of its time that comes from fitted constants
(``Timeline.fitted``: host costs per stage, a calibrated library latency, a compute
scale extrapolated from other worlds, per-page host costs, against measured link rates,
latencies and kernel rates). Step figures: stage and layer times are means over ranks,
the step time, memory peak and fitted share are the largest.

The Chrome trace shows ``trace_ranks`` ranks (process = GPU, thread = stream), a memory
counter per shown GPU (its changes only) and link-utilization counters per level for the
whole fabric. At paper scale a step has thousands of phases on 1,440 GPUs: everything
here works on [W] vectors or the shown ranks' columns, never on per-phase loops over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.step.phases import Phase
from sim.step.schedule import Timeline
from testbed.core.stages import STAGES
from testbed.scenario.topology import LEVELS, Layout

COUNTER_BINS = 100  # link-utilization samples per step in the trace


@dataclass
class StepFigures:
    step_time_s: float
    stage_time_s: dict[str, float]
    layer_time_s: list[float]
    exposed_s_mean: float
    exposed_s_max: float
    page_stall_s: float
    peak_memory_bytes: int
    peak_by_rank: np.ndarray  # [W] bytes each GPU held at its peak
    peak_at: str  # where in the step the fullest GPU peaked: "stage, layer n"
    memory: np.ndarray  # [P, shown] bytes the first ``shown`` ranks hold during each phase
    fitted_share: float  # the largest over ranks of the share of its step time from fitted constants


def figures(phases: list[Phase], tl: Timeline, base_memory: np.ndarray, num_layers: int,
            shown: int = 0) -> StepFigures:
    """The step's figures; ``memory`` is kept for the first ``shown`` ranks (the trace's)."""
    busy = tl.end - tl.start  # [P, W]
    world = busy.shape[1]
    stage_idx = np.array([STAGES.index(ph.stage) for ph in phases])
    by_stage = _one_hot(stage_idx, len(STAGES)) @ busy  # [stages, W]
    layer_idx = np.array([ph.layer for ph in phases])
    by_layer = _one_hot(layer_idx, num_layers) @ busy  # phases of no layer (-1) count nowhere
    compute = np.array([ph.kind == "compute" for ph in phases])
    rank_time = tl.end.max(axis=0) - tl.t0
    exposed = rank_time - busy[compute].sum(axis=0)
    stall = np.zeros(world)
    for p, ph in enumerate(phases):
        if ph.waits_for_pages < 0:
            continue
        copy = phases[ph.waits_for_pages]
        if copy.in_line:
            # the rank copied before it could go on (as a CPU rank's synchronous copies):
            # the whole copy is time the experts waited for their pages
            stall += tl.end[ph.waits_for_pages] - tl.start[ph.waits_for_pages]
            continue
        if copy.hold >= 0:  # the in-order work waited for the copy's unhidden share (sim.step.phases)
            stall += tl.end[copy.hold] - tl.start[copy.hold]
        others = [d for d in ph.deps if d != ph.waits_for_pages]
        ready = np.max([tl.end[d] for d in others], axis=0) if others else np.full(world, tl.t0)
        stall += np.clip(tl.end[ph.waits_for_pages] - ready, 0, None)
    peak_phase = np.full(len(base_memory), -1)
    peak, memory = memory_timeline(phases, base_memory, shown, peak_phase)
    fullest = int(np.argmax(peak))
    at = phases[peak_phase[fullest]] if peak_phase[fullest] >= 0 else None
    # into busy, which is not needed any more: a [P, W] array less to allocate and fault in
    fitted = fitted_by_rank(tl, busy, out=busy)
    share = np.divide(fitted, rank_time, out=np.zeros(world), where=rank_time > 0)
    return StepFigures(
        step_time_s=float(rank_time.max()),
        stage_time_s={s: float(by_stage[i].mean()) for i, s in enumerate(STAGES)},
        layer_time_s=[float(v) for v in by_layer.mean(axis=1)],
        exposed_s_mean=float(exposed.mean()), exposed_s_max=float(exposed.max()),
        page_stall_s=float(stall.mean()),
        peak_memory_bytes=int(peak.max()), peak_by_rank=peak,
        peak_at="step start" if at is None else f"{at.stage}, layer {at.layer}" if at.layer >= 0 else at.stage,
        memory=memory, fitted_share=float(share.max()) if world else 0.0,
    )


def fitted_by_rank(tl: Timeline, busy: np.ndarray, rows=None, out: np.ndarray | None = None) -> np.ndarray:
    """[W] seconds of each rank's step from fitted constants: per phase (``rows``: a
    selection of the phases, all by default) the fitted seconds of ``Timeline.fitted``,
    at most the phase's busy time ``busy`` [P, W] there (a rank's time in a phase is all
    it can owe them). ``out``: a [P, W] buffer to work in (``busy`` itself when it is not
    needed after)."""
    if tl.fitted is None:
        return np.zeros(busy.shape[1])
    f, b = (tl.fitted, busy) if rows is None else (tl.fitted[rows], busy[rows])
    return np.minimum(f, b, out=out if rows is None else None).sum(axis=0)


def _one_hot(index: np.ndarray, n: int) -> np.ndarray:
    """[n, len(index)] matrix with a 1 at (index[p], p); negative indices match nothing."""
    out = np.zeros((n, len(index)))
    ok = index >= 0
    out[index[ok], np.flatnonzero(ok)] = 1.0
    return out


def memory_timeline(phases: list[Phase], base: np.ndarray, shown: int = 0,
                    peak_phase: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([W] peak bytes, [P, shown] bytes the first ``shown`` GPUs hold during each phase).
    ``peak_phase`` ([W] ints, or None) is filled with the phase each GPU peaks in (-1:
    before the first).

    Allocation in issue order: during a phase a GPU holds what it held before plus the
    phase's transient buffers; after it, plus its ``mem_delta``. One pass over the phases
    with [W] vectors, not [P, W] matrices (thousands of phases x 1,440 GPUs at paper
    scale): the same float operations, in the same order, as ``base + cumsum(delta)`` row
    by row, so the figures are the same to the bit.
    """
    world = len(base)
    held = np.zeros(world)  # cumulative mem_delta so far (cumsum's running row)
    after = base + held
    peak = np.array(after, dtype=float) if not phases else None
    if peak_phase is not None:
        peak_phase[:] = -1
    out = np.empty((len(phases), min(shown, world)))
    row = np.zeros(world)
    for p, ph in enumerate(phases):
        if ph.mem_delta is not None:
            row[:] = ph.mem_delta
            held = held + row
            after = base + held
            mem = after - row
            if ph.mem_transient is not None:
                mem = mem + ph.mem_transient
            mem = np.maximum(mem, after)
        elif ph.mem_transient is not None:
            # no delta: after - 0 + t is after + t exactly
            mem = np.maximum(after + ph.mem_transient, after)
        else:
            mem = after
        if peak_phase is not None and peak is not None:
            peak_phase[mem > peak] = p
        elif peak_phase is not None:
            peak_phase[:] = p
        peak = mem if peak is None else np.maximum(peak, mem)
        out[p] = mem[:shown]
    return peak, out


def trace_events(step: int, phases: list[Phase], tl: Timeline, layout: Layout, trace_ranks: int,
                 memory: np.ndarray, level_capacity: np.ndarray, op_levels=None) -> list[dict]:
    """Chrome trace events of one step (seconds -> microseconds): the phases of the first
    ``trace_ranks`` ranks, their memory (``memory``: [P, >= shown] bytes) and the fabric's
    link utilization. ``op_levels(op)`` -> (bytes, [3] bytes per level) of one op
    (``ByteLedger.op_bytes``; default: from the op's transfers)."""
    n = min(trace_ranks, tl.start.shape[1])
    us = 1e6
    start, end = tl.start[:, :n], tl.end[:, :n]
    p_idx, r_idx = np.nonzero(end > start)  # phase-major, as the phases run
    ts = (start[p_idx, r_idx] * us).tolist()
    dur = ((end[p_idx, r_idx] - start[p_idx, r_idx]) * us).tolist()
    events = [{"name": (ph := phases[p]).stage, "ph": "X", "pid": r, "tid": ph.stream, "ts": t, "dur": d,
               "args": {"step": step, "layer": ph.layer, "kind": ph.kind}}
              for p, r, t, d in zip(p_idx.tolist(), r_idx.tolist(), ts, dur)]
    ends, gib = end * us, memory[:, :n] / 2**30
    for r in range(n):
        p = _counter_changes(ends[:, r], gib[:, r])
        events += [{"name": "memory", "ph": "C", "pid": r, "ts": t, "args": {"GiB": g}}
                   for t, g in zip(ends[p, r].tolist(), gib[p, r].tolist())]
    events += link_counters(tl, layout, level_capacity, pid=tl.start.shape[1], op_levels=op_levels)
    return events


def _counter_changes(ts: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Indices (ascending) of the samples of a counter that change its value: a viewer
    draws a counter as a step function over time, so a sample equal to the one before it
    in time (stable order for equal times) draws nothing. At paper scale 5 samples in 6
    are such repeats (a GPU sits out most of the 2,000 expert-sync collectives): the
    trace is that much smaller and looks the same."""
    if not len(ts):
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(ts, kind="stable")
    v = value[order]
    changes = np.ones(len(v), dtype=bool)
    changes[1:] = v[1:] != v[:-1]
    return np.sort(order[changes])


def link_counters(tl: Timeline, layout: Layout, level_capacity: np.ndarray, pid: int,
                  op_levels=None) -> list[dict]:
    """Utilization per fabric level over the step: every collective's bytes per level
    spread evenly over its duration, divided by the level's total capacity.

    Vectorised over (op, bin) pairs; each bin adds its ops' shares in op order (bincount
    sums in input order), as the loop over ops did.
    """
    if not tl.ops:
        return []
    if op_levels is None:
        op_levels = _levels_from_transfers(layout)
    t_end = max(e for _, _, e in tl.ops)
    edges = np.linspace(tl.t0, max(t_end, tl.t0 + 1e-12), COUNTER_BINS + 1)
    rows = [(op_levels(op)[1], s, e) for op, s, e in tl.ops if e > s]
    rows = [(lv, s, e) for lv, s, e in rows if lv.any()]  # an op that moves nothing adds nothing
    load = np.zeros((COUNTER_BINS, 3))
    if rows:
        per_level = np.array([lv for lv, _, _ in rows], dtype=float)  # [ops, 3] bytes
        s = np.array([r[1] for r in rows], dtype=float)
        e = np.array([r[2] for r in rows], dtype=float)
        lo = np.maximum(np.searchsorted(edges, s, side="right") - 1, 0)
        hi = np.minimum(np.searchsorted(edges, e, side="right") - 1, COUNTER_BINS - 1)
        n = np.maximum(hi - lo + 1, 0)
        op = np.repeat(np.arange(len(rows)), n)  # (op, bin) pairs, op-major
        b = lo[op] + (np.arange(len(op)) - np.repeat(np.cumsum(n) - n, n))
        overlap = np.minimum(e[op], edges[b + 1]) - np.maximum(s[op], edges[b])
        keep = overlap > 0
        op, b, overlap = op[keep], b[keep], overlap[keep]
        share = per_level[op] * overlap[:, None] / (e - s)[op][:, None]
        for i in range(3):
            load[:, i] = np.bincount(b, weights=share[:, i], minlength=COUNTER_BINS)
    width = np.diff(edges)[:, None]
    util = load / width / np.where(level_capacity[:3] > 0, level_capacity[:3], np.inf)
    return [{"name": "link utilization", "ph": "C", "pid": pid, "ts": edges[b] * 1e6,
             "args": {LEVELS[i]: float(util[b, i]) for i in range(3)}} for b in range(COUNTER_BINS)]


def _levels_from_transfers(layout: Layout):
    def levels(op):
        src, dst, nbytes = op.transfers()
        per_level = np.bincount(layout.level_matrix[src, dst], weights=nbytes, minlength=3)[:3]
        return int(nbytes.sum()), per_level
    return levels
