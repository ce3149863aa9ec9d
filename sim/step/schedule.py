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
  (``sim.hardware.cores``).

Both return ``Timeline``: ``start[p, r]``, ``end[p, r]`` (seconds), ``fitted[p, r]`` (the
seconds of that phase that come from fitted constants: a host-cost phase whole, a
collective's calibrated software latency, ``Phase.fitted_s`` of other compute and wait
phases) and the collectives with their start and end
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

from sim.hardware.cores import CorePool
from sim.network.analytic_timer import AnalyticTimer
from sim.network.collective_model import CollectiveModel
from sim.network.deepep_forward import forward_floor_seconds as floor_seconds
from sim.step.link_loads import LinkLoads
from sim.step.phases import Phase

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
    phase, the ``fitted_s`` of other compute and wait phases (a fitted compute scale, the
    per-page host costs); for collectives, per rank the largest fitted latency among its
    concurrent ops."""
    if ph.kind in ("compute", "wait"):
        if ph.fitted:
            return ph.seconds
        return np.asarray(ph.fitted_s, dtype=np.float64) if ph.fitted_s is not None else np.zeros(world)
    out = np.zeros(world)
    if ph.kind == "ops" and model.software.fitted:
        for op in ph.ops:
            m = np.asarray(op.members)
            out[m] = np.maximum(out[m], model.fitted_seconds(op))
    return out


def copy_seconds(ph: Phase, h2d_bw: np.ndarray, d2h_bw: np.ndarray, latency_s: float) -> np.ndarray:
    """Per-rank seconds of a copy phase alone on its PCIe link: both directions at once,
    plus a fixed latency per page."""
    return pcie_seconds(ph.h2d, ph.d2h, ph.pages, h2d_bw, d2h_bw, latency_s)


def pcie_seconds(h2d, d2h, pages, h2d_bw, d2h_bw, latency_s: float) -> np.ndarray:
    """[W] seconds of copying ``h2d`` and ``d2h`` bytes [W] in ``pages`` pages [W] on each
    rank's PCIe links of ``h2d_bw`` and ``d2h_bw`` bytes/s: both directions at once, plus
    ``latency_s`` per page."""
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.where(h2d > 0, h2d / h2d_bw, 0.0)
        down = np.where(d2h > 0, d2h / d2h_bw, 0.0)
    return np.maximum(up, down) + pages * latency_s


def copy_timer(fabric, world: int, latency_s: float):
    """``(h2d, d2h, pages) -> [W] seconds`` of a copy alone on each rank's PCIe links at
    the fabric's capacities when called (after the step's faults), as every executor
    times a copy phase (``PhaseBuilder`` times the copies' unhidden share with it)."""
    ranks = np.arange(world)

    def seconds(h2d, d2h, pages):
        return pcie_seconds(h2d, d2h, pages, fabric.capacity[fabric.offset["h2d"] + ranks],
                            fabric.capacity[fabric.offset["d2h"] + ranks], latency_s)
    return seconds


MAX_PASSES = 8  # schedule passes of run_analytic's contention fixed point, at most
FIRST_STEP = 1.0  # share of the first pass's delays taken (LinkLoads.delays' form barely overshoots)
MIN_STEP = 0.05  # the smallest share of a pass's change of the delays that the next pass takes
PASS_RTOL = 0.005  # consistent: the delays move by less than this share of all transfer seconds


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
    # each op's least seconds whatever its links (DeepEP's forwarding kernels: sim.network.deepep_forward)
    floors = np.array([timer.floor_seconds(op) for ph in phases if ph.kind == "ops" for op in ph.ops])
    extra = np.zeros(len(loads.fixed))  # seconds each stage's transfer waits for others
    if warm is not None:
        extra = warm.start(loads, extra)
    step, last, best = FIRST_STEP, None, (np.inf, None)
    for _ in range(MAX_PASSES):
        tl, begin = _schedule(phases, world, t0, fixed_s, fitted, loads, extra, floors)
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


def _schedule(phases, world, t0, fixed_s, fitted, loads: LinkLoads, extra: np.ndarray, floors: np.ndarray):
    """One max-plus pass, every stage ``extra`` seconds slower than alone, each op at least
    its ``floors`` seconds: the Timeline, and [stages] the time each stage's bytes start to
    flow (seconds)."""
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
                e = s + max(op_s[o], floors[o])
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
    core (``sim.hardware.cores``) instead of running alone."""
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

            def run(op=op, began=began):
                yield model.run(op)
                rest = began + floor_seconds(op, model.profile.collectives) - env.now  # the kernels' floor
                if rest > 0:
                    yield env.timeout(rest)

            env.process(run()).callbacks.append(record)
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
