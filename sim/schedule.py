"""Running a step's phases: start and end time of every phase on every rank.

Two executors, which agree where both apply (within a few percent; see below):

- ``run_analytic`` (fast mode): every rank's clock per stream is a numpy array and each
  phase advances them at once (a max-plus schedule): a phase starts when its stream and
  its dependencies are done; a collective starts when its last member arrives and its
  stages (``CollectiveModel.stages``) take the analytic time of the network model: a
  fixed latency, then its bytes for as long as its most loaded link needs alone. Ops
  running at the same time share links: the ops of a phase (the EP groups' all-to-alls),
  and ops of other phases and streams that overlap them in time (the expert sync on the
  sync stream during the backward, M22; micro-batches, M22; groups that drift apart).
  Each stage is delayed for the time it shares a link, by the max-min share the link
  gives it there (``LinkLoads.delays``); since delays move ops in time and so change who
  overlaps whom, the schedule is a fixed point, found in a few passes
  (``run_analytic``). Copies run alone on the rank's PCIe links (no fabric route crosses
  them). No per-rank events: this is what makes thousands of GPUs cheap.
- ``run_flows`` (flow mode): a simpy process per (rank, stream) walks that stream's
  phases; collectives and page copies are flows on the max-min fair network, so
  concurrent traffic shares links, and on CPU backends compute shares the cores
  (``sim.cores``).

Both return ``Timeline``: ``start[p, r]``, ``end[p, r]`` (seconds), ``fitted[p, r]`` (the
seconds of that phase that come from fitted constants: a host-cost phase whole, a
collective's calibrated software latency) and the collectives with their start and end
(for link counters in the trace). A rank that is not a member of
any op of an ``ops`` phase passes it at once.

Contention in analytic mode is exact where the bottleneck model is: a stage that shares
no link with a stage running at the same time keeps its time alone, and n equal stages
that start together on one bottleneck link take n times as long. Elsewhere it estimates
the max-min rates (each flow at least its fair share; other stages' bytes spread evenly
over their windows): on skewed, oversubscribed clusters of 16-512 GPUs a step and its
stages come within a few percent of flow mode, up to about 15% where many skewed
all-to-alls drift apart (``benchmarks/sim_agreement.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import simpy

from sim.analytic_timer import AnalyticTimer
from sim.collective_model import CollectiveModel
from sim.cores import CorePool
from sim.phases import Phase

STREAMS = ("compute", "comm", "copy", "sync")


@dataclass
class Timeline:
    start: np.ndarray  # [phases, ranks] seconds
    end: np.ndarray  # [phases, ranks] seconds
    ops: list  # (op, start_s, end_s)
    t0: float
    fitted: np.ndarray | None = None  # [phases, ranks] seconds from fitted constants


def fitted_seconds(ph: Phase, model: CollectiveModel, world: int) -> np.ndarray:
    """[W] seconds of a phase that come from fitted constants: all of a fitted (host-cost)
    phase; for collectives, per rank the largest fitted latency among its concurrent ops."""
    if ph.kind in ("compute", "wait"):
        return ph.seconds if ph.fitted else np.zeros(world)
    out = np.zeros(world)
    if ph.kind == "ops" and model.software.fitted:
        for op in ph.ops:
            m = np.asarray(op.members)
            out[m] = np.maximum(out[m], model.fitted_seconds(op))
    return out


def copy_seconds(ph: Phase, h2d_bw: np.ndarray, d2h_bw: np.ndarray, latency_s: float) -> np.ndarray:
    """Per-rank seconds of a copy phase alone on its PCIe link: both directions at once,
    plus a fixed latency per page."""
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.where(ph.h2d > 0, ph.h2d / h2d_bw, 0.0)
        down = np.where(ph.d2h > 0, ph.d2h / d2h_bw, 0.0)
    return np.maximum(up, down) + ph.pages * latency_s


MAX_PASSES = 8  # schedule passes of run_analytic's contention fixed point, at most
FIRST_STEP = 0.5  # share of the first pass's delays taken: found on windows too short, they overshoot
MIN_STEP = 0.05  # the smallest share of a pass's change of the delays that the next pass takes
PASS_RTOL = 0.02  # consistent: the delays move by less than this share of all transfer seconds


class LinkLoads:
    """The bytes every collective of a step puts on each link, as flat arrays.

    Ops are numbered in phase order; op ``o`` has stages ``stage0[o] : stage0[o + 1]``
    (``AnalyticTimer.stage_loads``). Stage ``q`` takes ``alone[q]`` seconds alone on the
    fabric (``AnalyticTimer.stage_seconds``): ``fixed[q]`` seconds of latency, then its
    bytes flow for ``transfer[q]`` seconds (bytes / capacity of its most loaded link).
    Its bytes are the *entries* ``ptr[q] : ptr[q + 1]``: ``nbytes[k]`` bytes in
    ``flows[k]`` flows (``flow_counts``) on edge ``edge[k]`` of ``cap[k]`` bytes/s, and
    ``flow_bytes[k]``: the bytes of one of the flows that set the stage's pace there, the
    larger of a mean flow on that edge and a mean flow on the stage's most loaded one.
    Building it adds every op's bytes to the network's statistics
    (``AnalyticTimer.record``): contention changes when bytes move, not how many.
    """

    def __init__(self, phases: list[Phase], timer: AnalyticTimer):
        seen: dict[tuple, tuple] = {}  # ops of one shape (not all-to-alls) load the links alike
        fixed, alone, stage0, edges, nbytes, messages, direct = [], [], [0], [], [], [], []
        for op in (op for ph in phases if ph.kind == "ops" for op in ph.ops):
            key = None if op.kind == "all_to_all_v" else (op.kind, op.members, op.size)
            got = seen.get(key) if key else None
            if got is None:
                loads = timer.stage_loads(op)
                got = (loads, [timer.stage_seconds(load) for load in loads])
                if key:
                    seen[key] = got
            loads, seconds = got
            timer.record(loads)
            for load, sec in zip(loads, seconds):
                fixed.append(load.fixed_s)
                alone.append(sec)
                edges.append(load.edges)
                nbytes.append(load.nbytes)
                messages.append(load.messages)
            direct += [op.kind == "all_to_all_v"] * len(loads)
            stage0.append(len(fixed))
        Q = len(fixed)
        self.fixed, self.alone = np.array(fixed, dtype=float), np.array(alone, dtype=float)
        self.stage0 = np.array(stage0)
        edge, nbyte, message = _concat(edges, np.int64), _concat(nbytes, float), _concat(messages, float)
        stage_of = np.repeat(np.arange(Q), [len(e) for e in edges])
        used = nbyte > 0  # an all-to-all's routes include its empty pairs'
        self.edge, self.nbytes, self.stage_of = edge[used], nbyte[used], stage_of[used]
        self.ptr = np.concatenate([[0], np.cumsum(np.bincount(self.stage_of, minlength=Q))])
        self.flows = flow_counts(message[used], self.stage_of, self.ptr, np.array(direct, dtype=bool))
        self.cap = timer.fabric.capacity[self.edge].clip(min=1e-300)
        bottleneck = self.nbytes / self.cap  # the quotient of AnalyticTimer.stage_seconds
        self.transfer = np.zeros(Q)
        pace = np.zeros(Q)  # bytes of a mean flow on the stage's most loaded edge
        moving = np.diff(self.ptr) > 0
        if moving.any():
            self.transfer[moving] = np.maximum.reduceat(bottleneck, self.ptr[:-1][moving])
            top = np.zeros(Q, dtype=np.int64)
            at_top = bottleneck >= self.transfer[self.stage_of]
            top[self.stage_of[at_top]] = np.flatnonzero(at_top)
            pace = self.nbytes[top] / self.flows[top]
        self.flow_bytes = np.maximum(self.nbytes / self.flows, pace[self.stage_of])
        # entries by link, in stage order on each (numpy sorts 16-bit keys by radix)
        self._key = self.edge.astype(np.uint16 if timer.fabric.num_edges <= 2**16 else np.int64)
        self._by_link = np.argsort(self._key, kind="stable")
        linked = self.edge[self._by_link]
        self._next_same_link = linked[1:] == linked[:-1]

    def delays(self, begin: np.ndarray, length: np.ndarray) -> np.ndarray:
        """[stages] seconds each stage's transfer takes beyond ``transfer`` when every stage
        moves its bytes during ``[begin, begin + length)`` (seconds).

        Alone, a stage moves ``1 / transfer`` of its bytes per second. While it shares a
        link with other stages (``shared`` seconds of its window), the link lets it move
        (max-min fairness) the larger of: each of its flows' fair share, ``capacity / all
        flows on the link`` (of which its pace flows, ``flow_bytes`` bytes each, need
        their part; never less than ``its flows / all flows`` of its pace alone), and
        what the other stages leave of the link (their bytes taken as spread evenly over
        their windows). The share of its bytes it moves in its window is then

            done = (length - shared) / transfer + min(shared / transfer, got)

        so it needs ``length / done``: exactly ``length`` when the windows are
        consistent, the fixed point ``run_analytic`` looks for. A stage is as slow as its
        slowest link. A link it shares at no time costs it nothing (``shared`` is 0
        exactly): alone, an op keeps its bottleneck time. Cost: O(entries) to find the
        links shared at some time (most, a GPU's own ports, are used one stage after
        another), then a sweep in time over the starts and ends of the stages on those.
        """
        Q, N = len(begin), len(self.edge)
        out = np.zeros(Q)
        if N == 0:
            return out
        end = begin + length
        # a link whose stages, in stage order, each start once the one before has ended
        # is shared at no time
        by = self.stage_of[self._by_link]
        clash = self._next_same_link & (begin[by[1:]] < end[by[:-1]])
        if not clash.any():
            return out
        shared_link = np.zeros(int(self.edge.max()) + 1, dtype=bool)
        shared_link[self.edge[self._by_link[1:][clash]]] = True
        sel = np.flatnonzero(shared_link[self.edge])  # entries on links shared at some time
        M = len(sel)
        # events: start of entry sel[i] (i) and its end (M + i), by link, in time order
        when = np.concatenate([begin[self.stage_of[sel]], end[self.stage_of[sel]]])
        order = np.argsort(when, kind="stable")
        order = order[np.argsort(self._key[sel[order % M]], kind="stable")]
        entry, when = sel[order % M], when[order]
        edge = self.edge[entry]
        sign = np.where(order < M, 1.0, -1.0)
        on_link = np.cumsum(sign)  # stages on the link after each event (exact: all that start end)
        gap = np.zeros(2 * M)  # seconds to the next event on the same link
        gap[:-1] = np.where(edge[1:] == edge[:-1], when[1:] - when[:-1], 0.0)
        shared_gap = np.where(on_link > 1.5, gap, 0.0)
        flows_on = np.cumsum(sign * self.flows[entry])
        span = np.where(length > 0, length, np.inf)[self.stage_of[sel]]
        rate = self.nbytes[sel] / span  # bytes/s, spread evenly over the stage's window
        shared = _running(shared_gap)
        per_flow = _running(np.divide(shared_gap, flows_on, out=np.zeros_like(gap), where=shared_gap > 0))
        carried = _running(np.cumsum(sign * rate[order % M]) * shared_gap)  # all stages' bytes while shared
        at = np.empty(2 * M, dtype=np.int64)  # where each event went
        at[order] = np.arange(2 * M)
        mine = np.flatnonzero(shared[at[M:]] > shared[at[:M]])  # entries on a link they share
        if len(mine) == 0:
            return out
        k, pa, pe = sel[mine], at[mine], at[M + mine]
        q = self.stage_of[k]
        t_shared = shared[pe] - shared[pa]
        window, transfer, cap, nbytes = length[q], self.transfer[q], self.cap[k], self.nbytes[k]
        fair = (per_flow[pe] - per_flow[pa]) * np.maximum(cap / self.flow_bytes[k], self.flows[k] / transfer)
        others = np.maximum(carried[pe] - carried[pa] - rate[mine] * t_shared, 0.0)
        left = (cap * t_shared - others) / nbytes
        done = (window - t_shared) / transfer + np.minimum(t_shared / transfer, np.maximum(fair, left))
        need = np.maximum(window / np.maximum(done, 1e-12), nbytes / cap)
        stages, first = np.unique(q, return_index=True)  # q is sorted: entries lie by stage
        out[stages] = np.maximum(np.maximum.reduceat(need, first) - self.transfer[stages], 0.0)
        return out


def flow_counts(messages: np.ndarray, stage_of: np.ndarray, ptr: np.ndarray, direct: np.ndarray) -> np.ndarray:
    """About how many of its stage's flows cross each entry's edge (the weight of the
    stage's fair share there), from the library messages on it (``StageLoad.messages``):
    a direct all-to-all (``direct[stage]``) carries one message per flow; the other
    algorithms' flows each carry the same messages, so messages over the fewest on any
    edge of the stage (one flow's: a sender's own port). At least one on an edge."""
    lowest = np.full(len(ptr) - 1, np.inf)
    moving = np.diff(ptr) > 0
    if moving.any():
        lowest[moving] = np.minimum.reduceat(np.where(messages > 0, messages, np.inf), ptr[:-1][moving])
    per_flow = np.where(direct | ~np.isfinite(lowest), 1.0, lowest)
    return np.maximum(messages / per_flow[stage_of], 1.0)


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _running(y: np.ndarray) -> np.ndarray:
    """Running sum before each element: ``out[i] = y[0] + ... + y[i - 1]``."""
    out = np.empty(len(y))
    if len(y):
        out[0] = 0.0
        np.cumsum(y[:-1], out=out[1:])
    return out


def run_analytic(phases: list[Phase], world: int, timer: AnalyticTimer, t0: float,
                 copy_latency_s: float) -> Timeline:
    """The max-plus schedule of ``phases``, collectives sharing links (module doc).

    Pass 0 times every stage of every op alone (``AnalyticTimer.stage_seconds``). Each
    pass after it delays every stage for the links it shared in the pass before with the
    stages that overlapped it (``LinkLoads.delays``) and schedules again. The delays move
    towards that estimate by a share found by Aitken's relaxation (the step that would
    have cancelled the last two changes; ``FIRST_STEP`` at first) until they move by less
    than ``PASS_RTOL`` of all transfer seconds, at most ``MAX_PASSES`` passes; it returns
    the most consistent pass. Ops that share no link with an op running at the same time
    keep their time alone exactly.
    """
    loads = LinkLoads(phases, timer)
    fabric = timer.fabric
    h2d_bw = fabric.capacity[fabric.offset["h2d"] + np.arange(world)]
    d2h_bw = fabric.capacity[fabric.offset["d2h"] + np.arange(world)]
    fixed_s = []  # [W] seconds of each compute, wait and copy phase, the same every pass
    for ph in phases:
        if ph.kind == "copy":  # alone on the rank's own PCIe links: no fabric route crosses them
            fixed_s.append(copy_seconds(ph, h2d_bw, d2h_bw, copy_latency_s))
            for kind, nbytes, bw in (("h2d", ph.h2d, h2d_bw), ("d2h", ph.d2h, d2h_bw)):
                edges = fabric.offset[kind] + np.arange(world)  # each rank's PCIe link
                timer.stats.bytes_by_edge[edges] += nbytes
                timer.stats.busy_by_edge[edges] += np.divide(nbytes, bw, out=np.zeros(world), where=bw > 0)
        else:
            fixed_s.append(ph.seconds if ph.kind in ("compute", "wait") else None)
    fitted = np.array([fitted_seconds(ph, timer.model, world) for ph in phases]).reshape(len(phases), world)
    extra = np.zeros(len(loads.fixed))  # seconds each stage's transfer waits for others
    step, last, best = FIRST_STEP, None, (np.inf, None)
    for _ in range(MAX_PASSES):
        tl, begin = _schedule(phases, world, t0, fixed_s, fitted, loads, extra)
        length = np.maximum(loads.alone - loads.fixed, 0.0) + extra  # seconds each stage's bytes flow
        moved = loads.delays(begin, length) - extra
        off = np.abs(moved).sum() / max(length.sum(), 1e-300)  # how far the pass is from consistent
        if best[1] is None or off < best[0]:
            best = (off, tl)
        if off <= PASS_RTOL:
            break
        if last is not None:  # the delays swing (short windows overlap more): damp by Aitken's step
            change = moved - last
            norm = float(change @ change)
            if norm > 0:
                step = min(max(-step * float(last @ change) / norm, MIN_STEP), 1.0)
        extra = np.maximum(extra + step * moved, 0.0)
        last = moved
    return best[1]


def _schedule(phases, world, t0, fixed_s, fitted, loads: LinkLoads, extra: np.ndarray):
    """One max-plus pass, every stage ``extra`` seconds slower than alone: the Timeline,
    and [stages] the time each stage's bytes start to flow (seconds)."""
    clock = {s: np.full(world, t0) for s in STREAMS}
    start = np.empty((len(phases), world))
    end = np.empty((len(phases), world))
    stage_s = loads.alone + extra
    n_stages = np.diff(loads.stage0)
    op_s = np.zeros(len(n_stages))  # an op: its stages one after the other
    if n_stages.any():
        op_s[n_stages > 0] = np.add.reduceat(stage_s, loads.stage0[:-1][n_stages > 0])
    op_start = np.zeros(len(op_s))
    members: dict[tuple, np.ndarray] = {}
    log = []
    o = 0
    for p, ph in enumerate(phases):
        ready = clock[ph.stream].copy()
        for d in ph.deps:
            np.maximum(ready, end[d], out=ready)
        if ph.kind != "ops":
            done = ready + fixed_s[p]
        else:
            done = ready.copy()
            for op in ph.ops:
                m = members.get(op.members)
                if m is None:
                    m = members[op.members] = np.asarray(op.members)
                s = ready[m].max()
                e = s + op_s[o]
                op_start[o] = s
                done[m] = np.maximum(done[m], e)
                log.append((op, s, e))
                o += 1
        start[p], end[p] = ready, done
        clock[ph.stream] = done
    # a stage's bytes start after the op's earlier stages and the stage's fixed latency
    before = np.concatenate([[0.0], np.cumsum(stage_s)])
    first = np.repeat(loads.stage0[:-1], n_stages)
    begin = np.repeat(op_start, n_stages) + (before[:-1] - before[first]) + loads.fixed
    return Timeline(start, end, log, t0, fitted), begin


