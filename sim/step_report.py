"""What one simulated step tells the user, from its phases and their timeline.

Per rank: seconds per stage and per layer (busy time of each phase, waits for slower
members included, as the real backend measures them), *exposed* time (the step minus the
time its compute stream is busy: communication, copies and stragglers it could not
hide), page stall (time the experts waited for page loads beyond their other inputs),
memory over the step (``Phase.mem_delta`` / ``mem_transient`` on top of what the GPU
held when the step began), and the share of its time that comes from fitted constants
(``Timeline.fitted``: host costs per stage and a calibrated library latency, against
measured link rates, latencies and kernel rates). Step figures: stage and layer times are means over ranks,
the step time and memory peak are the largest.

The Chrome trace shows ``trace_ranks`` ranks (process = GPU, thread = stream), a memory
counter per shown GPU and link-utilization counters per level for the whole fabric.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from testbed.stages import STAGES
from testbed.topology import LEVELS, Layout

from sim.phases import Phase
from sim.schedule import Timeline

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
    memory: np.ndarray  # [P, W] bytes held during each phase
    fitted_share: float  # mean over ranks of the share of its step time from fitted constants


def figures(phases: list[Phase], tl: Timeline, base_memory: np.ndarray, num_layers: int) -> StepFigures:
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
        if ph.waits_for_pages >= 0 and phases[ph.waits_for_pages].in_line:
            # the rank copied before it could go on (as a CPU rank's synchronous copies):
            # the whole copy is time the experts waited for their pages
            stall += tl.end[ph.waits_for_pages] - tl.start[ph.waits_for_pages]
        elif ph.waits_for_pages >= 0:
            others = [d for d in ph.deps if d != ph.waits_for_pages]
            ready = np.max([tl.end[d] for d in others], axis=0) if others else np.full(world, tl.t0)
            stall += np.clip(tl.end[ph.waits_for_pages] - ready, 0, None)
    memory = memory_timeline(phases, base_memory)
    peak = memory.max(axis=0)
    fitted = np.minimum(tl.fitted, busy).sum(axis=0) if tl.fitted is not None else np.zeros(world)
    share = np.divide(fitted, rank_time, out=np.zeros(world), where=rank_time > 0)
    return StepFigures(
        step_time_s=float(rank_time.max()),
        stage_time_s={s: float(by_stage[i].mean()) for i, s in enumerate(STAGES)},
        layer_time_s=[float(v) for v in by_layer.mean(axis=1)],
        exposed_s_mean=float(exposed.mean()), exposed_s_max=float(exposed.max()),
        page_stall_s=float(stall.mean()),
        peak_memory_bytes=int(peak.max()), memory=memory, fitted_share=float(share.mean()),
    )


def _one_hot(index: np.ndarray, n: int) -> np.ndarray:
    """[n, len(index)] matrix with a 1 at (index[p], p); negative indices match nothing."""
    out = np.zeros((n, len(index)))
    ok = index >= 0
    out[index[ok], np.flatnonzero(ok)] = 1.0
    return out


def memory_timeline(phases: list[Phase], base: np.ndarray) -> np.ndarray:
    """[P, W] bytes each GPU holds during each phase (allocation in issue order)."""
    world = len(base)
    delta = np.zeros((len(phases), world))
    transient = np.zeros((len(phases), world))
    for p, ph in enumerate(phases):
        if ph.mem_delta is not None:
            delta[p] = ph.mem_delta
        if ph.mem_transient is not None:
            transient[p] = ph.mem_transient
    after = base + np.cumsum(delta, axis=0)
    during = after - delta + transient  # before this phase's own change lands
    return np.maximum(during, after)


def trace_events(step: int, phases: list[Phase], tl: Timeline, layout: Layout, trace_ranks: int,
                 memory: np.ndarray, level_capacity: np.ndarray) -> list[dict]:
    """Chrome trace events of one step (seconds -> microseconds)."""
    events = []
    shown = range(min(trace_ranks, tl.start.shape[1]))
    us = 1e6
    for p, ph in enumerate(phases):
        for r in shown:
            s, e = tl.start[p, r], tl.end[p, r]
            if e > s:
                events.append({"name": ph.stage, "ph": "X", "pid": r, "tid": ph.stream, "ts": s * us,
                               "dur": (e - s) * us, "args": {"step": step, "layer": ph.layer, "kind": ph.kind}})
    for r in shown:
        for p in range(len(phases)):
            events.append({"name": "memory", "ph": "C", "pid": r, "ts": tl.end[p, r] * us,
                           "args": {"GiB": memory[p, r] / 2**30}})
    events += link_counters(tl, layout, level_capacity, pid=tl.start.shape[1])
    return events


def link_counters(tl: Timeline, layout: Layout, level_capacity: np.ndarray, pid: int) -> list[dict]:
    """Utilization per fabric level over the step: every collective's bytes per level
    spread evenly over its duration, divided by the level's total capacity."""
    if not tl.ops:
        return []
    t_end = max(e for _, _, e in tl.ops)
    edges = np.linspace(tl.t0, max(t_end, tl.t0 + 1e-12), COUNTER_BINS + 1)
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
    width = np.diff(edges)[:, None]
    util = load / width / np.where(level_capacity[:3] > 0, level_capacity[:3], np.inf)
    return [{"name": "link utilization", "ph": "C", "pid": pid, "ts": edges[b] * 1e6,
             "args": {LEVELS[i]: float(util[b, i]) for i in range(3)}} for b in range(COUNTER_BINS)]
