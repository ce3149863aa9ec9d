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
max-min sharing from each stage's bytes, flows and largest flow per link: a link busy
with the stages it limits carries their bytes before the largest flows finish, however
their starts are staggered (the EP groups of a phase stay in step), no flow of theirs
getting more than a stage's largest flow meanwhile; stages limited elsewhere move their
bytes evenly over their windows. On skewed, oversubscribed clusters of 16-512 GPUs a step
comes within about 6% of flow mode and its communication stages within about 8%
(``benchmarks/sim_agreement.py``); other workload seeds of those scenarios reach about
12% on single stages of the smallest strided ones, mostly where a skewed all-to-all's
flows are held in turn by a shared uplink and by a GPU's own port, which a per-link
estimate does not see.
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
FIRST_STEP = 1.0  # share of the first pass's delays taken (LinkLoads.delays' form barely overshoots)
MIN_STEP = 0.05  # the smallest share of a pass's change of the delays that the next pass takes
PASS_RTOL = 0.005  # consistent: the delays move by less than this share of all transfer seconds
SWEEP_CHUNK = 2**15  # entries per chunk of LinkLoads.delays' sweep (whole links: a chunk may be longer)
FAIR_RTOL = 0.02  # a link limits a stage's flows that move at least this close to their fair share there


class LinkLoads:
    """The bytes every collective of a step puts on each link, as flat arrays.

    Ops are numbered in phase order; op ``o`` has stages ``stage0[o] : stage0[o + 1]``
    (``AnalyticTimer.stage_loads``). Stage ``q`` takes ``alone[q]`` seconds alone on the
    fabric (``AnalyticTimer.stage_seconds``): ``fixed[q]`` seconds of latency, then its
    bytes flow for ``transfer[q]`` seconds (bytes / capacity of its most loaded link).
    Its bytes are the *entries* ``ptr[q] : ptr[q + 1]``: ``nbytes[k]`` bytes in
    ``flows[k]`` flows (``flow_counts``) on edge ``edge[k]`` of ``cap[k]`` bytes/s, the
    largest of them ``largest[k]`` bytes (an all-to-all's flows differ, ``AnalyticTimer.all_to_all_loads``;
    every other algorithm's flows on an edge are alike), ``moving0[k]`` and ``fall[k]``
    how many of them still move over the stage's window (``still_moving``). Building it
    adds every op's bytes to the network's statistics (``AnalyticTimer.record``):
    contention changes when bytes move, not how many.
    """

    def __init__(self, phases: list[Phase], timer: AnalyticTimer):
        ops = [op for ph in phases if ph.kind == "ops" for op in ph.ops]
        by_members: dict[tuple, list] = {}  # the all-to-alls of each member set, timed together
        for op in ops:
            if op.kind == "all_to_all_v":
                by_members.setdefault(op.members, []).append(op)
        direct_loads: dict[int, tuple] = {}  # id(op) -> (its stage, its largest flow per edge)
        for members, group in by_members.items():
            for op, load, big in zip(group, *timer.all_to_all_loads(members, group)):
                direct_loads[id(op)] = (load, big)
        seen: dict[tuple, tuple] = {}  # ops of one shape (not all-to-alls) load the links alike
        fixed, alone, stage0, edges, nbytes, messages, direct, biggest, sig = [], [], [0], [], [], [], [], [], []
        for op in ops:
            is_direct = op.kind == "all_to_all_v"
            if is_direct:
                load, big = direct_loads[id(op)]
                loads, seconds = [load], [timer.stage_seconds(load)]
                biggest.append(big)
            else:
                key = (op.kind, op.members, op.size)
                got = seen.get(key)
                if got is None:
                    loads = timer.stage_loads(op)
                    got = seen[key] = (loads, [timer.stage_seconds(load) for load in loads])
                loads, seconds = got
                biggest += [np.zeros(len(load.edges)) for load in loads]  # set below: flows alike
            timer.record(loads)
            for load, sec in zip(loads, seconds):
                fixed.append(load.fixed_s)
                alone.append(sec)
                edges.append(load.edges)
                nbytes.append(load.nbytes)
                messages.append(load.messages)
            direct += [is_direct] * len(loads)
            sig.append((op.kind, op.members, len(loads)))
            stage0.append(len(fixed))
        Q = len(fixed)
        self.signature = tuple(sig)  # the ops' kinds, members and stage counts, in order
        self.fixed, self.alone = np.array(fixed, dtype=float), np.array(alone, dtype=float)
        self.stage0 = np.array(stage0)
        edge, nbyte, message = _concat(edges, np.int64), _concat(nbytes, float), _concat(messages, float)
        stage_of = np.repeat(np.arange(Q), [len(e) for e in edges])
        used = nbyte > 0  # an all-to-all's routes include its empty pairs'
        self.edge, self.nbytes, self.stage_of = edge[used], nbyte[used], stage_of[used]
        self.ptr = np.concatenate([[0], np.cumsum(np.bincount(self.stage_of, minlength=Q))])
        self.flows = flow_counts(message[used], self.stage_of, self.ptr, np.array(direct, dtype=bool))
        self.largest = _concat(biggest, float)[used]
        alike = ~np.array(direct, dtype=bool)[self.stage_of]  # other algorithms' flows on an edge are alike
        self.largest[alike] = (self.nbytes / self.flows)[alike]
        self.moving0, self.fall = still_moving(self.nbytes, self.flows, self.largest)
        self.cap = timer.fabric.capacity[self.edge].clip(min=1e-300)
        bottleneck = self.nbytes / self.cap  # the quotient of AnalyticTimer.stage_seconds
        self.transfer = np.zeros(Q)
        moving = np.diff(self.ptr) > 0
        if moving.any():
            self.transfer[moving] = np.maximum.reduceat(bottleneck, self.ptr[:-1][moving])
        # From here on the entries lie by link, in stage order on each: the sweep in
        # ``delays`` then gathers within one link's entries (near in memory, not across
        # the whole array). numpy sorts 16-bit keys by radix.
        key = self.edge.astype(np.uint16 if timer.fabric.num_edges <= 2**16 else np.int64)
        by_link = np.argsort(key, kind="stable")
        for name in ("edge", "nbytes", "stage_of", "flows", "largest", "moving0", "fall", "cap"):
            setattr(self, name, getattr(self, name)[by_link])
        self._next_same_link = self.edge[1:] == self.edge[:-1]
        # a stage has one entry per link (stage_loads sums an op's bytes per edge), so an
        # event's link and its stage's place in time order sort it without ties
        self._one_per_link = not (self._next_same_link & (self.stage_of[1:] == self.stage_of[:-1])).any()

    def delays(self, begin: np.ndarray, length: np.ndarray) -> np.ndarray:
        """[stages] seconds each stage's transfer takes beyond ``transfer`` when every stage
        moves its bytes during ``[begin, begin + length)`` (seconds).

        Alone, a stage moves ``1 / transfer`` of its bytes per second. On a link it shares
        with other stages for ``shared`` seconds of its window, it moves there the ``rest``
        of its bytes that its time alone leaves, and the link carries the others' bytes
        meanwhile. Max-min gives every flow that a link limits the same rate, so the
        stage's largest flow there is among the last to finish: of the other stages that
        the link limits (``held``: their largest flow moves at least about its fair share
        there, capacity / the flows moving), the link carries before it ends what they
        still had to move when it started (their bytes taken as spread evenly over their
        windows up to then) and all the bytes of those that start before it ends
        (``waiting``), however their starts are staggered. Of the stages limited elsewhere
        it carries their bytes spread evenly over their windows (``spread``). Neither gets
        more for a flow than the stage's largest flow moves in the same time, ``rest`` of
        ``largest`` in ``shared`` seconds, while that flow of theirs still moves
        (``still_moving``: a stage's smaller flows finish first). So it needs

            need = (length - shared) + max(rest * transfer, (rest * nbytes + others) / cap)

        seconds there: exactly ``length`` when the windows are consistent, the fixed point
        ``run_analytic`` looks for; the form moves little with the stage's own window, so
        the passes converge. A stage is as slow as its slowest link. A link it shares at no
        time costs it nothing (``shared`` is 0 exactly): alone, an op keeps its bottleneck
        time. Cost: O(entries) to find the links shared at some time (most, a GPU's own
        ports, are used one stage after another), then a sweep in time over the starts and
        ends of the stages on those.
        """
        Q, N = len(begin), len(self.edge)
        out = np.zeros(Q)
        if N == 0:
            return out
        end = begin + length
        # a link whose stages, in stage order, each start once the one before has ended
        # is shared at no time
        by = self.stage_of
        clash = self._next_same_link & (begin[by[1:]] < end[by[:-1]])
        if not clash.any():
            return out
        shared_link = np.zeros(int(self.edge.max()) + 1, dtype=bool)
        shared_link[self.edge[1:][clash]] = True
        sel = np.flatnonzero(shared_link[self.edge])  # entries on links shared at some time (by link)
        # the stages' 2Q ends and starts in time order (at one time, ends first: a stage
        # that starts as another ends never shares with it; then in stage order)
        rank = np.empty(2 * Q, dtype=np.int64)
        rank[np.argsort(np.concatenate([end, begin]), kind="stable")] = np.arange(2 * Q)
        slowest = np.full(Q, -np.inf)  # each stage's need on its slowest shared link
        # links are independent: sweep them in chunks of whole links, whose temporaries
        # stay in the CPU's caches (and in the heap: no fresh pages per pass)
        new_link = np.flatnonzero(np.r_[True, self.edge[sel][1:] != self.edge[sel][:-1]])
        at = np.searchsorted(new_link, np.arange(0, len(sel), SWEEP_CHUNK))  # the first link from there
        cuts = np.unique(new_link[at[at < len(new_link)]])
        for lo, hi in zip(cuts, np.r_[cuts[1:], len(sel)]):
            self._sweep(sel[lo:hi], begin, end, length, rank, slowest)
        stages = np.flatnonzero(slowest > -np.inf)
        out[stages] = np.maximum(slowest[stages] - self.transfer[stages], 0.0)
        return out

    def _sweep(self, sel: np.ndarray, begin: np.ndarray, end: np.ndarray, length: np.ndarray,
               rank: np.ndarray, slowest: np.ndarray) -> None:
        """``delays``' sweep over the entries ``sel`` (whole links, by link): raises
        ``slowest[q]`` to stage ``q``'s ``need`` on each of these links it shares."""
        Q, M = len(begin), len(sel)
        stage = self.stage_of[sel]
        edge_sel = self.edge[sel]
        # events: end of entry sel[i] (i) and its start (M + i), by link, in time order: an
        # event sorts by (its link's place, its stage event's rank)
        link_no = np.cumsum(np.r_[0, edge_sel[1:] != edge_sel[:-1]])  # the link's place among sel's
        event_key = np.concatenate([link_no * (2 * Q) + rank[stage], link_no * (2 * Q) + rank[Q + stage]])
        order = np.argsort(event_key, kind="quicksort" if self._one_per_link else "stable")
        starts = order >= M
        ev = order - np.where(starts, M, 0)  # ev: the entry (of sel) of each event
        when = np.where(starts, begin[stage[ev]], end[stage[ev]])
        edge = edge_sel[ev]
        sign = np.where(starts, 1.0, -1.0)
        at = np.empty(2 * M, dtype=np.int64)  # where each event went
        at[order] = np.arange(2 * M)
        pe, pa = at[:M], at[M:]  # each entry's end and start event
        on_link = np.cumsum(sign)  # stages on the link after each event (exact: all that start end)
        gap = np.zeros(2 * M)  # seconds to the next event on the same link
        gap[:-1] = np.where(edge[1:] == edge[:-1], when[1:] - when[:-1], 0.0)
        shared_gap = np.where(on_link > 1.5, gap, 0.0)
        shared = _running(shared_gap)
        shared = _running(shared_gap)
        mine = np.flatnonzero(shared[pe] > shared[pa])  # entries on a link they share
        if len(mine) == 0:
            return
        t_mid = np.zeros(2 * M)  # the middle of the gap to the next event, from the first event
        t_mid[:-1] = 0.5 * (when[1:] + when[:-1]) - when[0]
        span = np.where(length > 0, length, np.inf)[stage]
        nbytes = self.nbytes[sel]
        rate = nbytes / span  # bytes/s, spread evenly over the window
        # flows still moving (``still_moving``), as c0 + c1 t, and their integral while
        # shared, of all stages and (below) of those the link limits
        c1 = -self.moving0[sel] * self.fall[sel] / span
        c0 = self.moving0[sel] - c1 * (begin[stage] - when[0])
        s0, s1 = sign * c0[ev], sign * c1[ev]
        all_time = _running((np.cumsum(s0) + np.cumsum(s1) * t_mid) * shared_gap)
        shared_t = _running(shared_gap * t_mid)  # the integral of t while shared
        # which stages' flows a link limits: those whose largest flow moves at least about
        # its fair share there, capacity / the flows moving, over their shared time
        shared_all = shared[pe] - shared[pa]
        fair = self.cap[sel] * np.divide(shared_all, all_time[pe] - all_time[pa], out=np.zeros(M),
                                         where=shared_all > 0)
        held = self.largest[sel] >= (1.0 - FAIR_RTOL) * fair * span
        held_ev = held[ev]
        s0[~held_ev] = 0.0
        s1[~held_ev] = 0.0
        held_time = _running((np.cumsum(s0) + np.cumsum(s1) * t_mid) * shared_gap)
        # of the stages it limits: before each event, the bytes of those started (not at its
        # time: ends come first) and of those moved, spread evenly over their windows
        # (running sums over all links: the links before add as much to one as to the other);
        # of the others: their bytes spread evenly over their windows, while shared
        arrived = _running(np.where(starts & held_ev, nbytes[ev], 0.0))
        signed_rate = sign * rate[ev]
        rate_all = np.cumsum(signed_rate)
        rate_held = np.cumsum(np.where(held_ev, signed_rate, 0.0))
        moved = _running(rate_held * gap)
        carried = _running((rate_all - rate_held) * shared_gap)

        i, a, e = sel[mine], pa[mine], pe[mine]
        q = self.stage_of[i]
        t_shared = shared_all[mine]
        window, transfer, cap, largest, own = length[q], self.transfer[q], self.cap[i], self.largest[i], nbytes[mine]
        rest = np.maximum(1.0 - (window - t_shared) / transfer, 0.0)  # of its bytes, for the shared time
        mine_held = held[mine]
        own_flows = c0[mine] * t_shared + c1[mine] * (shared_t[e] - shared_t[a])
        held_flows = held_time[e] - held_time[a]
        limited_flows = all_time[e] - all_time[a] - held_flows
        spread = carried[e] - carried[a]
        waiting = arrived[e] - moved[a]
        waiting[mine_held] -= own[mine_held]
        held_flows[mine_held] -= own_flows[mine_held]
        limited_flows[~mine_held] -= own_flows[~mine_held]
        spread[~mine_held] -= rate[mine][~mine_held] * t_shared[~mine_held]
        per_flow_most = rest * largest / t_shared  # what its largest flow moves per second
        others = (np.clip(waiting, 0.0, per_flow_most * np.maximum(held_flows, 0.0))
                  + np.clip(spread, 0.0, per_flow_most * np.maximum(limited_flows, 0.0)))
        need = np.maximum((window - t_shared) + np.maximum(rest * transfer, (rest * own + others) / cap), own / cap)
        np.maximum.at(slowest, q, need)