def run_flows(phases: list[Phase], world: int, model: CollectiveModel, t0: float,
              copy_latency_s: float, cores: CorePool | None = None) -> Timeline:
    """``cores``: CPU cores shared by the ranks; their compute phases (not the fitted host
    costs, measured under the real runs' own sharing) then take their turn on the rank's
    core (``sim.cores``) instead of running alone."""
    env, network = model.env, model.network
    start = np.zeros((len(phases), world))
    end = np.zeros((len(phases), world))
    done = [[env.event() for _ in range(world)] for _ in phases]
    pending: dict[int, list] = {}
    log = []

    def collective(op) -> simpy.Event:
        entry = pending.get(id(op))
        if entry is None:
            entry = pending[id(op)] = [0, env.event(), None]
        entry[0] += 1
        if entry[0] == len(op.members):  # the last member arrived: the op starts now
            del pending[id(op)]
            began, finished = env.now, entry[1]

            def record(_event, op=op, began=began, finished=finished):
                log.append((op, began, env.now))
                finished.succeed()

            model.run(op).callbacks.append(record)
        return entry[1]

    def copy(ph: Phase, r: int):
        """Per-page latencies, then both directions at once on the rank's PCIe link."""
        yield env.timeout(ph.pages[r] * copy_latency_s)
        flows = []
        if ph.h2d[r] > 0:
            flows.append(network.start_flows([r], [r], [ph.h2d[r]], tag="paging", kind="h2d", path_latency=False))
        if ph.d2h[r] > 0:
            flows.append(network.start_flows([r], [r], [ph.d2h[r]], tag="paging", kind="d2h", path_latency=False))
        yield simpy.AllOf(env, flows)

    def stream_process(r: int, indices: list[int]):
        for p in indices:
            ph = phases[p]
            deps = [done[d][r] for d in ph.deps]
            if deps:
                yield simpy.AllOf(env, deps)
            start[p, r] = env.now
            if ph.kind == "compute" and cores is not None and not ph.fitted:
                yield cores.run(r, ph.seconds[r])
            elif ph.kind in ("compute", "wait"):
                if ph.seconds[r] > 0:
                    yield env.timeout(ph.seconds[r])
            elif ph.kind == "copy":
                if ph.pages[r] > 0:
                    yield env.process(copy(ph, r))
            else:
                mine = [collective(op) for op in ph.ops if r in op.members]
                if mine:
                    yield simpy.AllOf(env, mine)
            end[p, r] = env.now
            done[p][r].succeed()

    by_stream = {s: [p for p, ph in enumerate(phases) if ph.stream == s] for s in STREAMS}
    procs = [env.process(stream_process(r, idx)) for r in range(world) for idx in by_stream.values() if idx]
    env.run(until=simpy.AllOf(env, procs))
    if pending:
        raise RuntimeError(f"{len(pending)} collectives never started: ranks disagree on the ops")
    fitted = np.stack([fitted_seconds(ph, model, world) for ph in phases]) if phases else np.zeros((0, world))
    return Timeline(start, end, log, t0, fitted)
