"""Flow mode without a process per GPU stream: readiness of whole groups of ranks at once,
events only where the network decides.

``sim.step.schedule.run_flows`` walks every phase on every rank in a simpy process; at 64
GPUs that is over a million generator steps per step, and it cannot reach 512 GPUs.
Here the only events are the network's (flow starts and finishes, with max-min sharing
as before) and the start of each collective; everything else is max-plus arithmetic
on numpy arrays, done as soon as its inputs are known:

- A phase's inputs on a rank are its ``deps`` and the previous phase of its stream.
  When they are known for a set of ranks, the phase's end on those ranks is known at
  once for a compute or wait phase (``+ seconds``), a page copy (alone on the rank's own
  PCIe links: the copy stream runs one copy at a time and no fabric route crosses a
  PCIe link, so max-min gives each direction its link's whole capacity), or an ops
  phase the rank is no member of (it passes at once). These ends may lie in the
  future of the network's clock; that is fine, since a time is only ever derived from
  times known before it.
- A rank that reaches an ops phase it is a member of *arrives* at its collectives. When
  the last member arrives, the op's start is the latest arrival; the op then runs its
  stages on the network (fixed latency per stage, then the stage's flows together,
  ``path_latency=False``), and when it ends its members' end of the phase may become
  known, and the propagation goes on from there.
- Runs of ops phases that follow one another, each waiting only for the one before it
  (and for inputs waited for already), are crossed in one step: the expert and dense
  sync chains are thousands of phases of one op with a few members each, and a rank
  done with one jumps straight to the next it is a member of (``_jump``), found by a
  binary search in the sorted (rank, phase) membership table.

Collectives start at the same instants as in the process-per-stream executor, and the
network is the same ``sim.network.network.Network``: with exact events (``coalesce=0``) the
times agree with ``sim.step.schedule.run_flows`` to float rounding, and with coalescing
within its bound (the order of simultaneous events may differ, and with it which
finishes share an event). Once every op has ended, one vectorised max-plus pass over
the phases, with the simulated op ends, writes the start and end of every phase on
every rank. What remains is the network's work: on paper-1440 (1,440 GPUs) a step
takes about 80 s of wall time, almost all of it in max-min solves of the all-to-all
phases (``benchmarks/sim_speed.py``).

CPU profiles whose ranks share cores (``cores``, ``sim.hardware.cores.CorePool``) keep the
process-per-stream executor: core sharing couples every compute phase to the others,
and those worlds are small.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from sim.hardware.cores import CorePool
from sim.network.collective_model import CollectiveModel
from sim.step import schedule
from sim.step.phases import Phase
from sim.step.schedule import STREAMS, Timeline, copy_seconds, fitted_seconds
from testbed.core.errors import RunError


def run_flows(phases: list[Phase], world: int, model: CollectiveModel, t0: float,
              copy_latency_s: float, cores: CorePool | None = None) -> Timeline:
    """Start and end (seconds) of every phase on every rank, collectives and page copies as
    flows on ``model.network`` (flow mode), from ``model.env.now`` (= ``t0``) on; the
    environment's clock is left at the step's last end. ``copy_latency_s``: seconds per
    page copied. ``cores``: CPU cores shared by the ranks (then the process-per-stream
    executor of ``sim.step.schedule`` runs the step; module doc)."""
    if cores is not None:
        return schedule.run_flows(phases, world, model, t0, copy_latency_s, cores)
    return FlowExecutor(phases, world, model, copy_latency_s).run(t0)


class FlowExecutor:
    """One step's phases on the flow network (module doc). Arrays are [phases, ranks]."""

    def __init__(self, phases: list[Phase], world: int, model: CollectiveModel, copy_latency_s: float):
        self.phases, self.W, self.model = phases, world, model
        self.env, self.net = model.env, model.network
        self.copy_latency_s = copy_latency_s
        P = self.P = len(phases)
        self._structure()
        self._membership()
        self.end = np.zeros((P, world))  # seconds; valid where known
        self.known = np.zeros((P, world), dtype=bool)  # end known
        self.begun = np.zeros((P, world), dtype=bool)  # ready time taken (phases of several inputs)
        self._stack: list[tuple[int, np.ndarray]] = []  # (phase, ranks) whose end just became known
        self._copy_s: dict[int, np.ndarray] = {}
        self.log: list = []
        self._ops_done = 0
        self._finished = self.env.event()

    # ---- static structure ----------------------------------------------------------------
    def _structure(self) -> None:
        """Inputs and successors of each phase; which phases a non-member crosses in a jump."""
        P = self.P
        last = {s: -1 for s in STREAMS}
        self.inputs: list[np.ndarray] = []
        self.succ: list[list[int]] = [[] for _ in range(P)]
        for q, ph in enumerate(self.phases):
            inp = sorted({d for d in ph.deps if d >= 0} | ({last[ph.stream]} if last[ph.stream] >= 0 else set()))
            last[ph.stream] = q
            self.inputs.append(np.array(inp, dtype=np.int64))
            for d in inp:
                self.succ[d].append(q)
        kinds = [ph.kind for ph in self.phases]
        # simple[q]: q and q+1 are ops phases, q's only successor is q+1 and q+1's inputs
        # are q and inputs of q (the sync stream's batches all wait for the same backward
        # phase): a rank done at q is ready at q+1 at the same time, and when it is no
        # member of q+1, done there at once too
        self.simple = np.zeros(P + 1, dtype=bool)
        for q in range(P - 1):
            inp = set(self.inputs[q + 1].tolist())
            self.simple[q] = (kinds[q] == "ops" and kinds[q + 1] == "ops" and self.succ[q] == [q + 1]
                              and q in inp and inp - {q} <= set(self.inputs[q].tolist()))
        # a phase inside a run is reached only from the phase before it (by a jump): its
        # other inputs were known before that one ended, so they need not propagate to it
        for q in np.flatnonzero(self.simple[:P]).tolist():
            for d in self.inputs[q + 1].tolist():
                if d != q:
                    self.succ[d].remove(q + 1)
        # run_end[q]: the first phase >= q that is not simple (where a jump from q stops)
        self.run_end = np.empty(P + 1, dtype=np.int64)
        self.run_end[P] = P
        for q in range(P - 1, -1, -1):
            self.run_end[q] = self.run_end[q + 1] if self.simple[q] else q

    def _membership(self) -> None:
        """Ops and the (rank, phase) table of their members, sorted by key rank * P + phase."""
        P = self.P
        self.ops, phase_of = [], []
        for q, ph in enumerate(self.phases):
            if ph.kind == "ops":
                for op in ph.ops:
                    self.ops.append(op)
                    phase_of.append(q)
        n = len(self.ops)
        self.op_phase = np.array(phase_of, dtype=np.int64)
        self.op_members = [np.asarray(op.members, dtype=np.int64) for op in self.ops]
        self.op_size = np.array([len(m) for m in self.op_members], dtype=np.int64)
        self.op_arrived = np.zeros(n, dtype=np.int64)
        self.op_ready = np.full(n, -np.inf)  # latest arrival so far, s
        self.op_began = np.zeros(n)  # s
        self.op_end = np.zeros(n)  # s
        ranks = np.concatenate(self.op_members) if n else np.zeros(0, dtype=np.int64)
        key = ranks * P + np.repeat(self.op_phase, self.op_size)
        order = np.argsort(key, kind="stable")
        self.entry_op = np.repeat(np.arange(n), self.op_size)[order]  # op of each sorted entry
        # slots: distinct (rank, phase) pairs; slot_left = ops of that rank in that phase not done
        uniq, first, inverse, counts = np.unique(key[order], return_index=True, return_inverse=True,
                                                 return_counts=True)
        self.slot_key = np.append(uniq, np.iinfo(np.int64).max)  # sentinel: past every rank
        self.slot_first = first  # first sorted entry of each slot
        self.slot_count = counts
        self.slot_left = counts.copy()
        self.one_op_per_slot = bool((counts == 1).all())
        slot_of_entry = np.empty(len(key), dtype=np.int64)
        slot_of_entry[order] = inverse
        bounds = np.concatenate([[0], np.cumsum(self.op_size)])
        self.op_slots = [slot_of_entry[bounds[k]:bounds[k + 1]] for k in range(n)]

    def _slots(self, ranks: np.ndarray, phase) -> np.ndarray:
        """Slot of each (rank, phase), -1 where the rank is no member of an op of the phase."""
        key = ranks * self.P + phase
        lo = np.searchsorted(self.slot_key, key)
        return np.where(self.slot_key[lo] == key, lo, -1)

    def _next_member(self, ranks: np.ndarray, after: int) -> np.ndarray:
        """First phase > ``after`` each rank is a member of an op in (P where none)."""
        lo = np.searchsorted(self.slot_key, ranks * self.P + after + 1)
        nxt = self.slot_key[lo] - ranks * self.P
        return np.where(nxt < self.P, nxt, self.P)

    # ---- running -------------------------------------------------------------------------------
    def run(self, t0: float) -> Timeline:
        env = self.env
        start_s = float(env.now)
        for q in range(self.P):  # phases without inputs start at once on every rank
            if len(self.inputs[q]) == 0:
                self._ready(q, np.arange(self.W), np.full(self.W, start_s))
        self._drain()
        if self._ops_done < len(self.ops):
            try:
                env.run(until=self._finished)
            except RuntimeError as e:
                if isinstance(e, RunError) or env.peek() != float("inf"):
                    raise
                # the event queue ran dry: some op never got all its members
                missing = int((self.op_arrived < self.op_size).sum())
                raise RuntimeError(f"{missing} collectives never started: ranks disagree on the ops") from e
        start, end = self._timeline(start_s)
        last = float(end.max()) if end.size else start_s
        if last > env.now:  # compute after the last network event: the step ends there
            env.run(until=last)
        fitted = (np.stack([fitted_seconds(ph, self.model, self.W) for ph in self.phases])
                  if self.phases else np.zeros((0, self.W)))
        return Timeline(start, end, self.log, t0, fitted)

    def _drain(self) -> None:
        """Propagate every end that became known, until nothing more follows."""
        stack = self._stack
        while stack:
            q, ranks = stack.pop()
            if self.simple[q]:
                self._jump(q, ranks)
                continue
            for s in self.succ[q]:
                inp = self.inputs[s]
                if len(inp) == 1:
                    self._ready(s, ranks, self.end[q, ranks])
                    continue
                r = ranks[~self.begun[s, ranks]]
                r = r[self.known[np.ix_(inp, r)].all(axis=0)]
                if len(r):
                    self.begun[s, r] = True
                    self._ready(s, r, self.end[np.ix_(inp, r)].max(axis=0))

    def _done(self, q: int, ranks: np.ndarray) -> None:
        if len(ranks):
            self.known[q, ranks] = True
            self._stack.append((q, ranks))

    def _jump(self, q: int, ranks: np.ndarray) -> None:
        """Ranks done at a simple phase ``q`` cross the run of ops phases after it (each
        waiting only for the one before it and for inputs waited for already) up to the
        next one they are a member of (there they arrive, at the time they were done at
        ``q``) or to the run's end (there they are done, and propagation goes on as
        usual). The phases crossed get their times in the final pass (``_timeline``)."""
        t = self.end[q, ranks]
        stop = self.run_end[q]
        nxt = self._next_member(ranks, q)
        arrive = nxt <= stop
        if arrive.any():
            r, m = ranks[arrive], nxt[arrive]
            self.end[m, r] = t[arrive]
            self._arrive(self._slots(r, m), t[arrive])
        rest = ~arrive
        if rest.any():
            r = ranks[rest]
            self.end[stop, r] = t[rest]
            self._done(stop, r)

    def _ready(self, q: int, ranks: np.ndarray, t: np.ndarray) -> None:
        """``ranks`` may start phase ``q`` at times ``t`` (s)."""
        if not len(ranks):
            return
        ph = self.phases[q]
        if ph.kind in ("compute", "wait"):
            self.end[q, ranks] = t + ph.seconds[ranks]
            self._done(q, ranks)
        elif ph.kind == "copy":
            self.end[q, ranks] = t + self._copy(q)[ranks]
            self._done(q, ranks)
        else:
            slots = self._slots(ranks, q)
            member = slots >= 0
            self.end[q, ranks] = t  # members: raised to their ops' ends as those end
            if not member.all():
                self._done(q, ranks[~member])
            if member.any():
                self._arrive(slots[member], t[member])

    def _arrive(self, slots: np.ndarray, t: np.ndarray) -> None:
        """Members (one slot = one rank in one phase) arrive at their ops at times ``t``."""
        if self.one_op_per_slot:
            ops, times = self.entry_op[self.slot_first[slots]], t
        else:
            count = self.slot_count[slots]
            entries = np.repeat(self.slot_first[slots] - np.cumsum(count) + count, count) + np.arange(count.sum())
            ops, times = self.entry_op[entries], np.repeat(t, count)
        np.add.at(self.op_arrived, ops, 1)
        np.maximum.at(self.op_ready, ops, times)
        cand = np.unique(ops)
        # an event even when it starts now: op ends then only come from event callbacks,
        # never from inside a propagation
        for k in cand[self.op_arrived[cand] == self.op_size[cand]].tolist():
            delay = max(self.op_ready[k] - self.env.now, 0.0)
            self.env.timeout(delay).callbacks.append(partial(self._begin, k))

    # ---- collectives on the network ----------------------------------------------------
    def _begin(self, k: int, _event) -> None:
        """The last member of op ``k`` arrived: its stages run one after the other."""
        self.op_began[k] = self.env.now
        self._stage(k, self.model.stages(self.ops[k]), 0)

    def _stage(self, k: int, stages: list, i: int, _event=None) -> None:
        if i == len(stages):
            self._end(k)
            return
        flows = [self.model.atom_flows(a) for a in stages[i]]
        latency = max((f.fixed_latency_s for f in flows), default=0.0)
        if latency > 0:
            self.env.timeout(latency).callbacks.append(partial(self._launch, k, stages, i, flows))
        else:
            self._launch(k, stages, i, flows)

    def _launch(self, k: int, stages: list, i: int, flows: list, _event=None) -> None:
        """The stage's flows start together; the next stage when they have all arrived."""
        tag = self.ops[k].stage
        # route kind and PXN relays when the collective model gives them (optional fields)
        events = [self.net.start_flows(f.src, f.dst, f.nbytes, tag=tag, kind=getattr(f, "kind", "fabric"),
                                       path_latency=False, messages=f.messages,
                                       nic_of_src=getattr(f, "nic_of_src", None)) for f in flows]
        if not events:
            self._stage(k, stages, i + 1)
            return
        left = [len(events)]

        def arrived(_event):
            left[0] -= 1
            if left[0] == 0:
                self._stage(k, stages, i + 1)

        for ev in events:
            ev.callbacks.append(arrived)

    def _end(self, k: int) -> None:
        now = self.op_end[k] = self.env.now
        self.log.append((self.ops[k], float(self.op_began[k]), now))
        q, members, slots = self.op_phase[k], self.op_members[k], self.op_slots[k]
        self.end[q, members] = np.maximum(self.end[q, members], now)
        self.slot_left[slots] -= 1
        self._done(q, members[self.slot_left[slots] == 0])
        self._drain()
        self._ops_done += 1
        if self._ops_done == len(self.ops):
            self._finished.succeed()

    # ---- page copies -------------------------------------------------------------------------
    def _copy(self, q: int) -> np.ndarray:
        """[W] seconds of copy phase ``q`` per rank, its bytes counted on the PCIe links."""
        if q in self._copy_s:
            return self._copy_s[q]
        ph, fabric, net, W = self.phases[q], self.net.fabric, self.net, self.W
        on = ph.pages > 0
        moved = 0.0
        bw = {}
        for kind, nbytes in (("h2d", ph.h2d), ("d2h", ph.d2h)):
            edges = fabric.offset[kind] + np.arange(W)  # each rank's own PCIe link
            bw[kind] = cap = fabric.capacity[edges]
            use = on & (nbytes > 0)
            if (use & (cap <= 0)).any():
                e = int(edges[use & (cap <= 0)][0])
                raise RunError(f"link {fabric.edge_name(e)} is down and the fabric has no alternative route "
                               "(sim.hardware.fabric routes are fixed)")
            sent = np.where(use, nbytes, 0.0)
            net.bytes_by_edge[edges] += sent
            net.busy_by_edge[edges] += np.divide(sent, cap, out=np.zeros(W), where=use)
            moved += float(sent.sum())
        if moved > 0:
            net.bytes_by_tag["paging"] = net.bytes_by_tag.get("paging", 0.0) + moved
        out = np.where(on, copy_seconds(ph, bw["h2d"], bw["d2h"], self.copy_latency_s), 0.0)
        self._copy_s[q] = out
        return out

    # ---- the timeline ----------------------------------------------------------------------
    def _timeline(self, start_s: float) -> tuple[np.ndarray, np.ndarray]:
        """Start and end of every phase on every rank: the max-plus pass of ``run_analytic``
        with the simulated op ends (exactly the times the propagation used)."""
        P, W = self.P, self.W
        start, end = np.empty((P, W)), self.end
        clock = {s: np.full(W, start_s) for s in STREAMS}
        first = np.searchsorted(self.op_phase, np.arange(P))  # ops of phase q: first[q]..first[q+1]
        first = np.append(first, len(self.ops))
        for q, ph in enumerate(self.phases):
            ready = clock[ph.stream].copy()
            for d in ph.deps:
                if d >= 0:
                    np.maximum(ready, end[d], out=ready)
            if ph.kind in ("compute", "wait"):
                done = ready + ph.seconds
            elif ph.kind == "copy":
                done = ready + self._copy(q)
            else:
                done = ready.copy()
                for k in range(first[q], first[q + 1]):
                    m = self.op_members[k]
                    done[m] = np.maximum(done[m], self.op_end[k])
            start[q], end[q] = ready, done
            clock[ph.stream] = done
        return start, end
