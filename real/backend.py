"""The real backend: the scenario's ranks as PyTorch processes (gloo on CPU, NCCL on GPUs).

One entry point for both launches (``real.launch.launcher``): started plainly it spawns every
rank on this machine; started by ``torchrun`` (its RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT are set) this process *is* one rank, and only rank 0 writes
the run folder (``writes_run_folder``) and gets the step records.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from real.kernels.adam import STATE_BYTES as ADAM_STATE_BYTES
from real.launch.launcher import pick_device, run_in_process, run_ranks, torchrun_device, torchrun_env, usable_cores
from real.netem import check_privileges
from real.rank.checkpoint import checkpoint_dir, resumable_steps
from real.rank.memory_meter import CPU_PEAK_LEAVES_OUT, CUDA_PEAK_LEAVES_OUT
from real.rank.recompute import WITHOUT_OUTPUT, without_output_supported
from real.rank.worker import stream_of
from testbed.core.errors import ScenarioError
from testbed.core.progress import Progress
from testbed.model.recompute_modules import GROUPED_EXPERT_KERNELS, check_recompute_modules
from testbed.model.whole_model import recompute_modules_of, shape_of
from testbed.policy.expert_tensor_parallel import check_expert_tensor_parallel
from testbed.run.backend import RunResult
from testbed.run.routing_trace import RoutingTrace
from testbed.scenario.scenario import Scenario, holds_part_of_a_sequence


def check_runnable(scenario: Scenario) -> None:
    """Fail fast on what only the simulator models (a ScenarioError naming the field)."""
    s = scenario
    if s.workload.trace:
        raise ScenarioError("workload.trace", s.workload.trace,
                            "the real backend routes real tokens; a trace is replayed by --backend sim")
    if s.overlap.micro_batches > 1 and s.comm.token_strategy != "alltoall":
        raise ScenarioError("overlap.micro_batches", s.overlap.micro_batches,
                            f"the real backend pipelines micro-batches of the flat all-to-all only "
                            f"(comm.token_strategy = alltoall, not {s.comm.token_strategy}); "
                            f"--backend sim models the others")
    if s.overlap.micro_batches > 1 and s.parallelism.etp_size > 1:
        raise ScenarioError("overlap.micro_batches", s.overlap.micro_batches,
                            f"the real backend pipelines the all-to-all's micro-batches without the expert-TP "
                            f"all-gather and reduce-scatter (parallelism.etp_size = {s.parallelism.etp_size}); "
                            f"--backend sim models it")
    check_expert_tensor_parallel(s)  # what expert TP cannot run with, before the ranks start (they plan it too)
    t = s.transformer
    if t.enabled:  # the real whole transformer: data x expert x tensor parallelism, Adam or SGD (real.rank.dense_model)
        if s.parallelism.pp_chunks > 1:
            raise ScenarioError("parallelism.pp_chunks", s.parallelism.pp_chunks, "the real backend runs one model "
                                "chunk a pipeline stage (1F1B, not the interleaved schedule); --backend sim models more")
        if t.micro_batches > 1 and s.parallelism.pp_size == 1:
            raise ScenarioError("transformer.micro_batches", t.micro_batches, "the real backend runs micro-batches "
                                "through pipeline stages (parallelism.pp_size > 1, 1F1B), not as gradient "
                                "accumulation on one stage; --backend sim models it")
        if s.parallelism.pp_size > 1:  # real.comm.stage_link: stages of their own process groups
            for name, value, why in (
                    ("comm.expert_sync", s.comm.expert_sync if s.comm.expert_sync == "two_stage" else None,
                     "its cached groups are made as each stage's routing asks, but every rank must make every group"),
                    ("transformer.tied_embeddings", t.tied_embeddings or None, "the embedding is the first stage's, "
                     "the head the last's"),
                    ("real.network", "emulated" if s.real.network == "emulated" else None, "an emulated cluster "
                     "carries one stage")):
                if value is not None:
                    raise ScenarioError(name, value, f"with parallelism.pp_size > 1 on the real backend: {why}")
        _check_model_features(s)
        _check_sequence_balance_loss(s)
        if t.zero_stage > 0:
            raise ScenarioError("transformer.zero_stage", t.zero_stage, "the real backend keeps the whole optimizer "
                                "state on every rank (ZeRO 0); --backend sim models ZeRO")
        if t.recompute != "none":
            raise ScenarioError("transformer.recompute", t.recompute, "the real backend keeps every activation; "
                                "--backend sim models recompute")
        _check_recompute_modules(s)
        if t.optimizer == "adam" and t.optimizer_state_bytes != ADAM_STATE_BYTES:
            raise ScenarioError("transformer.optimizer_state_bytes", t.optimizer_state_bytes,
                                f"the real backend's Adam keeps fp32 master weights, m and v: {ADAM_STATE_BYTES}")
    if s.faults:
        raise ScenarioError("faults[0].kind", s.faults[0].kind,
                            "simulated only: fault events are injected by --backend sim; a real rank that dies "
                            "stops the run with an error")
    if (s.pager.enabled and s.pager.free_memory == "device" and not s.pager.device_memory_bytes
            and (s.real.network == "emulated" or (torchrun_env() is None and pick_device(s) == "cpu"))):
        raise ScenarioError("pager.device_memory_bytes", 0,
                            "pager.free_memory = device on CPU ranks needs the device memory to model; "
                            "on CUDA the allocator's free memory is used")
    if s.real.network == "emulated":
        if torchrun_env() is not None:
            raise ScenarioError("real.network", "emulated", "an emulated cluster is made by the spawning launcher on "
                                "one machine; under torchrun the ranks use the machines' own network")
        check_privileges()  # one clear line without root, before anything is made


def _check_model_features(s: Scenario) -> None:
    """The models people train (issue 24) with the parallelism the real backend runs them
    under: MLA, an output-projection bias and MTP on whole ranks (no tensor parallelism: MLA's
    latents and the output bias would be replicated across a group, their gradients summed
    over it, which the planner does not plan); shared experts split over a tensor-parallel
    group (``real.rank.shared_experts``) with sequence parallelism only (without it the plan
    all-reduces their output on the group's replicated rows, which these ranks' MoE layers do
    not get) and without their gate (whole on every member, each computing its gradient on its
    own rows: Megatron-Core sums it over the group, ``gate_weight.sequence_parallel``, the plan
    only over the GPUs of one tensor-parallel index); MTP and dense-first layers on one
    pipeline stage, and MLA's RoPE on pairs of dimensions."""
    t, p = s.transformer, s.parallelism
    whole_ranks = (("transformer.attention", t.attention == "mla" and t.attention),
                   ("model.shared_expert_gate", s.model.shared_experts and s.model.shared_expert_gate),
                   ("transformer.attention_bias", t.attention_bias == "all" and t.attention_bias),
                   ("transformer.mtp_layers", t.mtp_layers))
    for name, value in whole_ranks:
        if value and p.tp_size > 1:
            raise ScenarioError(name, value, "the real backend runs it without tensor parallelism "
                                "(parallelism.tp_size = 1); --backend sim models it")
    if s.model.shared_experts and p.tp_size > 1 and not p.sequence_parallel:
        raise ScenarioError("model.shared_experts", s.model.shared_experts, "the real backend splits them over "
                            "a tensor-parallel group with parallelism.sequence_parallel only; --backend sim models it")
    for name, value in (("transformer.mtp_layers", t.mtp_layers), ("transformer.first_dense_layers",
                                                                    t.first_dense_layers)):
        if value and p.pp_size > 1:
            raise ScenarioError(name, value, "the real backend runs it on one pipeline stage "
                                "(parallelism.pp_size = 1); --backend sim models it")
    if t.attention == "mla" and t.qk_rope_head_dim % 2:
        raise ScenarioError("transformer.qk_rope_head_dim", t.qk_rope_head_dim,
                            "RoPE rotates pairs of dimensions: must be even")


