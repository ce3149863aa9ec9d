"""Contention of one step's transfers on the fabric's links (analytic mode, M21).

``LinkLoads`` holds the bytes every collective stage of a step puts on each link, and
``LinkLoads.delays`` turns the stages' windows into the time each is held back by the
others it shares a link with - the max-min share the link gives it there. The analytic
executor (``sim.step.schedule.run_analytic``) iterates schedule and delays to a fixed point.
"""

from __future__ import annotations

import numpy as np

from sim.network.analytic_timer import AnalyticTimer
from sim.step.phases import Phase

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
