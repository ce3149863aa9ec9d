"""Running a step's phases: start and end time of every phase on every rank.

Two executors give the same answer where both apply:

- ``run_analytic`` (fast mode): every rank's clock per stream is a numpy array and each
  phase advances them at once (a max-plus schedule): a phase starts when its stream and
  its dependencies are done; a collective starts when its last member arrives and lasts
  the analytic time of the network model (its most loaded link bounds it; concurrent
  collectives do not slow each other). One pass over the phases, no per-rank events:
  this is what makes thousands of GPUs cheap.
- ``run_flows`` (flow mode): a simpy process per (rank, stream) walks that stream's
  phases; collectives and page copies are flows on the max-min fair network, so
  concurrent traffic shares links, and on CPU backends compute shares the cores
  (``sim.cores``).

Both return ``Timeline``: ``start[p, r]``, ``end[p, r]`` (seconds), ``fitted[p, r]`` (the
seconds of that phase that come from fitted constants: a host-cost phase whole, a
collective's calibrated software latency) and the collectives with their start and end
(for link counters in the trace). A rank that is not a member of
any op of an ``ops`` phase passes it at once.
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


def run_analytic(phases: list[Phase], world: int, timer: AnalyticTimer, t0: float,
                 copy_latency_s: float) -> Timeline:
    fabric = timer.fabric
    h2d_bw = fabric.capacity[fabric.offset["h2d"] + np.arange(world)]
    d2h_bw = fabric.capacity[fabric.offset["d2h"] + np.arange(world)]
    clock = {s: np.full(world, t0) for s in STREAMS}
    start = np.empty((len(phases), world))
    end = np.empty((len(phases), world))
    fitted = np.empty((len(phases), world))
    members: dict[tuple, np.ndarray] = {}
    log = []
    for p, ph in enumerate(phases):
        ready = clock[ph.stream].copy()
        for d in ph.deps:
            np.maximum(ready, end[d], out=ready)
        if ph.kind in ("compute", "wait"):
            done = ready + ph.seconds
        elif ph.kind == "copy":
            done = ready + copy_seconds(ph, h2d_bw, d2h_bw, copy_latency_s)
            for kind, nbytes, bw in (("h2d", ph.h2d, h2d_bw), ("d2h", ph.d2h, d2h_bw)):
                edges = fabric.offset[kind] + np.arange(world)  # each rank's PCIe link
                timer.stats.bytes_by_edge[edges] += nbytes
                timer.stats.busy_by_edge[edges] += np.divide(nbytes, bw, out=np.zeros(world), where=bw > 0)
        else:
            done = ready.copy()
            for op in ph.ops:
                m = members.get(op.members)
                if m is None:
                    m = members[op.members] = np.asarray(op.members)
                s = ready[m].max()
                e = s + timer.seconds(op)
                done[m] = np.maximum(done[m], e)
                log.append((op, s, e))
        start[p], end[p] = ready, done
        fitted[p] = fitted_seconds(ph, timer.model, world)
        clock[ph.stream] = done
    return Timeline(start, end, log, t0, fitted)


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
