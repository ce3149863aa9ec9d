"""The simulator backend: the scenario's training steps on a simulated GPU cluster.

Routing comes from the synthetic workload (M4) or from a recorded trace
(``workload.trace``); the shared controller takes every decision; the engine times them.
"""

from __future__ import annotations

import time

import numpy as np

from sim.compute import ComputeModel
from sim.engine import Engine
from sim.programs import ProgramBuilder, StepDecisions
from testbed.backend import RunResult
from testbed.collectives import ByteLedger
from testbed.controller import Controller
from testbed.heat import STATE_NAMES
from testbed.page_moves import page_move_count
from testbed.profile import load_profile
from testbed.progress import Progress
from testbed.results import StepRecord
from testbed.routing_trace import RoutingTrace
from testbed.scenario import Scenario
from testbed.stages import STAGES
from testbed.topology import Layout
from testbed.workload import SyntheticWorkload

TRACE_RANKS = 64  # ranks written to the Chrome trace (all of them up to this many)


def decide_step(controller: Controller, step: int, routed: np.ndarray) -> StepDecisions:
    """Drive the controller through one step in the order the real backend does."""
    controller.begin_step(step)
    forward = [controller.forward_layer(layer, routed[layer]) for layer in range(controller.L)]
    backward = {layer: controller.backward_layer(layer) for layer in reversed(range(controller.L))}
    sync = controller.sync()
    return StepDecisions(forward, backward, sync, controller.end_step())


def routing_source(scenario: Scenario):
    """step -> routed counts [L, W, E], from the trace when one is given."""
    if scenario.workload.trace:
        trace = RoutingTrace.load(scenario.workload.trace)
        trace.check_fits(scenario, scenario.workload.trace)
        return lambda step: trace.routed[step]
    return SyntheticWorkload(scenario).routed_counts


class SimBackend:
    name = "sim"

    def run(self, scenario: Scenario, *, progress: bool = False, on_step=None) -> RunResult:
        wall0 = time.perf_counter()
        s = scenario
        profile = load_profile(s.cluster.profile)
        routed_at = routing_source(s)
        layout = Layout(s)
        controller = Controller(s, layout=layout)
        engine = Engine(s, profile)
        builder = ProgramBuilder(s, layout, ComputeModel(profile, s.model.dtype),
                                 profile.collectives.group_create_ms * 1e-3)
        bar = Progress(s.run.steps, f"sim x{s.world_size}", enabled=progress)
        records, trace, routing = [], [], []
        for step in range(s.run.steps):
            routed = np.asarray(routed_at(step))
            routing.append(routed)
            decisions = decide_step(controller, step, routed)
            start, timings = engine.run_step(builder.build(decisions))
            record = self._record(step, s, layout, controller, decisions, start, timings)
            records.append(record)
            trace += _trace_events(step, start, timings)
            if on_step:
                on_step(record)
            bar.update(note=f"simulated step {record.step_time_s * 1e3:.2f} ms")
        elapsed = engine.env.now
        extra = {
            "network_model": engine.mode,
            "profile": profile.name,
            "utilization_by_level": engine.network.utilization_by_level(elapsed),
            "hottest_links": engine.network.hottest_links(5, elapsed),
            "sim_events": engine.events,
            "wall_time_s": time.perf_counter() - wall0,
        }
        routing_trace = RoutingTrace(np.stack(routing), s.workload.tokens_per_rank, s.model.top_k)
        return RunResult(s, records, trace, routing_trace, extra)

    @staticmethod
    def _record(step, s, layout, controller, d: StepDecisions, start, timings) -> StepRecord:
        ledger = ByteLedger(layout)
        moves = []
        for f in d.forward:
            for op in f.route_ops + f.refresh_ops + f.dispatch_ops + f.combine_ops:
                ledger.add_op(op)
            moves += f.page_moves.values()
        for b in d.backward.values():
            for op in b.combine_backward_ops + b.dispatch_backward_ops:
                ledger.add_op(op)
            moves += b.page_moves.values()
        for op in d.sync.expert_sync_ops + d.sync.dense_sync_ops:
            ledger.add_op(op)
        moves += list(d.sync.page_moves.values()) + list(d.end.page_moves.values())
        pcie = sum(m.pcie_bytes for m in moves)
        if pcie:
            ledger.add_pcie("paging", pcie)
        n = len(timings)
        stall = [sum(t1 - t0 for st, kind, t0, t1 in t.regions if st == "paging" and kind == "copy") for t in timings]
        states = None
        if d.end.heat is not None:
            states = {name: int((d.end.heat.states == code).sum()) for code, name in enumerate(STATE_NAMES)}
        cache = d.sync.cache
        return StepRecord(
            step=step,
            step_time_s=max(t.end for t in timings) - start,
            stage_time_s={st: sum(t.totals.get(st, 0.0) for t in timings) / n for st in STAGES},
            bytes_by_stage={k: int(v) for k, v in ledger.by_stage.items()},
            bytes_by_level=ledger.level_dict(),
            peak_memory_bytes=_peak_memory(s, layout, controller, d),
            routed_slots=int(sum(f.routed.sum() for f in d.forward)),
            dropped_slots=int(sum(f.dropped_slots for f in d.forward)),
            page_moves=sum(page_move_count(m) for m in moves),
            page_bytes=int(pcie),
            page_stall_s=sum(stall) / n,
            cache_hits=cache.hits if cache else 0,
            cache_lookups=cache.lookups if cache else 0,
            expert_states=states,
        )


def _peak_memory(s: Scenario, layout: Layout, controller: Controller, d: StepDecisions) -> int:
    """Largest per-rank estimate of resident expert pages + activations + gradients (bytes).

    Activations per layer: the layer input (T x H), and per expert row the expert input
    (H), its pre-activation (F) and output (H), in the model dtype; all kept for the
    backward. Gradients: the updated experts' weights.
    """
    m = s.model
    t = s.workload.tokens_per_rank
    best = 0
    for r in range(layout.world):
        group = layout.rank_of[layout.group_of[r]]
        local = list(layout.local_experts(r))
        rows = sum(int(f.kept[group][:, local].sum()) for f in d.forward)
        act = (m.num_layers * t * m.hidden_size + rows * (2 * m.hidden_size + m.ffn_hidden_size)) * m.dtype_bytes
        pager = controller.pagers.get(r)
        resident = pager.peak_resident_bytes if pager else len(controller.local_instances(r)) * m.expert_bytes
        grads = len(d.sync.updated.get(r, ())) * m.expert_bytes
        best = max(best, resident + act + grads)
    return int(best)


def _trace_events(step: int, start: float, timings) -> list[dict]:
    streams = {"compute": "compute", "wait": "comm", "ops": "comm", "copy": "copy"}
    events = []
    for rank, t in enumerate(timings[:TRACE_RANKS]):
        for stage, kind, t0, t1 in t.regions:
            events.append({"name": stage, "ph": "X", "pid": rank, "tid": streams[kind],
                           "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6, "args": {"step": step}})
    return events
