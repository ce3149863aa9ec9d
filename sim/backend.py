"""The simulator backend: the scenario's training steps on a simulated GPU cluster.

Per step: faults due at this step change the fabric or cost a restart; routing comes
from the synthetic workload (M4) or a recorded trace (``workload.trace``: a pipelined
real run's holds each micro-batch's, which each pipeline rank replays, ``trace_routing``); the shared
controller takes every decision over the MoE layers it plans (the model's and, with
multi-token prediction, one per MTP module: ``testbed.model.mtp_layers``);
``PhaseBuilder`` turns them into timed work on each GPU's streams; an executor times the
phases (``sim.network_model``: ``flow`` = every flow on the max-min fair network, the
ranks' phases advanced in numpy between the network's events (``sim.step.flow_executor``),
``analytic`` = the vectorised bottleneck schedule, ``auto`` = flow up to
``sim.flow_max_gpus`` GPUs); ``step_report`` says what it means.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import simpy

from sim.hardware.compute import ComputeModel
from sim.hardware.cores import CorePool
from sim.hardware.fabric import build_fabric
from sim.hardware.model_support import check_model_support
from sim.hardware.software_latency import compute_scale_fitted, stage_host_seconds
from sim.network.analytic_timer import AnalyticTimer
from sim.network.collective_model import CollectiveModel
from sim.network.faults import Faults
from sim.network.network import Network
from sim.pipeline.run import PipelinedStep
from sim.pipeline.stage_work import SimulatedStage
from sim.step.flow_executor import run_flows
from sim.step.memory_breakdown import memory_breakdown
from sim.step.phase_builder import PhaseBuilder
from sim.step.phases import StepDecisions
from sim.step.probe import ModelledProbe
from sim.step.representative_slice import (
    SliceTimer,
    SyncBytes,
    scale_record,
    slice_refusal,
    slice_scenario,
    spine_share,
    use_whole_shards,
)
from sim.step.schedule import WarmStart, copy_timer, run_analytic
from sim.step.step_report import figures, trace_events
from testbed.core.errors import ScenarioError
from testbed.core.progress import Progress
from testbed.model.mtp_layers import controller_scenario
from testbed.policy.collectives import ByteLedger, reduce_scatter_runs_as_all_reduce
from testbed.policy.combined_1f1b import check_combined_1f1b
from testbed.policy.controller import Controller
from testbed.policy.distributed_optimizer import check_distributed_optimizer
from testbed.policy.expert_tensor_parallel import check_expert_tensor_parallel
from testbed.policy.page_moves import add_reason_counts, page_move_count
from testbed.policy.pipeline_stages import PipelineStages, RankStages, check_pipeline, pipelined, rank_scenario
from testbed.policy.step_decisions import LayerBackward, LayerForward
from testbed.policy.workload import SyntheticWorkload
from testbed.run.backend import RunResult
from testbed.run.guards import network_mode
from testbed.run.results import StepRecord, frozen_fraction
from testbed.run.routing_trace import RoutingTrace
from testbed.scenario.profile import MachineProfile, load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import LEVELS, Layout

TRACE_RANKS = 16  # GPUs shown in the Chrome trace


@dataclass
class MicroBatchDecisions:
    """A later micro-batch's layers (1 .. m-1) of a step replayed micro-batch by micro-batch
    (``decide_step``): what the controller decided of its forwards and backwards, whose bytes
    and page moves the step's record counts (``_record``); the phases time micro-batch 0's."""

    forward: list[LayerForward]
    backward: dict[int, LayerBackward]


def decide_step(controller: Controller, step: int, routed: np.ndarray, free_memory=None,
                probe: ModelledProbe | None = None, fanout: np.ndarray | None = None,
                later: list[MicroBatchDecisions] | None = None) -> StepDecisions:
    """Drive the controller through one step in the order the real backend does.
    ``fanout`` [L, W, P + A] (deepep, a replayed real run's): what each layer's route
    stage shared, told to the planner before the layer (None: modelled from the counts).
    ``routed`` [L, W, E], or [m, L, W, E]: a replayed pipeline rank's m micro-batches
    (``trace_routing``), each decided as a real pipeline rank decides it
    (``Controller.forward_layer``'s ``micro_batch``: every forward, then every backward -
    with paging refused under pipelines no decision depends on their interleaving); the
    answer is micro-batch 0's, the others' are appended to ``later``."""
    routed = np.asarray(routed)
    micro = routed if routed.ndim == 4 else routed[None]
    controller.begin_step(step, free_memory)
    controller.set_heat_io(None, probe)
    forwards = []
    for i, counts in enumerate(micro):
        forwards.append([])
        for layer in range(controller.L):
            if fanout is not None:
                controller.planner.tell_fanout(layer, fanout[layer])
            forwards[-1].append(controller.forward_layer(layer, counts[layer], micro_batch=i))
    backwards = [{layer: controller.backward_layer(layer, micro_batch=i) for layer in reversed(range(controller.L))}
                 for i in range(len(micro))]
    forward, backward = forwards[0], backwards[0]
    if later is not None:
        later += [MicroBatchDecisions(f, b) for f, b in zip(forwards[1:], backwards[1:])]
    sync = controller.sync()
    end = controller.end_step()
    return StepDecisions(forward, backward, sync, end, probe_s=probe.take() if probe is not None else None)


def routing_source(scenario: Scenario):
    """step -> routed counts [L, W, E] of the controller's scenario ``scenario``'s L MoE
    layers (``controller_scenario``), from the trace when one is given."""
    if scenario.workload.trace:
        trace = RoutingTrace.load(scenario.workload.trace)
        trace.check_fits(scenario, scenario.workload.trace)
        return lambda step: trace.routed[step]
    return SyntheticWorkload(scenario).routed_counts


def pipeline_trace(whole: Scenario) -> RoutingTrace:
    """A pipelined scenario ``whole``'s trace (``workload.trace``, a pipelined real run's:
    testbed.run.routing_trace), read and checked: a ScenarioError where it does not fit (a
    stage's GPUs, the whole model's layers, each micro-batch's counts with m > 1)."""
    trace = RoutingTrace.load(whole.workload.trace)
    trace.check_fits(controller_scenario(whole), whole.workload.trace)
    return trace


def trace_routing(whole: Scenario, rank: RankStages, trace: RoutingTrace):
    """step -> pipeline rank ``rank``'s routed counts of the pipelined scenario ``whole``'s trace
    (``pipeline_trace``): [m, L_r, W, E], each micro-batch's, of the controller's L_r layers of its
    stage scenario - its chunks' MoE layers in its order, then its MTP modules - over a stage's W
    GPUs; [L_r, W, E], the step's, with one micro-batch."""
    main = whole.model.num_layers
    layers = [c.first_moe + j for c in rank.chunks for j in range(c.moe)]
    layers += [main + j for j in range(rank.mix[2])]  # the MTP modules: all on the loss chunk
    micro = whole.transformer.micro_batches > 1
    counts = trace.micro_routed if micro else trace.routed
    return lambda step: counts[step][:, layers] if micro else counts[step][layers]


def pipeline_trace_stages(whole: Scenario) -> PipelineStages:
    """The stages a pipelined replay simulates: every pipeline rank on its own, each with its
    own routing from the trace (``PipelineStages.of`` shares one simulation between the ranks
    of the same layers, whose synthetic routing is alike)."""
    st = PipelineStages.of(whole)
    scenarios = tuple(rank_scenario(whole, r.mix) for r in st.ranks)
    return PipelineStages(whole, st.layout, st.ranks, scenarios, tuple(range(len(st.ranks))))


def fanout_source(scenario: Scenario):
    """step -> deepep's fanout [L, W, P + A] of a replayed real run (its trace's
    ``fanout``), or None: the synthetic workload's, and a trace without one, is modelled
    from the kept counts (``testbed.policy.deepep.modelled_fanout``)."""
    if scenario.comm.token_strategy != "deepep" or not scenario.workload.trace or pipelined(scenario):
        return None
    fanout = getattr(RoutingTrace.load(scenario.workload.trace), "fanout", None)
    if fanout is None:
        return None
    lay = Layout(scenario)
    width = lay.ep_size + len(np.unique(lay.node(lay.rank_of[0])))  # P + A of the scenario's grid
    if fanout.shape[2:] != (scenario.world_size, width):
        raise ScenarioError("workload.trace", scenario.workload.trace,
                            f"its deepep fanout is for {fanout.shape[2]} ranks x {fanout.shape[3]} counts, the "
                            f"scenario's grid needs {scenario.world_size} x {width}")
    return lambda step: fanout[step]


def op_timer(timer: AnalyticTimer, world: int):
    """``ops -> [W]`` seconds of a batch of concurrent ops on each member, each op alone
    on the fabric (``AnalyticTimer.stage_loads``, no statistics recorded), at least its
    kernels' floor (``AnalyticTimer.floor_seconds``)."""
    def seconds(ops) -> np.ndarray:
        out = np.zeros(world)
        for op in ops:
            t = max(sum(timer.stage_seconds(load) for load in timer.stage_loads(op)), timer.floor_seconds(op))
            m = np.asarray(op.members)
            out[m] = np.maximum(out[m], t)
        return out
    return seconds


class ClusterSim:
    """The simulated cluster of one run: fabric, network, models, controller, clock.
    ``model_scenario``: the model's scenario; ``s``: the controller's, whose
    ``model.num_layers`` MoE layers it plans (with MTP modules theirs too,
    ``testbed.model.mtp_layers.controller_scenario``); ``pipeline_stage``: it simulates one
    micro-batch of a pipeline stage (``sim.pipeline.run``); ``slice_of``: ``scenario`` is the
    representative slice of that scenario (``sim.step.representative_slice``), its ranks the
    first GPUs of that scenario's fabric."""

    def __init__(self, scenario: Scenario, profile: MachineProfile, pipeline_stage: bool = False,
                 slice_of: Scenario | None = None):
        self.model_scenario = scenario
        s = self.s = controller_scenario(scenario)
        self.profile = profile
        self.layout = Layout(s)
        self.controller = Controller(s, layout=self.layout)
        self.env = simpy.Environment()
        self.fabric = build_fabric(slice_of or s, profile)
        self.mode = network_mode(s)
        self.network = Network(self.env, self.fabric, self.mode)
        self.collectives = CollectiveModel(self.network, profile, (slice_of or s).world_size)
        #: W / B: blocks of the whole scenario the slice stands for (1: no slice)
        self.blocks = slice_of.world_size // s.world_size if slice_of is not None else 1
        if slice_of is None:
            self.timer = AnalyticTimer(self.collectives)
        else:
            self.timer = SliceTimer(self.collectives, s.world_size, self.blocks, spine_share(slice_of))
        self.warm = WarmStart()  # the contention fixed point of one step starts from the last
        cores = int(profile.compute.host_cores)
        #: CPU cores shared by the ranks (flow model only; analytic mode scales compute instead)
        self.cores = CorePool(self.env, cores) if cores > 0 and self.mode == "flow" else None
        self.copy_latency = profile.copy.latency_us * 1e-6
        shared = self.cores is not None
        check_model_support(scenario, profile)
        compute = ComputeModel(profile, s.model.dtype, s.world_size, shared_cores=shared,
                               gemm_dtype=s.model.gemm_dtype, fp8_scaling=s.model.fp8_scaling)
        self.builder = PhaseBuilder(s, self.layout, compute,
                                    profile.collectives.group_create_ms * 1e-3, profile.copy.overlap,
                                    create_on_all_ranks=profile.collectives.group_create_scope == "all",
                                    host_s=stage_host_seconds(profile, s),
                                    copy_time=copy_timer(self.fabric, s.world_size, self.copy_latency),
                                    scale_fitted=compute_scale_fitted(profile, s.world_size, shared),
                                    sm_count=profile.compute.sm_count, nccl_sms=profile.collectives.kernel_sms,
                                    op_seconds=op_timer(self.timer, s.world_size), model=scenario,
                                    pipeline_stage=pipeline_stage)
        if slice_of is not None:  # the ZeRO shards of the whole DP groups
            use_whole_shards(self.builder, controller_scenario(slice_of))
        self.faults = Faults(s, self.fabric)
        self.probe = ModelledProbe(s, self.controller, self.builder.compute, s.sim.expert_kernel)  # M20
        self.clock = 0.0
        self.events = 0  # phase executions per rank + collective ops: the work simulated
        self.fixed_groups = self._fixed_groups()
        self.last_other: np.ndarray | None = None  # [W] non-page bytes at the last step's peak (M15)
        # deepep: a replayed run's fanout per step, or None; a pipelined run's holds the whole model's
        # layers summed over micro-batches, so a pipeline stage models each micro-batch's from its counts
        self.fanout_at = None if pipeline_stage else fanout_source(s)
        #: the step's later micro-batches' decisions when it replays several (``decide_step``)
        self.later_micro_batches: list[MicroBatchDecisions] = []

    def _fixed_groups(self) -> np.ndarray:
        """[W] communicators each rank holds from the start (``Planner.fixed_groups``)."""
        n = np.zeros(self.layout.world, dtype=np.int64)
        for members in self.controller.planner.fixed_groups():
            n[list(members)] += 1
        return n

    def memory_at_start(self) -> np.ndarray:
        """[W] bytes each GPU holds when a step begins: resident expert pages (all local
        experts when paging is off), communicator buffers (M10) and, for the whole
        transformer, the other weights and the optimizer state (``model_state_bytes``)."""
        return self.expert_weight_bytes() + self.communicator_bytes() + self.model_state_bytes()

    def expert_weight_bytes(self) -> np.ndarray:
        """[W] bytes of expert weights on each GPU: its resident pages, or every local
        expert when paging is off (with expert TP its 1/etp slice of each)."""
        if self.controller.pool is not None:
            return self.page_bytes_now()
        return np.full(self.layout.world, len(self.controller.local_instances(0)) * self.s.model.expert_bytes
                       // self.layout.etp_size)

    def communicator_bytes(self) -> np.ndarray:
        """[W] bytes of the communicators each GPU holds: the fixed groups and the group
        cache's (M10), ``collectives.communicator_MiB`` each."""
        groups = self.fixed_groups.copy()
        for members in self.controller.cache.groups():
            groups[list(members)] += 1
        return groups * self.profile.collectives.communicator_MiB * 2**20

    def model_state_bytes(self) -> float:
        """Bytes every GPU holds for the weights besides its expert pages: the shared
        experts' and the routed experts' biases (``PhaseBuilder.extra_param_bytes``), and
        for the whole transformer its weights besides its experts (attention, dense FFNs,
        embeddings, MTP modules' projections and attentions, routers) and the optimizer's state
        (``optimizer_state_bytes``); the MoE stack alone holds only the former."""
        extra = self.builder.extra_param_bytes
        if not self.s.transformer.enabled:
            return float(extra)
        routers = self.builder.router_grad_bytes * self.s.model.num_layers  # fp32, as their gradients
        state = self.builder.dense.param_bytes + routers + self.optimizer_state_bytes()
        return state + extra if extra else state

    def optimizer_state_bytes(self) -> float:
        """Bytes of Adam's state a GPU holds (``transformer.optimizer = adam``):
        ``transformer.optimizer_state_bytes`` per parameter of everything it holds (dense
        weights, routers, its experts), its ZeRO shard (``testbed.model.whole_model.zero_shards``);
        0 for plain SGD."""
        t, dense, b = self.s.transformer, self.builder.dense, self.builder
        if not t.enabled or t.optimizer != "adam":
            return 0.0
        dense_shard, expert_shard, _, _ = b.zero  # with expert TP a slice's over its expert-DP group
        local = len(self.controller.local_instances(0)) * (b.expert_matrix_params + b.expert_bias_params)
        shared = self.s.model.num_layers * b.shared.params  # whole on every GPU
        return ((dense.dense_params + dense.router_params + shared) / dense_shard + local / expert_shard) \
            * t.optimizer_state_bytes

    def page_bytes_now(self) -> np.ndarray | None:
        """[W] bytes of the GPU slots holding pages now (None without paging)."""
        pool = self.controller.pool
        if pool is None:
            return None
        return np.array([p.used_slots for p in pool.pagers])[pool.class_of] * float(pool.pagers[0].slot_bytes)

    def free_memory(self, base: np.ndarray) -> dict[int, tuple[float, float]] | None:
        """M15, ``pager.free_memory = device``: per GPU (modelled free bytes outside the page
        pool, device bytes). Device bytes: ``pager.device_memory_bytes``, else the
        profile's. What is not the pool is modelled from the last step: its peak less the
        pages it began with (activations, gradients, buffers, communicators); before the
        first step, the communicators."""
        cfg = self.s.pager
        if self.controller.pool is None or cfg.free_memory != "device":
            return None
        device = float(cfg.device_memory_bytes or self.profile.compute.device_memory_GB * 1e9)
        pool = self.controller.pool
        capacity = np.array([p.capacity_slots for p in pool.pagers])[pool.class_of] * pool.pagers[0].slot_bytes
        other = self.last_other if self.last_other is not None else base - self.page_bytes_now()
        free = np.floor((device - capacity - other) / cfg.page_size_bytes) * cfg.page_size_bytes  # whole pages
        return {int(r): (float(free[i]), device) for i, r in enumerate(pool.ranks)}

    def step(self, step: int, routed: np.ndarray, step_times: list[float]):
        """Simulate one step: (decisions, phases, timeline, figures, faults)."""
        faults = self.faults.apply(step, step_times)
        if faults and self.mode == "flow":
            self.network.refresh()
        base = self.memory_at_start()
        pages_at_start = self.page_bytes_now()
        carried = self.network.bytes_by_edge.copy()
        messages = self.network.messages_by_edge.copy()
        self.later_micro_batches = []
        decisions = decide_step(self.controller, step, routed, self.free_memory(base), self.probe,
                                self.fanout_at(step) if self.fanout_at is not None else None,
                                later=self.later_micro_batches)
        phases = self.builder.build(decisions)
        world = self.layout.world
        if self.mode == "analytic":
            tl = run_analytic(phases, world, self.timer, self.clock, self.copy_latency, self.warm)
        else:
            tl = run_flows(phases, world, self.collectives, self.env.now, self.copy_latency, self.cores)
        fig = figures(phases, tl, base, self.s.model.num_layers, shown=TRACE_RANKS)
        if pages_at_start is not None:  # what the next step's free memory model starts from (M15)
            self.last_other = np.maximum(fig.peak_by_rank - pages_at_start, 0.0)
        self.clock = tl.t0 + fig.step_time_s
        self.events += len(phases) * world + len(tl.ops)
        self.wire_bytes = self.network.wire_bytes_by_level(self.network.bytes_by_edge - carried, self.profile.protocol,
                                                           self.network.messages_by_edge - messages)
        return decisions, phases, tl, fig, faults, base


class SimBackend:
    name = "sim"

    def check(self, scenario: Scenario, resume=None, force: bool = False) -> None:
        """What can refuse the run before a folder is written: model features this scenario
        uses that the simulator cannot model here (``sim.hardware.model_support``), a
        pipeline's stages, layout and schedule (``testbed.policy.pipeline_stages``), and what
        expert TP cannot run with (``testbed.policy.expert_tensor_parallel``)."""
        check_pipeline(scenario)
        if scenario.workload.trace and pipelined(scenario):  # the trace's shape, before a folder is written
            pipeline_trace(scenario)
        check_combined_1f1b(scenario)  # Megatron-Core's conditions, pipelined or not
        check_distributed_optimizer(scenario)  # Megatron-LM's conditions of --overlap-param-gather
        check_expert_tensor_parallel(scenario)  # what expert TP runs with (the planner checks it too)
        check_model_support(scenario, load_profile(scenario.cluster.profile))

    def run(self, scenario: Scenario, *, progress: bool = False, on_step=None) -> RunResult:
        wall0 = time.perf_counter()
        whole = scenario
        profile = load_profile(whole.cluster.profile)
        # pipeline parallelism or micro-batches (sim.pipeline.run): each distinct stage, one micro-batch,
        # simulated; this loop's is rank 0's, the pipeline runs the others
        replay = bool(whole.workload.trace)
        stages = None
        if pipelined(whole):
            stages = pipeline_trace_stages(whole) if replay else PipelineStages.of(whole)
        s = stages.scenarios[0] if stages else whole
        # the fast evaluation (sim.representative_slice): one block of each simulated scenario's GPUs
        # (the whole scenario's, or each pipeline stage's: every stage has the same GPUs and layout)
        slice_note, sliced = None, False
        if whole.sim.representative_slice:
            why = slice_refusal(s)
            sliced = why is None
            slice_note = {"used": sliced, "reason": why or "conditions hold"}
            if sliced:
                part = slice_scenario(s)
                slice_note.update(gpus=part.world_size, of_gpus=s.world_size,
                                  slices=s.world_size // part.world_size)
                s_full, s = s, part
        if stages and replay:
            replayed = pipeline_trace(whole)
            sources = {id(sc): trace_routing(whole, r, replayed) for sc, r in zip(stages.scenarios, stages.ranks)}
            routed_at = sources[id(s)]
        else:
            routed_at = routing_source(controller_scenario(s))
        slice_of = s_full if sliced else None
        # the next step's routing is drawn while this one is simulated (0.7 s of multinomial
        # draws per step at paper scale): numpy's generators release the GIL, each step has
        # its own generator, and nothing else touches the workload, so the counts are the same
        ahead = ThreadPoolExecutor(max_workers=1)
        upcoming = ahead.submit(routed_at, 0) if s.run.steps else None
        try:
            sim = ClusterSim(s, profile, pipeline_stage=stages is not None, slice_of=slice_of)
            if stages and replay:  # one stage scenario per pipeline rank (pipeline_trace_stages): its routing
                runner = lambda st: stage_runner(st, profile, sources[id(st)])  # noqa: E731
            else:
                runner = lambda st: stage_runner(st, profile, sliced=sliced)  # noqa: E731
            pipe = PipelinedStep(whole, profile, stages, runner) if stages else None
            level_capacity = np.array([sim.fabric.nominal[sim.fabric.level == i].sum() for i in range(len(LEVELS))])
            bar = Progress(s.run.steps, f"sim x{s.world_size} ({sim.mode})", enabled=progress)
            records, trace, routing, layer_times = [], [], [], []
            whole_layout = None  # the sliced scenario's whole layout, for its sync's bytes
            hops: dict = {}  # the ledgers' link levels per member set, kept over the steps
            for step in range(s.run.steps):
                routed = np.asarray(upcoming.result())
                if step + 1 < s.run.steps:
                    upcoming = ahead.submit(routed_at, step + 1)
                routing.append(routed)
                d, phases, tl, fig, faults, base = sim.step(step, routed, [r.step_time_s for r in records])
                fullest = int(np.argmax(fig.peak_by_rank))
                breakdown = memory_breakdown(sim, d, phases, fullest)  # the last step's is reported
                peak_at = fig.peak_at
                # the step's bytes, for its record and its trace; gloo's reduce-scatters as its all-reduces
                ledger = ByteLedger(sim.layout, hops, reduce_scatter_runs_as_all_reduce(profile))
                record = _record(step, sim, d, fig, faults, ledger)
                record.discovery_s = discovery_seconds(tl)
                if pipe is not None:
                    record, breakdown = pipe.apply(step, SimulatedStage(record, breakdown, phases, tl, sim.layout,
                                                                        sim.builder, fullest, replay))
                if sim.blocks > 1:  # the slice's totals over its GPUs made the whole scenario's
                    if whole_layout is None:
                        whole_layout = Layout(controller_scenario(s_full))
                    sync = SyncBytes(d.sync.expert_sync_ops + d.sync.dense_sync_ops, sim.timer, sim.layout,
                                     whole_layout, reduce_scatter_runs_as_all_reduce(profile))
                    scale_record(record, sim.blocks, sync, whole.parallelism.pp_size if pipe is not None else 1)
                records.append(record)
                layer_times.append(fig.layer_time_s)
                trace += trace_events(step, phases, tl, sim.layout, TRACE_RANKS, fig.memory, level_capacity,
                                      op_levels=ledger.op_bytes)
                if on_step:
                    on_step(record)
                bar.update(note=f"simulated step {record.step_time_s * 1e3:.2f} ms")
        finally:
            ahead.shutdown(wait=True, cancel_futures=True)
        measured = records[s.run.warmup_steps:] or records
        elapsed = sum(r.step_time_s for r in records)
        trace += _trace_names(s.world_size, TRACE_RANKS)
        extra = {
            "network_model": sim.mode,
            "profile": profile.name,
            "utilization_by_level": sim.network.utilization_by_level(elapsed) if elapsed > 0 else {},
            "hottest_links": sim.network.hottest_links(5, elapsed) if elapsed > 0 else [],
            "layer_time_s": [float(np.median([lt[i] for lt in layer_times[s.run.warmup_steps:] or layer_times]))
                             for i in range(sim.s.model.num_layers)],
            "exposed_s": float(np.median([r.extra["exposed_s_mean"] for r in measured])),
            "host_bytes_by_stage": {st: float(np.mean([r.extra["host_bytes_by_stage"][st] for r in measured]))
                                    for st in measured[0].extra["host_bytes_by_stage"]},
            "device_memory_bytes": profile.compute.device_memory_GB * 1e9,
            # the last step's, on its fullest GPU (sim.step.memory_breakdown)
            "memory_breakdown_bytes": breakdown if s.run.steps else {},
            "peak_memory_at": peak_at if s.run.steps else None,
            "fits_in_device_memory": max(r.peak_memory_bytes for r in records) <= profile.compute.device_memory_GB * 1e9,
            "faults": [f.to_dict() for f in sim.faults.outcomes],
            "fault_time_lost_s": sum(f.time_lost_s for f in sim.faults.outcomes),
            "sim_events": sim.events,
            "wall_time_s": time.perf_counter() - wall0,
        }
        if slice_note is not None:
            scored = getattr(getattr(routed_at, "__self__", None), "scored", None)  # SyntheticWorkload's
            block = getattr(scored, "routed_block", 0)
            slice_note["routing"] = (f"one layer of one block of {block} GPUs routed for every layer and block"
                                     if block else "every layer and GPU routed")
            extra["representative_slice"] = slice_note
        if sliced:
            extra.update(utilization_by_level={}, hottest_links=[])  # the slice's links, not the cluster's
        if pipe is not None:  # one stage's micro-batches: not a trace of the whole scenario's steps
            extra["pipeline"] = records[-1].extra["pipeline"] if records else {}
            extra.update(utilization_by_level={}, hottest_links=[])  # the stage's one micro-batch (sim.pipeline.run)
            return RunResult(whole, records, trace, None, extra)
        routing_trace = RoutingTrace(np.stack(routing), s.workload.tokens_per_rank, s.model.top_k)
        if sliced:  # the slice's routing: not the whole scenario's
            return RunResult(whole, records, trace, None, extra)
        return RunResult(s, records, trace, routing_trace, extra)


def stage_runner(scenario: Scenario, profile: MachineProfile, routed_at=None, sliced: bool = False):
    """``step -> SimulatedStage``: a pipeline stage other than the run's own (``sim.pipeline.run``),
    on a cluster sim and routing of its own (``routed_at``: a replayed trace's for its pipeline
    rank, ``trace_routing``; by default the synthetic workload's), each step as ``SimBackend.run``'s
    loop makes one; ``sliced``: on the stage's representative slice (``sim.step.representative_slice``)."""
    part = slice_scenario(scenario) if sliced else scenario
    sim = ClusterSim(part, profile, pipeline_stage=True, slice_of=scenario if sliced else None)
    replay = routed_at is not None
    routed_at = routed_at or routing_source(controller_scenario(part))
    times: list[float] = []

    def run_step(step: int) -> SimulatedStage:
        d, phases, tl, fig, faults, _ = sim.step(step, np.asarray(routed_at(step)), times)
        fullest = int(np.argmax(fig.peak_by_rank))
        record = _record(step, sim, d, fig, faults)
        times.append(record.step_time_s)
        return SimulatedStage(record, memory_breakdown(sim, d, phases, fullest), phases, tl, sim.layout, sim.builder,
                              fullest, replay)
    return run_step


def discovery_seconds(tl) -> float | None:
    """Seconds the step's M10 discovery all-gather took (its op in the timeline), or None."""
    spans = [end - start for op, start, end in tl.ops if op.layer < 0 and op.stage == "expert_sync"
             and op.kind == "all_gather"]
    return max(spans) if spans else None


def _record(step: int, sim: ClusterSim, d: StepDecisions, fig, faults, ledger: ByteLedger | None = None) -> StepRecord:
    """One StepRecord: bytes from the decisions (as the real backend counts them), times
    and memory from the simulated timeline. ``ledger``: an empty one to count into (the
    trace then reuses its counts), a new one by default."""
    if ledger is None:
        ledger = ByteLedger(sim.layout, None, reduce_scatter_runs_as_all_reduce(sim.profile))
    # a replayed step of several micro-batches: every one's layers (``decide_step``)
    forwards = d.forward + [f for mb in sim.later_micro_batches for f in mb.forward]
    backwards = list(d.backward.values()) + [b for mb in sim.later_micro_batches for b in mb.backward.values()]
    moves = [d.sync.page_moves, d.end.page_moves, d.heat_moves] + [f.prefetch_moves for f in forwards]
    for f in forwards:
        for op in f.route_ops + f.refresh_ops + f.dispatch_ops + f.combine_ops + [o for ops in f.dense_ops for o in ops]:
            ledger.add_op(op)
        moves.append(f.page_moves)
    for b in backwards:
        for op in b.combine_backward_ops + b.dispatch_backward_ops + [o for ops in b.dense_ops for o in ops]:
            ledger.add_op(op)
        moves.append(b.page_moves)
    for op in d.sync.expert_sync_ops + d.sync.dense_sync_ops + d.heat_ops:
        ledger.add_op(op)
    groups = [g for m in moves for g in m.groups()]  # (ranks, moves each of them made)
    pcie = sum(len(ranks) * m.pcie_bytes for ranks, m in groups)
    if pcie:
        ledger.add_pcie("paging", pcie)
    states = d.heat.state_counts() if d.heat is not None else None
    by_reason: dict[str, int] = {}
    for ranks, m in groups:
        add_reason_counts(by_reason, m, len(ranks))
    cache = d.sync.cache
    return StepRecord(
        step=step,
        step_time_s=fig.step_time_s,
        stage_time_s=fig.stage_time_s,
        bytes_by_stage={k: int(v) for k, v in ledger.by_stage.items()},
        bytes_by_level=ledger.level_dict(),
        peak_memory_bytes=fig.peak_memory_bytes,
        routed_slots=int(sum(f.routed.sum() for f in forwards)),
        dropped_slots=int(sum(f.dropped_slots for f in forwards)),
        page_moves=sum(len(ranks) * page_move_count(m) for ranks, m in groups),
        page_bytes=int(pcie),
        page_stall_s=fig.page_stall_s,
        cache_hits=cache.hits if cache else 0,
        cache_lookups=cache.lookups if cache else 0,
        expert_states=states,
        moves_by_reason=by_reason,
        frozen_fraction=frozen_fraction(d.frozen, sim.layout.world * len(sim.controller.local_instances(0))),
        wire_bytes_by_level=sim.wire_bytes,
        fitted_share=fig.fitted_share,
        extra={"layer_time_s": fig.layer_time_s, "exposed_s_mean": fig.exposed_s_mean,
               "host_bytes_by_stage": dict(sim.builder.host_bytes),
               "exposed_s_max": fig.exposed_s_max, "faults": [f.to_dict() for f in faults]},
    )


def _trace_names(world: int, shown: int) -> list[dict]:
    names = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"GPU {r}"}}
             for r in range(min(world, shown))]
    names.append({"name": "process_name", "ph": "M", "pid": world, "args": {"name": "fabric"}})
    return names