def _check_recompute_modules(s: Scenario) -> None:
    """The recompute modules the real ranks run (``real.rank.recompute``), checked as the
    simulator checks them (``testbed.model.recompute_modules.check_recompute_modules``), but
    ``moe``: its recompute runs the MoE layer's forward again in the backward, route,
    controller and token exchange included, while these ranks' controller plans each layer
    once a step (paging, capacity) and the plan counts the exchange once; and
    ``mla_up_proj`` with context parallelism, whose attention (``real.rank.context_parallel``)
    does not recompute the up projections."""
    t, modules = s.transformer, recompute_modules_of(s)
    if not modules:
        return
    try:
        check_recompute_modules(modules, shape_of(s), full_recompute=t.recompute == "full",
                                shared_expert_overlap=s.overlap.shared_experts,
                                fp8_delayed_scaling=s.model.gemm_dtype == "fp8" and s.model.fp8_scaling == "tensor",
                                grouped_experts=s.sim.expert_kernel in GROUPED_EXPERT_KERNELS,
                                moe_a2a_overlap=s.overlap.moe_expert_parallel_comm)
    except ScenarioError as e:  # the field's value as the scenario spells it
        raise ScenarioError("transformer.recompute_modules", t.recompute_modules, e.reason) from None
    if not without_output_supported() and (late := [m for m in modules if m in WITHOUT_OUTPUT]):
        raise ScenarioError("transformer.recompute_modules", t.recompute_modules,
                            f"{late[0]} frees its output through torch's saved-tensor hook stack, which torch "
                            f"{torch.__version__} does not expose (2.8 and later do); --backend sim models it")
    if "moe" in modules:
        raise ScenarioError("transformer.recompute_modules", t.recompute_modules,
                            "moe's recompute runs the MoE layer again in the backward (route, paging, dispatch and "
                            "combine): the real ranks' controller plans each layer once a step and the planner "
                            "counts its token exchange once; --backend sim models it")
    if "mla_up_proj" in modules and s.parallelism.cp_size > 1:
        raise ScenarioError("transformer.recompute_modules", t.recompute_modules,
                            f"mla_up_proj with parallelism.cp_size = {s.parallelism.cp_size}: the real backend's "
                            "context-parallel attention does not recompute MLA's up projections; --backend sim "
                            "models it")