def still_moving(nbytes: np.ndarray, flows: np.ndarray, largest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How many of a stage's flows on a link still move over its window: ``n0 (1 - fall
    x share of the window gone)`` (``fall`` in [0, 1]), from its ``flows`` flows of
    ``nbytes`` bytes there, the largest ``largest`` bytes.

    Max-min shares a link equally among the flows it limits, so they progress together
    and the smaller ones finish first; the largest moves all through the window. On
    average ``nbytes / largest`` of them move. Flows of sizes spread evenly between
    ``2 mean - largest`` and ``largest`` (falling from all of them to none, at the same
    average), or, if the mean is less than half the largest, ``2 nbytes / largest`` flows
    from 0 to ``largest``. Equal flows (an algorithm's other than the all-to-all) all move
    the whole window."""
    mean_count = np.minimum(nbytes / largest, flows)
    half = mean_count < 0.5 * flows
    return np.where(half, 2.0 * mean_count, flows), np.where(half, 1.0, 2.0 * (1.0 - mean_count / flows))


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
                 copy_latency_s: float, warm: WarmStart | None = None) -> Timeline:
    """The max-plus schedule of ``phases``, collectives sharing links (module doc).

    Pass 0 times every stage of every op alone (``AnalyticTimer.stage_seconds``), or
    with the delays of the step before when ``warm`` holds them for the same ops. Each
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
    if warm is not None:
        extra = warm.start(loads, extra)
    step, last, best = FIRST_STEP, None, (np.inf, None)
    for _ in range(MAX_PASSES):
        tl, begin = _schedule(phases, world, t0, fixed_s, fitted, loads, extra)
        length = np.maximum(loads.alone - loads.fixed, 0.0) + extra  # seconds each stage's bytes flow
        moved = loads.delays(begin, length) - extra
        off = np.abs(moved).sum() / max(length.sum(), 1e-300)  # how far the pass is from consistent
        if best[1] is None or off < best[0]:
            best = (off, tl, extra)
        if off <= PASS_RTOL:
            break
        if last is not None:  # the delays swing (short windows overlap more): damp by Aitken's step
            change = moved - last
            norm = float(change @ change)
            if norm > 0:
                step = min(max(-step * float(last @ change) / norm, MIN_STEP), 1.0)
        extra = np.maximum(extra + step * moved, 0.0)
        last = moved
    if warm is not None:
        warm.keep(loads, best[2])
    return best[1]


class WarmStart:
    """The delays of the last step's most consistent pass, the first guess of the next
    step's fixed point when its stages are the same ops (kinds, members, stage counts) in
    the same order (``LinkLoads.signature``): a step like the one before then takes one
    pass, to check, instead of two. Same scenario and seed: the same steps, the same
    guesses, the same results."""

    def __init__(self):
        self._signature, self._extra = None, None

    def start(self, loads: LinkLoads, cold: np.ndarray) -> np.ndarray:
        return self._extra.copy() if self._signature == loads.signature else cold

    def keep(self, loads: LinkLoads, extra: np.ndarray) -> None:
        self._signature, self._extra = loads.signature, extra


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
