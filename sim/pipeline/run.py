"""Pipeline parallelism and micro-batches in the simulator (issue 13:
``parallelism.pp_size`` p, ``parallelism.pp_chunks`` v, ``transformer.micro_batches`` m).

The cluster's GPUs form p stages of consecutive micro-clusters (or nodes); stage k holds
MoE layers k L/p .. (k+1) L/p - 1 with their blocks, laid out inside its GPUs as the
scenario lays out the whole cluster without pipelining (EP groups, replicas, TP). A step
runs m micro-batches of ``tokens_per_rank / m`` tokens through the stages:

1. One stage is simulated as a scenario of its own (``testbed.policy.pipeline_stages``): its
   GPUs, its layers, one micro-batch - the phases, network and compute of every other run. Its
   timeline gives one micro-batch's forward and backward seconds on the stage's slowest
   GPU, and the tail after the backward (what the gradient sync leaves exposed, the
   optimizer). Every stage is taken to be that one, except that only the last computes
   the output head and the loss and the MTP modules (the MoE layers after the stage's
   own, ``testbed.policy.mtp_layers``: their forward and backward spans on the
   simulated stage's slowest GPU, ``mtp_seconds``; theirs and the head's seconds come off
   the others), only the first the dense-first layers (``transformer.first_dense_layers``;
   theirs come off the others), and each of its v chunks takes 1/v of it.
2. A micro-batch's activations (and, backward, their gradients: tokens x hidden in
   ``model.dtype`` per GPU) cross each stage boundary as point-to-point sends from every
   GPU to its peer in the next stage, all at once, timed on the whole cluster's network
   model (``boundary_send_seconds``).
3. The step's schedule is ``sim.pipeline.schedule``'s 1F1B (or interleaved) max-plus
   timing of those seconds: the bubble comes out of it, not from the closed form. The
   step takes its makespan plus the tail.

What it changes in a step's record: the step time; stage times and bytes of the
micro-batch stages (route to dense_backward) times m (the gradient sync, optimizer and
heat run once per step), bytes times p (every stage moves its own); the share of the
step from fitted constants, of the whole step (``whole_step_fitted_share``); the memory peak
holds as many micro-batches' activations as the schedule keeps in flight on stage 0
(``in_flight / v`` of the stage's). Left out: differences between stages other than
the head, MTP and dense-first layers' seconds (the embedding's weights are counted on every stage, and the
dense-first layers' and the MTP modules' layers' weights and activations, their logits aside, on stage 0,
whose memory is reported), stages' traffic sharing
links with each other, and the sends' own bytes in the byte counts (they are in
``extra["pipeline"]``). The network counters (wire bytes, link utilisation, hottest
links) saw one stage's micro-batch, so a pipelined run reports none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.hardware.fabric import build_fabric
from sim.network.analytic_timer import AnalyticTimer
from sim.network.collective_model import CollectiveModel
from sim.network.network import Network
from sim.pipeline.schedule import run_pipeline
from sim.step.phases import Phase
from sim.step.schedule import run_analytic
from sim.step.step_report import fitted_by_rank
from testbed.policy.collectives import ByteLedger, CollectiveOp, reduce_scatter_runs_as_all_reduce
from testbed.policy.mtp_layers import mtp_modules
from testbed.run.results import StepRecord
from testbed.scenario.scenario import Scenario

#: stages a micro-batch runs through (the rest run once per step)
MICRO_BATCH_STAGES = ("dense", "route", "dispatch", "experts", "combine", "combine_backward", "experts_backward",
                      "dispatch_backward", "route_backward", "dense_backward")
BACKWARD_STAGES = ("combine_backward", "experts_backward", "dispatch_backward", "route_backward", "dense_backward")


def boundary_send_seconds(s: Scenario, profile) -> tuple[np.ndarray, float]:
    """([p] seconds, bytes per GPU) of one micro-batch's activations crossing each stage
    boundary k -> k+1 (the last: to stage 0, the interleaved schedule's next chunk):
    every GPU of stage k sends to the GPU at the same place in stage k+1, all at once,
    on the whole cluster's analytic network model."""
    p, world = s.parallelism.pp_size, s.world_size
    per_stage = world // p
    nbytes = s.workload.tokens_per_rank // s.transformer.micro_batches * s.model.hidden_size * s.model.dtype_bytes
    if p == 1:
        return np.zeros(1), float(nbytes)
    network = Network(None, build_fabric(s, profile), "analytic")
    timer = AnalyticTimer(CollectiveModel(network, profile, world))
    seconds = np.zeros(p)
    for k in range(p):
        ops = [CollectiveOp("p2p", (k * per_stage + r, (k + 1) % p * per_stage + r), "dense", -1, size=nbytes,
                            label=f"pipeline send {k}") for r in range(per_stage)]
        tl = run_analytic([Phase("dense", -1, "ops", "comm", (), ops=ops)], world, timer, 0.0, 0.0)
        seconds[k] = float(tl.end.max())
    return seconds, float(nbytes)


@dataclass
class MicroBatchTimes:
    """One micro-batch on the simulated stage, its slowest GPU (seconds)."""

    forward_s: float
    backward_s: float
    tail_s: float  # after the backward: exposed gradient sync, optimizer, heat, paging


def whole_step_fitted_share(phases: list[Phase], tl, micro_batches: int, step_time_s: float) -> float:
    """Share of the pipelined step of ``step_time_s`` seconds that comes from fitted
    constants, on the GPU with the most: its fitted seconds in the micro-batch stages
    times ``micro_batches`` (each GPU runs every micro-batch of its stage, its chunks 1/v
    of the stage each), plus those of the phases run once per step
    (``sim.step.step_report.fitted_by_rank`` of the simulated stage's micro-batch step). The
    boundary sends' library latency is left out: the sends are asynchronous, in no GPU's
    busy time."""
    if step_time_s <= 0 or not phases:
        return 0.0
    busy = tl.end - tl.start
    per_mb = np.array([ph.stage in MICRO_BATCH_STAGES for ph in phases])
    fitted = micro_batches * fitted_by_rank(tl, busy, per_mb) + fitted_by_rank(tl, busy, ~per_mb)
    return float(fitted.max() / step_time_s)


def mtp_seconds(phases: list[Phase], tl, main_layers: int, head_phases: range) -> tuple[float, float]:
    """(forward, backward) seconds of the MTP modules' layers on the simulated stage: on
    each GPU the span of the micro-batch phases of its MoE layers past ``main_layers``
    (the output head's, ``head_phases``, aside), forward and backward, the most of any
    GPU; (0, 0) without them."""
    out = []
    for stages in (set(MICRO_BATCH_STAGES) - set(BACKWARD_STAGES), set(BACKWARD_STAGES)):
        mine = [i for i, ph in enumerate(phases) if ph.layer >= main_layers and ph.stage in stages
                and i not in head_phases]
        out.append(float((tl.end[mine].max(axis=0) - tl.start[mine].min(axis=0)).max()) if mine else 0.0)
    return out[0], out[1]


def micro_batch_times(phases: list[Phase], tl, step_time_s: float) -> MicroBatchTimes:
    """Split the stage's simulated step at the first backward phase and the last one."""
    back = [i for i, ph in enumerate(phases) if ph.stage in BACKWARD_STAGES]
    forward_end = float(tl.end[:back[0]].max()) - tl.t0
    backward_end = float(tl.end[back].max()) - tl.t0
    return MicroBatchTimes(forward_end, backward_end - forward_end, max(step_time_s - backward_end, 0.0))


class PipelinedStep:
    """Turns the simulated stage's step into the pipelined step of the whole scenario."""

    def __init__(self, scenario: Scenario, profile, builder):
        """``builder``: the simulated stage's ``PhaseBuilder`` (its ``DenseLayers``: the output
        head's seconds and logits; the head's phases of the step it built)."""
        self.s = scenario
        self.send_s, self.send_bytes = boundary_send_seconds(scenario, profile)
        self.builder = builder
        head = builder.dense
        self.head = (head.head_forward_s, head.head_backward_s)
        self.first_dense = head.first_dense_s  # (forward, backward) seconds of the dense-first layers
        self.logits_bytes = head.head_activation_bytes
        self.rs_as_ar = reduce_scatter_runs_as_all_reduce(profile)  # gloo: testbed.policy.collectives

    def schedule(self, times: MicroBatchTimes, mtp: tuple[float, float] = (0.0, 0.0)):
        """The step's pipeline schedule from one micro-batch's stage times; ``mtp``: the MTP
        modules' layers' (forward, backward) seconds in them (``mtp_seconds``)."""
        p, v, m = self.s.parallelism.pp_size, self.s.parallelism.pp_chunks, self.s.transformer.micro_batches
        fwd = np.full((p, v), times.forward_s)
        bwd = np.full((p, v), times.backward_s)
        fwd[:-1] -= self.head[0]  # only the last stage computes the output head and the loss
        bwd[:-1] -= self.head[1]
        if mtp_modules(self.s):  # and the MTP modules
            fwd[:-1] -= mtp[0]
            bwd[:-1] -= mtp[1]
        if self.first_dense[0]:  # only the first the dense-first layers
            fwd[1:] -= self.first_dense[0]
            bwd[1:] -= self.first_dense[1]
        return run_pipeline(np.maximum(fwd, 0.0) / v, np.maximum(bwd, 0.0) / v, self.send_s, m, v)

    def apply(self, record: StepRecord, breakdown: dict, phases: list[Phase], tl, layout) -> tuple[StepRecord, dict]:
        """``record`` and its memory ``breakdown`` (the stage's micro-batch step, its fullest
        GPU) as the pipelined step's. What runs once per step, not per micro-batch, is
        every phase outside ``MICRO_BATCH_STAGES`` (gradient sync, optimizer, heat, paging),
        for the stage times and both byte counts alike."""
        s = self.s
        p, v, m = s.parallelism.pp_size, s.parallelism.pp_chunks, s.transformer.micro_batches
        times = micro_batch_times(phases, tl, record.step_time_s)
        b = self.builder
        sched = self.schedule(times, mtp_seconds(phases, tl, b.dense.s.model.num_layers, b.head_phases)
                              if mtp_modules(self.s) else (0.0, 0.0))
        record.step_time_s = sched.makespan_s + times.tail_s
        record.fitted_share = whole_step_fitted_share(phases, tl, m, record.step_time_s)
        record.stage_time_s = {st: t * (m if st in MICRO_BATCH_STAGES else 1) for st, t in record.stage_time_s.items()}
        record.bytes_by_stage = {st: b * (m if st in MICRO_BATCH_STAGES else 1) * p
                                 for st, b in record.bytes_by_stage.items()}
        once = ByteLedger(layout, None, self.rs_as_ar)
        for ph in phases:
            if ph.kind == "ops" and ph.stage not in MICRO_BATCH_STAGES:
                for op in ph.ops:
                    once.add_op(op)
        once_levels = once.level_dict()
        record.bytes_by_level = {lvl: p * (once_levels.get(lvl, 0) + m * (b - once_levels.get(lvl, 0)))
                                 for lvl, b in record.bytes_by_level.items()}
        record.wire_bytes_by_level = None  # the stage's network counters saw one micro-batch
        # stage 0 keeps in_flight / v micro-batches' activations (its share of them: no logits, the last stage's)
        extra = max(float(sched.in_flight[0]) / v - 1.0, 0.0) * max(breakdown["activations"] - self.logits_bytes, 0.0)
        record.peak_memory_bytes = int(record.peak_memory_bytes + extra)
        record.extra["pipeline"] = {
            "stages": p, "chunks": v, "micro_batches": m, "makespan_s": float(sched.makespan_s), "tail_s": float(times.tail_s),
            "micro_batch_forward_s": float(times.forward_s), "micro_batch_backward_s": float(times.backward_s),
            "bubble_fraction": float(sched.bubble_fraction.max()), "send_s": [float(x) for x in self.send_s],
            "send_bytes_per_gpu": self.send_bytes * 2 * m * (p * v - 1) / p,
            "in_flight": [int(x) for x in sched.in_flight],
        }
        return record, dict(breakdown, activations=breakdown["activations"] + extra)