def _check_sequence_balance_loss(s: Scenario) -> None:
    """The real router (``testbed.policy.router.route``) takes the sequence-wise balance loss
    over each rank's own sequences; Megatron-Core all-reduces a sequence's statistics over the
    GPUs it is split over (moe_utils.py, sequence_load_balancing_loss_func's
    sequence_partition_group: TP x CP), which the real backend does not. The simulator routes
    synthetic tokens and takes no loss, so it runs these layouts."""
    t, tokens, cp = s.transformer, s.workload.tokens_per_rank, s.parallelism.cp_size
    if s.router.seq_aux_loss_coef <= 0:
        return
    if cp > 1:
        raise ScenarioError("router.seq_aux_loss_coef", s.router.seq_aux_loss_coef,
                            f"with parallelism.cp_size = {cp}: the sequence-wise balance loss over sequences "
                            "split across a CP group is not modelled on the real backend; --backend sim runs it")
    if holds_part_of_a_sequence(s):
        raise ScenarioError("router.seq_aux_loss_coef", s.router.seq_aux_loss_coef,
                            f"the sequence-wise balance loss is taken over each GPU's own sequences; with "
                            f"workload.tokens_per_rank = {tokens} each GPU of a tensor-parallel group holds part "
                            f"of a sequence of transformer.seq_len = {t.seq_len} (not modelled on the real "
                            "backend; --backend sim runs it)")


def check_ranks_per_core(scenario: Scenario, force: bool) -> None:
    """Refuse more CPU ranks per core than ``real.max_ranks_per_core`` (unless ``force``):
    past it every rank mostly waits for a core, and a run measures the scheduler."""
    if force or pick_device(scenario) == "cuda" or torchrun_env() is not None:
        return
    cores = len(usable_cores())
    limit = scenario.real.max_ranks_per_core
    if scenario.world_size > limit * cores:
        raise ScenarioError("real.max_ranks_per_core", limit,
                            f"{scenario.world_size} CPU ranks on {cores} cores is {scenario.world_size / cores:g} per "
                            f"core (--force, or a larger real.max_ranks_per_core, to run anyway)")


class RealBackend:
    name = "real"
    takes_run_dir = True  # testbed.run.runner passes the run folder (checkpoints, profiler traces) and resume

    def check(self, scenario: Scenario, resume=None, force: bool = False) -> None:
        """Everything that can refuse the run, before any folder is written or rank started:
        options only the simulator models, privileges, ranks per core, checkpoints and
        what a resume needs."""
        check_runnable(scenario)
        check_ranks_per_core(scenario, force)
        if resume is None:
            return
        if not scenario.checkpoint.enabled:
            raise ScenarioError("checkpoint.enabled", False, "resuming needs the run's checkpoints")
        directory = checkpoint_dir(scenario, resume)
        if resumable_steps(scenario, directory) == {0}:
            raise ScenarioError("--resume", str(resume), f"no checkpoint complete on every rank in {directory}: "
                                "nothing to continue from")

    def job_id(self) -> str | None:
        """An id every process of this torchrun job shares (it names the one run folder), or None."""
        env = torchrun_env()
        if env is None:
            return None
        return os.environ.get("TORCHELASTIC_RUN_ID") or f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"

    def writes_run_folder(self) -> bool:
        """False on torchrun ranks other than 0: rank 0 alone writes the run folder."""
        env = torchrun_env()
        return env is None or int(env["RANK"]) == 0

    def run(self, scenario: Scenario, *, progress: bool = False, on_step=None, debug: dict | None = None,
            run_dir=None, resume=None) -> RunResult:
        """Run the scenario's ranks.

        ``run_dir``: the run folder (checkpoints, torch profiler traces). ``resume``: None
        for a fresh run, True to continue from the latest complete checkpoint, or the step
        of one (M23). ``debug`` is for tests (``RankRunner.run``).
        """
        check_runnable(scenario)
        if scenario.checkpoint.enabled and checkpoint_dir(scenario, run_dir) is None:
            raise ScenarioError("checkpoint.directory", "", "checkpoints need a folder: a run folder or this field")
        if resume is not None and resume is not False and not scenario.checkpoint.enabled:
            raise ScenarioError("checkpoint.enabled", False, "resuming needs the run's checkpoints")
        run_dir = str(run_dir) if run_dir is not None else None
        env = torchrun_env()
        lead = env is None or int(env["RANK"]) == 0
        records = []
        bar = Progress(scenario.run.steps, f"real x{scenario.world_size}", enabled=progress and lead)

        def step(record):
            records.append(record)
            if on_step:
                on_step(record)
            bar.update(record.step + 1, note=f"step {record.step_time_s * 1e3:.1f} ms, loss {record.loss:.4f}")

        wall0 = time.perf_counter()
        if env is None:
            device = pick_device(scenario)
            payload = run_ranks(scenario, step, debug, run_dir, resume, progress=progress)
        else:
            device = torchrun_device(scenario, int(env["LOCAL_RANK"])).type
            payload = run_in_process(scenario, env, step, debug, run_dir, resume, progress=progress and lead)
        if payload is None:  # a torchrun rank other than 0: rank 0 reports the run
            return RunResult(scenario, [], extra={"device": device})
        routing = None
        if payload["routing"] is not None:  # pipeline stages: the one-stage run's trace (RankRunner._whole_model)
            routing = RoutingTrace(payload["routing"], scenario.workload.tokens_per_rank, scenario.model.top_k,
                                   fanout=payload.get("fanout"))
        extra = {"device": device, "group_create_s": payload["group_create_s"],
                 "group_create_bytes": payload.get("group_create_bytes", 0),
                 "launcher": "spawn" if env is None else "torchrun",
                 "wall_time_s": time.perf_counter() - wall0, "exposed_s": _exposed_s(records, scenario)}
        if records:  # the last step's, on its fullest rank, measured (real.rank.worker)
            extra["memory_breakdown_bytes"] = records[-1].extra.get("memory_breakdown_bytes", {})
        # beside the peak wherever it is compared with the simulator's
        extra["peak_memory_note"] = CUDA_PEAK_LEAVES_OUT if device == "cuda" else CPU_PEAK_LEAVES_OUT
        if resume is not None and resume is not False:
            extra["resumed_from"] = payload["first_step"]
        return RunResult(scenario, records, payload["trace"], routing, extra, captured=payload.get("captured"))


def _exposed_s(records, scenario: Scenario) -> float | None:
    """Median over measured steps of the time a rank spent outside compute stages (waiting
    for communication and page copies): the measured counterpart of the simulator's
    ``exposed_s``."""
    measured = [r for r in records if r.step >= scenario.run.warmup_steps] or records
    if not measured:
        return None
    return statistics.median(sum(t for stage, t in r.stage_time_s.items() if stream_of(stage) != "compute")
                             for r in measured)
