"""The phases of one step from the controller's decisions (``PhaseBuilder``; the ``Phase``
and the copy-overlap rule: ``sim.step.phases``); seconds and bytes per GPU.

Without overlap every phase depends on the one before it, so a rank works in the order
the real backend does:

forward, per layer:  (whole transformer: dense, its tensor-parallel collectives,) route,
                     the EP group's counts all-gather, refresh requests and replica
                     refreshes, page loads, dispatch, experts, combine (whole
                     transformer, after the last layer: the output head)
backward, per layer: combine_backward, page reloads, experts_backward,
                     dispatch_backward, route_backward (whole transformer: dense_backward)
then:                active-group discovery (M10), communicator creation, expert_sync,
                     dense_sync (one all-reduce per gradient bucket), optimizer, heat,
                     paging

With the distributed optimizer (ZeRO >= 1 with adam, ``testbed.policy.distributed_optimizer``)
the sync's all-reduces are reduce-scatters and the updated parameters' all-gathers follow the
optimizer, or with ``transformer.overlap_param_gather`` run beside the forward
(``sim.step.param_gather``); ``transformer.overlap_grad_reduce`` is ``overlap.sync_with_backward``.

The layers are the MoE layers the controller plans (``testbed.model.mtp_layers``): the
model's L and, with MTP modules (``transformer.mtp_layers`` D), module d's as layer
L + d, its block its projection and attention (``sim.hardware.dense_layers``); the
output head (the model's and each module's) runs after MoE layer L + D - 1.

Overlap (M22): with ``overlap.micro_batches = n > 1`` the token exchange and the experts
of a layer (forward and backward) run as n micro-batches, the collectives on the comm
stream and the experts on the compute stream, so one micro-batch's all-to-all overlaps
another's experts; ``overlap.sync_with_backward`` puts a layer's gradient sync (and
each router-gradient bucket its layer completes) on the sync stream as soon as its
backward is done, after the step's discovery, which runs there once the forward is
done; page loads go on the copy stream, overlapping the dispatch, when the profile says
copies overlap compute (``copy.overlap > 0``). FP8 payloads (``comm.payload_dtype``)
are already in the ops' bytes.

Shared experts (``model.shared_experts``, ``sim.hardware.shared_experts``): every rank
runs them on its own tokens in each MoE layer (stage ``experts``; ``experts_backward``).
With ``overlap.shared_experts`` (Megatron-Core's shared-expert overlap) their first GEMM
and activation run on the compute stream beside the dispatch (issued after the route,
before the routed experts) and their second beside the combine (after the routed
experts), the backward the other way round (the second's beside the combine_backward,
the first's beside the dispatch_backward); with micro-batches beside the first dispatch
and the last combine. Without it they run in the chain after the combine (backward:
before the combine_backward), as Megatron-Core's shared experts do without the overlap.

Recompute by module (``transformer.recompute_modules``, Megatron-Core's
``--recompute-modules``; ``testbed.model.recompute_modules``): an MoE layer's forward
keeps its expert rows less what the modules free of them
(``testbed.model.whole_model.expert_row_bytes``); the recomputes of the layer's attention
and dense layers are its block's (``sim.hardware.dense_layers``), the shared experts'
theirs (``sim.hardware.shared_experts``). ``moe_act`` recomputes each row's activation
inside the experts' backward (its elements read and written at the memory bandwidth,
``kernel_seconds``). ``moe`` checkpoints the whole MoE FFN: Megatron-Core's
``MoELayer.forward`` runs route, dispatch (``token_dispatch``, the all-to-all), experts
and combine (``token_combine``) in one ``custom_forward`` under ``tensor_parallel.checkpoint``
(NVIDIA/Megatron-LM d98e8a64, megatron/core/transformer/moe/moe_layer.py:658-719, 496-505,
573-579), so its recompute, just before the layer's backward, runs all of them again:
the router (``router_s``) and its scores' kernel, the forward's dispatch, the experts'
forward (their GEMMs and page reads, as the forward's) with their activation and
permutation kernels, and the forward's combine - the planned ops once more on the
network, timed as every exchange is (micro-batched as the layer's), in the backward's
stages (route_backward, dispatch_backward, experts_backward, combine_backward). The
planner plans those bytes once: the byte ledger (``bytes_by_stage``, ``bytes_by_level``)
counts the exchange once, the links (``wire_bytes_by_level``) carry it twice. Its rows'
recomputed activations are held from its experts' recompute to the route_backward. The
recompute's host work (measured profiles' stage costs) is not charged.

The exchange kernels' SMs: DeepEP's kernels (``comm.token_strategy = "deepep"``) hold
``comm.deepep_sms`` of the GPU's ``compute.sm_count`` SMs while they run (DeepSeek-V3
section 3.2.2: 20 of 132), NCCL's (alltoall and allgather) the profile's
``collectives.kernel_sms`` (one CTA a channel, each on an SM of its own: nccl#689), so
compute that runs beside them runs on the rest, at ``1 - f`` of its speed
(f = SMs / sm_count; ``sm_slowed``). Beside them means the micro-batched
exchange (M22): micro-batch j's experts run while the comm stream carries micro-batch
j-1's combine and j+1's dispatch, and the shared experts beside the dispatch or the
combine; in the in-order chain nothing else overlaps them. The overlap is taken as those
ops' time alone on the fabric (``op_seconds``), both starting with the compute. Left out:
a pipeline's sends beside the compute.

NCCL's SMs under the sync stream (the profile's ``collectives.kernel_sms``): the gradient
sync overlapped with the backward and the parameter all-gathers with the forward
(``overlap.sync_with_backward``, ``sim.step.param_gather``) run NCCL kernels on the sync
stream; each sync op adds its time alone to a [W] budget, and the compute phases issued
after it run beside it, at ``1 - f`` of their speed until the budget is used up
(``beside_sync``). Taken as if the sync ran from its issue and nothing but compute ran
meanwhile: where the backward's exchanges run between, the slowdown is at most
``f`` of the sync's time too much. Not in a pipeline stage's micro-batch (``pipeline_stage``):
its backward stands for every micro-batch's, while the sync runs beside the last one's only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from sim.hardware.compute import ComputeModel
from sim.hardware.dense_layers import DenseLayers, kernel_seconds
from sim.hardware.shared_experts import SharedExperts
from sim.step.context_parallel_ring import chain_block
from sim.step.kernel_sms import exchange_sm_share, sm_slowed
from sim.step.param_gather import ParamGathers
from sim.step.phase_sizes import batches, buffer_bytes, defrag_pages, page_copy, split_op
from sim.step.phases import Phase, StepDecisions, unhidden_seconds
from testbed.core.stages import STAGES
from testbed.model.fp8_casts import cached_input_bytes, linears_copy_bytes
from testbed.model.memory_bound_kernels import expert_row_kernel_bytes, router_bytes, token_slot_bytes
from testbed.model.recompute_modules import LayerRecompute
from testbed.model.whole_model import (
    block_grad_bytes,
    expert_row_bytes,
    expert_row_elements,
    moe_layer_shape,
    recompute_modules_of,
    recompute_savings,
    shape_of,
    shared_expert_grad_bytes,
    zero_shards,
)
from testbed.policy.collectives import CollectiveOp
from testbed.policy.distributed_optimizer import split_param_gathers
from testbed.policy.expert_tensor_parallel import expert_slice_shape, expert_zero_shards
from testbed.policy.page_moves import GPU, HOST
from testbed.policy.pager_pool import MovesByRank
from testbed.policy.step_decisions import LayerForward, SyncPlan
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


class PhaseBuilder:
    """Builds the phases of one step from the controller's decisions.

    Memory per GPU (bytes) is annotated on the phases: page slots taken and freed by the
    copies; activations saved by a layer's forward (its input, and per expert row the
    expert input, first GEMM's output and output: ``expert_row_elements``; the shared
    experts') until its backward is done, with fp8 GEMMs the fp8 copies of the weights
    it computed with besides; expert, shared-expert and router gradients from the
    backward to the optimizer; send and receive buffers while collectives run. Plain SGD
    keeps no optimizer state.
    """

    def __init__(self, scenario: Scenario, layout: Layout, compute: ComputeModel,
                 group_create_s: float, copy_overlap: float, create_on_all_ranks: bool = True,
                 host_s: dict[str, float] | None = None,
                 copy_time: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None = None,
                 scale_fitted: bool = False, sm_count: int = 0, nccl_sms: int = 0,
                 op_seconds: Callable[[list[CollectiveOp]], np.ndarray] | None = None,
                 model: Scenario | None = None, pipeline_stage: bool = False):
        """``scenario``: the controller's (its MoE layers, ``testbed.model.mtp_layers``);
        ``model``: the model's, when that is not ``scenario`` (MTP modules; the dense work's
        figures are the model's, ``sim.hardware.dense_layers``); ``copy_overlap``: the
        profile's ``copy.overlap`` (``sim.step.phases``); ``copy_time(h2d, d2h, pages)``:
        [W] seconds of a copy of those bytes and pages on each rank's PCIe links, as the
        executors time it (needed when 0 < copy_overlap < 1);
        ``scale_fitted``: the compute model's contention factor is fitted, not measured at
        this world (``sim.hardware.software_latency.compute_scale_fitted``), so every compute
        second is; ``sm_count``, ``nccl_sms``: the profile's ``compute.sm_count`` and
        ``collectives.kernel_sms`` (the exchange kernels' SMs, module doc);
        ``op_seconds(ops)``: [W] seconds of a batch of concurrent ops on each member, each
        op alone on the fabric (needed for the exchange kernels' SMs with micro-batches); ``pipeline_stage``:
        the step is one micro-batch of a pipeline stage's (``sim.pipeline.run``; the updated
        parameters' all-gathers, ``sim.step.param_gather``)."""
        self.s, self.layout, self.compute = scenario, layout, compute
        self.pipeline_stage = pipeline_stage
        #: stage -> (host seconds per call, host seconds per byte of the stage's work): measured
        self.host_s = host_s or {}
        self.group_create_s = group_create_s
        self.create_on_all_ranks = create_on_all_ranks
        if 0 < copy_overlap < 1 and copy_time is None:
            raise ValueError("a copy overlap below 1 needs copy_time, to time the copies' unhidden share")
        self.copy_overlap, self.copy_time = float(copy_overlap), copy_time
        self.copies_overlap = copy_overlap > 0  # copies on the copy stream, beside the in-order work
        self.scale_fitted = scale_fitted
        #: the share of the SMs the token exchange's kernels hold (module doc); 0: they slow no compute
        self.sm_share = exchange_sm_share(scenario, sm_count, nccl_sms)
        self.sm_count = sm_count
        #: the share of the SMs NCCL's kernels hold (the gradient sync's and the parameter gathers' on the
        #: sync stream, whatever the token strategy), and [W] seconds of sync ops issued and not yet run
        #: beside compute (module doc)
        self.nccl_share = nccl_sms / sm_count if 0 < nccl_sms < sm_count and not pipeline_stage else 0.0
        self.sync_beside = np.zeros(layout.world)
        #: the shared experts of each MoE layer (sim.hardware.shared_experts), and whether they overlap the exchange
        self.shared = SharedExperts(scenario, compute)
        self.shared_overlap = self.shared.enabled and scenario.overlap.shared_experts
        if self.sm_share > 0 and (scenario.overlap.micro_batches > 1 or self.shared_overlap) and op_seconds is None:
            raise ValueError("the exchange kernels' SMs beside micro-batched or shared experts need op_seconds, "
                             "to time the overlap")
        if scenario.overlap.tp_comm and sm_count > 0 and op_seconds is None:
            raise ValueError("overlap.tp_comm's reduce-scatters beside the compute need op_seconds, to time the overlap")
        self.op_seconds = op_seconds
        m, w = scenario.model, layout.world
        #: expert TP: each GPU holds 1/etp of every local expert, its inner dimension ``expert_ffn``
        #: (``testbed.policy.expert_tensor_parallel``), and computes it on its ETP group's rows
        self.etp = layout.etp_size
        self.expert_ffn = m.ffn_hidden_size // self.etp
        # device bytes of one page slot: a page, or a whole expert smaller than a page (RankPager.slot_bytes)
        self.page_bytes = min(scenario.pager.page_size_bytes, m.expert_bytes)
        # pages an expert's weights are read or updated in (real/paging/paged_store.py); unpaged: one tensor
        self.pages_per_expert = -(-m.expert_bytes // self.page_bytes) if scenario.pager.enabled else 0
        self.router_s = np.full(w, compute.router_time(scenario.workload.tokens_per_rank, m.hidden_size, m.num_experts))
        #: memory-bound kernels (testbed.model.memory_bound_kernels): in the route, the router's softmax and
        #: top-k on the rank's tokens and the permutation and its inverse of their top_k slots each (the
        #: inverse runs after the combine; timed here); per expert row its activation, and its sort by
        #: local expert when the GPU holds more than one and rows arrive from other GPUs
        shape = moe_layer_shape(scenario)
        router_kernels, slots = router_bytes(shape), token_slot_bytes(shape, m.dtype_bytes)
        tokens = scenario.workload.tokens_per_rank
        kernel_f = tokens * (router_kernels.forward_token + m.top_k * slots.forward_row)
        kernel_b = tokens * (router_kernels.backward_token + m.top_k * slots.backward_row)
        #: the route's backward: the gate GEMM's two and the kernels' backward
        self.router_backward_s = 2 * self.router_s + compute.memory_seconds(kernel_b)
        self.router_s = self.router_s + compute.memory_seconds(kernel_f)
        self.row_kernels = expert_row_kernel_bytes(shape, m.dtype_bytes,
                                                   layout.ep_size > 1 and layout.experts_per_rank > 1,
                                                   expert_ffn=m.ffn_hidden_size // layout.etp_size)
        self.router_grad_bytes = (m.hidden_size * m.num_experts + m.num_experts) * 4
        self.local = np.array([list(layout.local_experts(r)) for r in range(w)])  # [W, E/P]
        self.dense = DenseLayers(model or scenario, compute)  # the whole transformer's non-MoE work (issue 13)
        self.zero = zero_shards(scenario)  # ZeRO: (dense state, expert state, dense grad, expert grad) shards
        if self.etp > 1:  # an expert slice's are over its expert-DP group
            state, grad = expert_zero_shards(scenario, w)
            self.zero = (self.zero[0], state, self.zero[2], grad)
        #: bytes of each layer block's gradients a GPU keeps (its ZeRO-2 shard): the whole transformer's
        #: dense ones and the shared experts' (freed by the optimizer), the dense ones alone (dense_backward's);
        #: over the controller's layers, as its planner's buckets sum them
        self.block_grads = [block_grad_bytes(scenario, layer) / self.zero[2] for layer in range(m.num_layers)]
        self.shared_grads = shared_expert_grad_bytes(scenario) / self.zero[2]
        self.dense_block_grads = [g - self.shared_grads for g in self.block_grads]
        moe = expert_slice_shape(moe_layer_shape(scenario), self.etp)  # a GPU's slice of each routed expert
        #: a routed expert's parameters outside its pages (``model.ffn_bias``: (matrices - 1) F + H biases)
        self.expert_bias_params = moe.expert_params - moe.expert_matrix_params
        #: parameters of a routed expert's matrices on a GPU (1/etp of the expert's)
        self.expert_matrix_params = moe.expert_matrix_params
        #: bytes of a routed expert's weights, gradient or optimizer update: its pages' and its biases'
        self.expert_update_bytes = (m.expert_bytes // self.etp) + self.expert_bias_params * m.dtype_bytes
        #: bytes of weights every GPU holds outside the pages besides the routers and the dense ones: the
        #: shared experts' (whole) and the local routed experts' biases
        self.extra_param_bytes = m.num_layers * (self.shared.params + self.local.shape[1] * self.expert_bias_params) \
            * m.dtype_bytes
        #: fp8 GEMMs: bytes of one routed expert's fp8 weight copies, held from its forward to its backward
        self.expert_copy_bytes = (float(linears_copy_bytes(moe.ffn_linears(self.expert_ffn), m.fp8_scaling))
                                  if compute.fp8 else 0.0)
        self._recompute_modules(scenario)

    def _recompute_modules(self, scenario: Scenario) -> None:
        """The recompute modules' figures of an MoE layer's routed experts (module doc)."""
        m = scenario.model
        self.modules = recompute_modules_of(scenario)  # Megatron-Core's recompute modules, in order
        #: bytes an expert row keeps: without recompute modules, and with them
        self.full_row_bytes = float(expert_row_elements(m.hidden_size, self.expert_ffn, m.ffn_matrices)
                                    * m.dtype_bytes)
        self.row_bytes = self.full_row_bytes
        #: what moe's and moe_act's recomputes run again per token and row (the shared experts' aside)
        self.moe_work = self.moe_act_work = None
        # fp8 GEMMs: the rows' GEMM inputs kept quantized (testbed.model.fp8_casts.cached_input_bytes)
        fp8_input = cached_input_bytes(m.fp8_scaling) if self.compute.fp8 else 0.0
        if not self.modules and not fp8_input:
            return
        shape, seq_len = expert_slice_shape(shape_of(scenario), self.etp), scenario.transformer.seq_len
        saved = recompute_savings(shape, True, self.modules, seq_len, m.dtype_bytes, fp8_input_bytes=fp8_input)
        self.row_bytes = expert_row_bytes(m.hidden_size, self.expert_ffn, m.ffn_matrices, m.dtype_bytes, saved.row)
        if not self.modules:
            return
        routed = LayerRecompute(replace(shape, shared_experts=0), True, seq_len)  # the shared experts: theirs
        if "moe" in self.modules:  # its one token GEMM is the router's, timed as the route's (router_s)
            self.moe_work = routed.work("moe")
        if "moe_act" in self.modules:
            self.moe_act_work = routed.work("moe_act")

    # ---- sizes ------------------------------------------------------------------------------
    def expert_rows(self, fwd: LayerForward) -> np.ndarray:
        """[W, E/P] rows each local expert computes: kept slots of the rank's EP group; with
        expert TP those of its ETP group's EP groups (the rows the ETP all-gather brings)."""
        per_group = fwd.kept[self.layout.rank_of].sum(axis=1)  # [R, E]
        rows = np.take_along_axis(per_group[self.layout.group_of], self.local, axis=1)
        return rows[self.layout.etp_members].sum(axis=1) if self.etp > 1 else rows

    def expert_seconds(self, rows: np.ndarray, backward: bool) -> np.ndarray:
        """[W] seconds of a layer's experts on each rank: the GEMMs, and reading the weights
        of every expert that computes from its pages (forward, and again in the backward)."""
        m = self.s.model
        gemm = self.compute.expert_times(rows, m.hidden_size, self.expert_ffn, self.s.sim.expert_kernel, backward,
                                         m.ffn_matrices)
        per_row = self.row_kernels.backward_row if backward else self.row_kernels.forward_row
        kernels = self.compute.memory_seconds(rows.sum(axis=1) * per_row)
        return gemm + kernels + self.page_read_seconds(rows)

    def page_read_seconds(self, rows: np.ndarray) -> np.ndarray:
        """[W] host seconds of reading the pages of every expert that computes, once
        (``copy.read_page_us``, a fitted constant of calibrated CPU profiles; 0 on GPUs)."""
        return self.compute.page_read_time((rows > 0).sum(axis=1) * self.pages_per_expert)

    def expert_fitted_seconds(self, rows: np.ndarray, seconds: np.ndarray, backward: bool) -> np.ndarray:
        """[W] seconds of the experts' ``seconds`` that come from fitted constants: all of
        them with a fitted compute scale, else their page reads (twice in a backward with
        full recompute: its forward reads them again)."""
        if self.scale_fitted:
            return seconds
        return self.page_read_seconds(rows) * (2 if backward and self.recompute else 1)

    @property
    def recompute(self) -> bool:
        """Full activation recompute (whole transformer): every layer, MoE ones included,
        keeps only its input and runs its forward again in the backward."""
        return self.s.transformer.enabled and self.s.transformer.recompute == "full"

    def activation_bytes(self, rows: np.ndarray) -> np.ndarray:
        """[W] bytes an MoE layer's forward keeps for its backward: its input and, per
        expert row, the expert's input, first GEMM's output and activation
        (``testbed.model.whole_model.expert_row_elements``; with full recompute, the input
        only; with recompute modules less what they free, and with fp8 GEMMs the GEMM inputs
        quantized: ``row_bytes``). The shared experts' are ``SharedExperts.activation_bytes``."""
        m = self.s.model
        per_row = 0.0 if self.recompute else self.row_bytes
        return self.s.workload.tokens_per_rank * m.hidden_size * m.dtype_bytes + rows.sum(axis=1) * per_row

    def fp8_copy_bytes(self, rows: np.ndarray) -> np.ndarray:
        """[W] bytes of the fp8 weight copies of a layer's routed experts that compute (0
        without fp8 GEMMs), held from the layer's forward to its backward."""
        return (rows > 0).sum(axis=1) * self.expert_copy_bytes

    def expert_backward_seconds(self, rows: np.ndarray) -> np.ndarray:
        """[W] seconds of a layer's experts' backward (with full recompute, their forward
        first; with ``moe_act``, each row's activation recomputed besides)."""
        seconds = self.expert_seconds(rows, True)
        if self.moe_act_work is not None:
            seconds = seconds + kernel_seconds(self.compute, rows.sum(axis=1) * self.moe_act_work.row_kernel_elements)
        return seconds + self.expert_seconds(rows, False) if self.recompute else seconds

    def recomputed_bytes(self, rows: np.ndarray) -> np.ndarray:
        """[W] bytes of an MoE layer's expert rows that ``moe``'s recompute makes again,
        held from its experts' recompute to the layer's route_backward (0 without ``moe``)."""
        if self.moe_work is None:
            return np.zeros(self.layout.world)
        return rows.sum(axis=1) * (self.full_row_bytes - self.row_bytes)

    def moe_recompute(self, fwd: LayerForward, rows: np.ndarray, copy: int, n: int) -> None:
        """``moe``'s recompute of layer ``fwd.layer``'s MoE FFN before its backward (module
        doc): the router, its dispatch, the experts (once the layer's pages are back:
        ``copy``) and its combine once more, in ``n`` micro-batches as the layer's exchange."""
        w, layer = self.layout.world, fwd.layer
        # the forward's own times again: the router's with its scores' and permutation's kernels, the
        # experts' with their activations and sorts (testbed.model.memory_bound_kernels)
        self.chain("route_backward", layer, "compute", "compute", seconds=self.router_s)
        x = self.expert_seconds(rows, False)
        fitted = x if self.scale_fitted else self.page_read_seconds(rows)
        share = np.divide(fitted, x, out=np.zeros(w), where=x > 0)
        # the planner's ops once more, new objects (an op's members meet once per phase)
        dispatch = [replace(op, label=f"{op.label} (moe recompute)") for op in fwd.dispatch_ops]
        combine = [replace(op, label=f"{op.label} (moe recompute)") for op in fwd.combine_ops]
        self._exchange(layer, "dispatch_backward", dispatch, "experts_backward", x, self.recomputed_bytes(rows),
                       fitted, share, "combine_backward", combine, n, copy, None)

    # ---- building ---------------------------------------------------------------------------
    def build(self, d: StepDecisions) -> list[Phase]:
        self.phases: list[Phase] = []
        self.sync_beside = np.zeros(self.layout.world)
        self.main = -1  # last phase of the in-order chain
        s, m, w = self.s, self.s.model, self.layout.world
        n = s.overlap.micro_batches
        rows = {f.layer: self.expert_rows(f) for f in d.forward}
        act = {layer: self.activation_bytes(r) for layer, r in rows.items()}
        held = {layer: a + self.fp8_copy_bytes(rows[layer]) for layer, a in act.items()}  # with the fp8 copies
        #: [W] bytes of each layer's fp8 weight copies among what its forward phases hold (routed experts', shared
        #: experts', dense block's): made once a step and reused by every micro-batch, so a pipeline stage holds
        #: them once (sim.pipeline.stage_work)
        self.layer_fp8_copy_bytes = {
            layer: self.fp8_copy_bytes(r) + (self.shared.fp8_copy_bytes if self.shared.enabled else 0.0)
            + (self.dense.held_bytes[layer] - self.dense.activation_bytes[layer] if self.dense.enabled else 0.0)
            for layer, r in rows.items()}
        grads = {layer: (r > 0).sum(axis=1) * self.expert_update_bytes / self.zero[3] for layer, r in rows.items()}
        self.host_bytes = {st: 0.0 for st in STAGES}  # mean over ranks of the work each stage handled
        tokens = np.full(w, s.workload.tokens_per_rank * m.hidden_size * m.dtype_bytes, dtype=float)
        prefetched = -1  # the copy phase of the last layer's prefetch for this one (M14)
        dense = self.dense
        forward_of = {f.layer: f for f in d.forward}
        # the distributed optimizer's gradient sums and its all-gathers of updated parameters (sim.step.param_gather)
        expert_sums, expert_gathers = split_param_gathers(d.sync.expert_sync_ops)
        dense_sums, dense_gathers = split_param_gathers(d.sync.dense_sync_ops)
        gathers = ParamGathers(self, dense_gathers, expert_gathers, s.transformer.overlap_param_gather,
                               self.pipeline_stage)
        for f in d.forward:
            gathers.before_forward(f.layer)
            if dense.enabled:  # the layer's attention and the dense layers before it (MTP: projection, attention)
                self.host("dense", f.layer, tokens)
                # tensor parallelism's collectives after the compute (not overlapped), context parallelism's ring
                chain_block(self, "dense", f.layer, dense.forward_s[f.layer], dense.held_bytes[f.layer], f.dense_ops,
                            dense.ring_core_s(f.layer, backward=False))
            self.host("route", f.layer, tokens)
            self.chain("route", f.layer, "compute", "compute", seconds=self.router_s)
            self.chain("route", f.layer, "ops", "comm", ops=f.route_ops)
            moved = page_copy(f.page_moves, w)
            self.host("paging", f.layer, moved[0] + moved[1] + buffer_bytes(f.refresh_ops, w))
            for batch in batches(f.refresh_ops):  # the requests, then the copies they ask for
                self.chain("paging", f.layer, "ops", "comm", ops=batch)
            if f.heat is not None:  # heat.deferred (M18): the last step's heat update, here
                self.heat_phase(f.layer, f.heat_ops, d.probe_s)
            x_seconds = self.expert_seconds(rows[f.layer], False)
            x_fitted = self.expert_fitted_seconds(rows[f.layer], x_seconds, False)
            pipe = self.page_pipeline(f, rows[f.layer], moved, x_seconds) if n == 1 else None
            copy = self.copy_phase(f.layer, moved) if pipe is None else pipe[0]
            if copy < 0 and pipe is None:  # nothing loads on demand: the experts wait for what came ahead (M14)
                copy = prefetched
            prefetched = -1
            # after the layer's own copies on the copy stream, so its experts do not wait for them:
            # a deferred heat update's moves (M18), then the next layer's prefetch (M14)
            for extra, is_prefetch in ((f.heat_moves, False), (f.prefetch_moves, True)):
                if not extra.empty:
                    extra_moved = page_copy(extra, w)
                    self.host("paging", f.layer, extra_moved[0] + extra_moved[1])
                    phase = self.copy_phase(f.layer, extra_moved)
                    prefetched = phase if is_prefetch else prefetched
            self.exchange(f.layer, ("dispatch", f.dispatch_ops), ("experts", x_seconds, held[f.layer], x_fitted),
                          ("combine", f.combine_ops), n, copy, pipeline=pipe,
                          shared=self.shared_parts(backward=False))
        #: the output head's phases (its forward and backward, their host work): those after the
        #: last MoE layer's forward (sim.pipeline.run tells them from the MTP modules' layers')
        self.head_phases = range(len(self.phases), len(self.phases))
        if dense.enabled:  # the output head and the loss, forward then backward
            head_from = len(self.phases)
            self.host("dense", m.num_layers - 1, tokens)
            self.chain("dense", m.num_layers - 1, "compute", "compute", seconds=np.full(w, dense.head_forward_s),
                       mem_delta=np.full(w, dense.head_held_bytes))
            self.host("dense_backward", m.num_layers - 1, tokens)
            self.chain("dense_backward", m.num_layers - 1, "compute", "compute",
                       seconds=np.full(w, dense.head_backward_s), mem_delta=np.full(w, -dense.head_held_bytes))
            self.head_phases = range(head_from, len(self.phases))
        sync_phases: list[int] = []
        overlap_sync = s.overlap.sync_with_backward or s.transformer.overlap_grad_reduce  # Megatron-Core's name
        creating = self.creation_seconds(d.sync)
        discovery = [op for op in expert_sums if op.layer < 0]  # M10, once the forward is done
        expert_ops = [op for op in expert_sums if op.layer >= 0]
        if overlap_sync and discovery:
            sync_phases.append(self.add("expert_sync", -1, "ops", "sync", (self.main,), ops=discovery))
        if overlap_sync and creating.any():  # communicators can be made once discovery knows A_e
            deps = (self.main,) + ((sync_phases[-1],) if sync_phases else ())
            sync_phases.append(self.add("expert_sync", -1, "wait", "sync", deps, seconds=creating))
        for layer in reversed(range(m.num_layers)):
            b = d.backward[layer]
            moved = page_copy(b.page_moves, w)
            self.host("paging", layer, moved[0] + moved[1])
            copy = self.copy_phase(layer, moved)
            if self.moe_work is not None:  # moe's recompute: the MoE FFN's forward again, once its pages are back
                self.moe_recompute(forward_of[layer], rows[layer], copy, n)
            xb_seconds = self.expert_backward_seconds(rows[layer])
            self.exchange(layer, ("combine_backward", b.combine_backward_ops),
                          ("experts_backward", xb_seconds, grads[layer],
                           self.expert_fitted_seconds(rows[layer], xb_seconds, True)),
                          ("dispatch_backward", b.dispatch_backward_ops), n, copy, act[layer],
                          shared=self.shared_parts(backward=True))
            self.host("route_backward", layer, tokens)
            freed = held[layer] + self.recomputed_bytes(rows[layer]) if self.moe_work is not None else held[layer]
            self.chain("route_backward", layer, "compute", "compute", seconds=self.router_backward_s,
                       mem_delta=self.router_grad_bytes - freed)
            if dense.enabled:  # the block's backward: its activations go, its gradients come
                self.host("dense_backward", layer, tokens)
                chain_block(self, "dense_backward", layer, dense.backward_s[layer],
                            self.dense_block_grads[layer] - dense.held_bytes[layer], b.dense_ops,
                            dense.ring_core_s(layer, backward=True))
            if overlap_sync:  # this layer's gradients are complete: sync them meanwhile
                for stage, ops in (("expert_sync", expert_ops), ("dense_sync", dense_sums)):
                    for batch in batches([op for op in ops if op.layer == layer]):
                        deps = (self.main,) + ((sync_phases[-1],) if sync_phases else ())
                        sync_phases.append(self.add(stage, layer, "ops", "sync", deps, ops=batch,
                                                    mem_transient=buffer_bytes(batch, w)))
        self.host("expert_sync", -1, buffer_bytes(d.sync.expert_sync_ops, w))
        if not overlap_sync:
            self.chain("expert_sync", -1, "ops", "comm", ops=discovery)
            if creating.any():
                self.chain("expert_sync", -1, "wait", "comm", seconds=creating)
            for batch in batches(expert_ops):
                self.chain("expert_sync", batch[0].layer, "ops", "comm", ops=batch)
            self.host("dense_sync", -1, buffer_bytes(d.sync.dense_sync_ops, w))
            for batch in batches(dense_sums):
                self.chain("dense_sync", batch[0].layer, "ops", "comm", ops=batch)
        else:
            self.host("dense_sync", -1, buffer_bytes(d.sync.dense_sync_ops, w))
        n_updated = np.zeros(w)  # local expert instances whose weights the step changes
        for r, inst in d.sync.updated.items():
            n_updated[r] = len(inst)
        updated = n_updated * self.expert_update_bytes
        self.host("optimizer", -1, updated)
        update = self.compute.page_update_time(n_updated * self.pages_per_expert)  # page by page (fitted)
        opt = self.optimizer_seconds(n_updated) + update
        deps = (self.main,) + ((sync_phases[-1],) if sync_phases else ())
        all_grads = sum(grads.values()) + self.router_grad_bytes * m.num_layers
        if dense.enabled or self.shared.enabled:
            all_grads = all_grads + sum(self.block_grads)
        self.main = self.add("optimizer", -1, "compute", "compute", deps, seconds=opt, mem_delta=-all_grads,
                             fitted_s=update)
        gathers.after_optimizer()  # the updated parameters, unless the next forward gathers them
        self.host("heat", -1, np.zeros(w))
        if d.end.heat is not None:
            self.heat_phase(-1, d.end.heat_ops, d.probe_s)
        moved = page_copy(MovesByRank.concat([d.sync.page_moves, d.end.page_moves]), w)
        self.host("paging", -1, moved[0] + moved[1])
        self.copy_phase(-1, moved)
        compacted = defrag_pages(d.end.page_moves, w)
        if compacted.any():  # M17: device to device on the copy stream; the next step's loads queue behind it
            seconds = self.compute.defrag_time(compacted * self.page_bytes)
            self.add("paging", -1, "wait", "copy", (self.main,), seconds=seconds,
                     fitted_s=seconds if self.scale_fitted else None)
        return self.phases

    def optimizer_seconds(self, n_updated: np.ndarray) -> np.ndarray:
        """[W] seconds of the optimizer step: the updated experts' weights and the routers
        by SGD, or with the whole transformer's Adam (``transformer.optimizer``) every
        parameter the rank holds (its experts, the dense ones) by mixed-precision Adam."""
        m, t = self.s.model, self.s.transformer
        router_bytes = self.router_grad_bytes * m.num_layers
        shared = m.num_layers * self.shared.params  # whole on every rank
        if not t.enabled or t.optimizer == "sgd":
            dense = self.dense.param_bytes if t.enabled else 0.0
            if shared:
                dense += shared * m.dtype_bytes
            return np.array([self.compute.optimizer_time(b + router_bytes + dense)
                             for b in n_updated * self.expert_update_bytes])
        dense_shard, expert_shard, _, _ = self.zero  # ZeRO: each rank updates its shard
        experts = n_updated * (self.expert_matrix_params + self.expert_bias_params)
        params = experts / expert_shard + (self.dense.dense_params + self.dense.router_params + shared) / dense_shard
        return np.array([self.compute.adam_time(p, m.dtype_bytes, t.optimizer_state_bytes) for p in params])

    def heat_phase(self, layer: int, ops: list[CollectiveOp], probe_s: np.ndarray | None) -> None:
        """A heat update (M18-M20) in the chain: its all-reduces, then the scoring on the
        host and the probe activations on the GPUs holding the probed replicas."""
        w = self.layout.world
        self.chain("heat", layer, "ops", "comm", ops=ops)
        seconds = np.full(w, self.compute.heat_update_time(self.s.model.num_layers * self.s.model.num_experts))
        if probe_s is not None:
            seconds = seconds + probe_s
        self.chain("heat", layer, "compute", "compute", seconds=seconds)

    def creation_seconds(self, sync: SyncPlan) -> np.ndarray:
        """[W] seconds each rank spends creating the communicators the group cache missed
        (M10): all of them on every rank (torch new_group on gloo) or only those it is a
        member of (NCCL), as the profile says."""
        w = self.layout.world
        created = sync.cache.created if sync.cache else []
        if self.create_on_all_ranks:
            return np.full(w, len(created) * self.group_create_s)
        count = np.zeros(w)
        for members in created:
            count[list(members)] += 1
        return count * self.group_create_s

    def host(self, stage: str, layer: int, work_bytes: np.ndarray) -> None:
        """The host's cost of one call of ``stage`` on ``work_bytes`` [W] of data (measured
        profiles only): a fixed part and a part per byte."""
        self.host_bytes[stage] += float(np.mean(work_bytes))
        fixed, per_byte = self.host_s.get(stage, (0.0, 0.0))
        seconds = fixed + per_byte * work_bytes
        if np.any(seconds > 0):
            self.chain(stage, layer, "compute", "compute", seconds=seconds, fitted=True)

    def add(self, stage, layer, kind, stream, deps, **data) -> int:
        if kind == "ops" and "mem_transient" not in data:
            data["mem_transient"] = buffer_bytes(data["ops"], self.layout.world)
        if self.nccl_share > 0:
            self.beside_sync(kind, stream, data)
        if kind == "compute" and self.scale_fitted and not data.get("fitted"):
            data["fitted_s"] = data["seconds"]  # every compute second is scaled by the fitted factor
        self.phases.append(Phase(stage, layer, kind, stream, tuple(x for x in deps if x >= 0), **data))
        return len(self.phases) - 1

    def beside_sync(self, kind: str, stream: str, data: dict) -> None:
        """NCCL's SMs under the sync stream (module doc): a sync op adds its time alone to what
        runs beside the compute; a compute phase after it runs on the SMs left while that lasts
        (``sm_slowed``) and uses it up."""
        if kind == "ops" and stream == "sync" and self.op_seconds is not None:
            self.sync_beside = self.sync_beside + self.batch_seconds(data["ops"])
        elif kind == "compute" and stream == "compute" and self.sync_beside.any():
            slowed = sm_slowed(np.asarray(data["seconds"], dtype=np.float64), self.sync_beside, self.nccl_share)
            self.sync_beside = np.maximum(self.sync_beside - slowed, 0.0)
            data["seconds"] = slowed

    def chain(self, stage, layer, kind, stream, **data) -> int:
        """A phase after the previous one of the in-order chain; it becomes the chain's end.
        Empty op batches are left out."""
        if kind == "ops" and not data.get("ops"):
            return self.main
        self.main = self.add(stage, layer, kind, stream, (self.main,), **data)
        return self.main

    def copy_phase(self, layer: int, moved) -> int:
        """Page moves of a layer (or the step's end), as ``page_copy`` counted them: on the
        copy stream beside the dispatch when copies overlap compute on this machine, else
        in the chain. Returns the phase, or -1 when they copy nothing and free no slot."""
        h2d, d2h, pages, slots = moved
        if not pages.any() and not slots.any():
            return -1
        data = dict(h2d=h2d, d2h=d2h, pages=pages, mem_delta=slots * self.page_bytes)
        if self.copies_overlap and layer >= 0:
            return self.overlapped_copy(layer, (self.main,), **data)
        return self.chain("paging", layer, "copy", "copy", in_line=True, **data)

    def overlapped_copy(self, layer: int, deps: tuple[int, ...], **data) -> int:
        """A copy on the copy stream beside the in-order work, and the in-order work's wait
        for its unhidden share (``sim.step.phases``: ``(1 - copy.overlap)`` of its seconds,
        on the compute stream, in the chain; none when copies hide wholly). Returns the copy."""
        copy = self.add("paging", layer, "copy", "copy", deps, **data)
        if self.copy_overlap < 1:
            ph = self.phases[copy]
            seconds = unhidden_seconds(self.copy_time(ph.h2d, ph.d2h, ph.pages), self.copy_overlap)
            if np.any(seconds > 0):
                ph.hold = self.chain("paging", layer, "wait", "compute", seconds=seconds)
        return copy

    def page_pipeline(self, fwd: LayerForward, rows: np.ndarray, moved, x_seconds: np.ndarray):
        """M14 page pipelining of a layer's forward (``pager.pipeline_pages``, copies on the
        copy stream): the experts start once the first page a rank loads has arrived and
        compute page by page (``ComputeModel.block_slowdown``); the experts of pages
        already on the GPU compute at full width. As two copy phases (each rank's first
        loaded page, with its write-backs, then the rest) and two expert phases: all but
        the last block after the first page, the last block after the last page - the
        two-machine flow shop's bound max(first page + blocks, all pages) + last block.
        Returns (first copy, rest copy, [W] seconds before the last block, [W] the last
        block's seconds), or None when there is nothing to pipeline (the experts then
        wait for all their pages)."""
        s, m, w = self.s, self.s.model, self.layout.world
        if not (s.pager.enabled and s.pager.pipeline_pages and self.copies_overlap):
            return None
        h2d, d2h, pages, slots = moved
        loads = np.zeros(w, dtype=np.int64)
        loading = np.zeros(rows.shape, dtype=bool)  # [W, E/P] local experts with pages on the way
        for ranks, mv in fwd.page_moves.groups():
            load = (mv.src == HOST) & (mv.dst == GPU)
            loads[ranks] += int(load.sum())
            local = np.unique(mv.expert[load]) - fwd.layer * m.num_experts
            for r in ranks:
                loading[r, np.searchsorted(self.local[r], local)] = True
        if not loads.any():
            return None
        wait_rows = np.where(loading, rows, 0)
        blocked = self.expert_seconds(wait_rows, False) * self.compute.block_slowdown(
            m.hidden_size, m.ffn_hidden_size, self.page_bytes, m.ffn_matrices)
        ready = np.maximum(x_seconds - self.expert_seconds(wait_rows, False), 0.0)
        tail = np.divide(blocked, loads, out=np.zeros(w), where=loads > 0)
        share = np.divide(1.0, loads, out=np.ones(w), where=loads > 0)  # the first page's share of the moves
        first = self.overlapped_copy(fwd.layer, (self.main,), h2d=h2d * share, d2h=d2h * share,
                                     pages=pages * share, mem_delta=slots * self.page_bytes)
        rest = self.overlapped_copy(fwd.layer, (first,), h2d=h2d * (1 - share), d2h=d2h * (1 - share),
                                    pages=pages * (1 - share), mem_delta=np.zeros(w))
        return first, rest, ready + blocked - tail, tail

    def shared_parts(self, backward: bool):
        """The shared experts' work in a layer's exchange (``exchange``'s ``shared``):
        ([W] seconds beside the first exchange, [W] seconds beside the second, [W] bytes
        they leave allocated), or None without shared experts. Forward their activations
        and fp8 weight copies stay; backward those go and their gradients (ZeRO-2's shard)
        come."""
        if not self.shared.enabled:
            return None
        w, sh = self.layout.world, self.shared
        first, second = sh.backward_s if backward else sh.forward_s
        held = sh.activation_bytes + sh.fp8_copy_bytes
        mem = self.shared_grads - held if backward else held
        return np.full(w, first), np.full(w, second), np.full(w, mem)

    def shared_phase(self, stage, layer, deps, seconds, mem, beside_ops) -> int:
        """A shared-experts phase on the compute stream after ``deps``, beside ``beside_ops``
        (their SMs taken by the exchange's kernels: ``sm_slowed``)."""
        if self.sm_share > 0 and beside_ops:
            seconds = sm_slowed(seconds, self.batch_seconds(beside_ops), self.sm_share)
        return self.add(stage, layer, "compute", "compute", deps, seconds=seconds, mem_delta=mem)

    def exchange(self, layer, before, experts, after, n, copy, expert_work=None, pipeline=None, shared=None):
        """Token exchange -> experts -> token exchange, in n micro-batches (M22 when n > 1).

        Micro-batch i's experts wait for its first exchange (and the page loads); the comm
        stream runs B1, B2, A1, B3, A2, ... so the exchanges of one micro-batch overlap
        the experts of the previous one. ``experts`` = (stage, seconds [W], bytes the
        experts leave allocated [W], seconds of theirs from fitted constants [W]); each
        expert phase has that share of its seconds fitted. ``shared``: the shared experts'
        work (``shared_parts``), beside the first exchange (its first micro-batch) and the
        second (its last) with ``overlap.shared_experts``, else in the chain after the
        second exchange (forward) or before the first (backward).
        """
        (b_stage, b_ops), (x_stage, x_seconds, x_mem, x_fitted), (a_stage, a_ops) = before, experts, after
        w = self.layout.world
        fitted_share = np.divide(x_fitted, x_seconds, out=np.zeros(w), where=x_seconds > 0)
        work = x_mem if expert_work is None else expert_work  # the experts' activations
        for stage, size in ((b_stage, buffer_bytes(b_ops, w)), (x_stage, work), (a_stage, buffer_bytes(a_ops, w))):
            self.host(stage, layer, size)  # host work of the three stages, up front
        backward = x_stage == "experts_backward"
        beside = shared is not None and self.shared_overlap
        if shared is not None and not beside and backward:  # the shared experts' backward first, in the chain
            self.chain(x_stage, layer, "compute", "compute", seconds=shared[0] + shared[1], mem_delta=shared[2])
        if beside:  # the first part beside the first exchange (its first micro-batch)
            first_ops = b_ops if n == 1 else [split_op(op, n, 0) for op in b_ops]
            self.shared_phase(x_stage, layer, (self.main,), shared[0], np.zeros(w), first_ops)
        self._exchange(layer, b_stage, b_ops, x_stage, x_seconds, x_mem, x_fitted, fitted_share, a_stage, a_ops,
                       n, copy, pipeline)
        if beside:  # the second beside the second exchange (its last micro-batch), after the experts
            last_ops = a_ops if n == 1 else [split_op(op, n, n - 1) for op in a_ops]
            self.shared_phase(x_stage, layer, (self.x_last,), shared[1], shared[2], last_ops)
        elif shared is not None and not backward:  # after the combine, in the chain
            self.chain(x_stage, layer, "compute", "compute", seconds=shared[0] + shared[1], mem_delta=shared[2])

    def _exchange(self, layer, b_stage, b_ops, x_stage, x_seconds, x_mem, x_fitted, fitted_share, a_stage, a_ops,
                  n, copy, pipeline):
        """``exchange``'s exchanges and experts; ``x_last``: its last expert phase."""
        if n == 1:
            for batch in batches(b_ops):
                self.chain(b_stage, layer, "ops", "comm", ops=batch)
            if pipeline is not None:  # M14: from the first page on, the last block after the last page
                first, rest, before_last, last = pipeline
                head = self.add(x_stage, layer, "compute", "compute", (self.main, first),
                                seconds=before_last, waits_for_pages=first, fitted_s=before_last * fitted_share)
                self.main = self.add(x_stage, layer, "compute", "compute", (head, rest),
                                     seconds=last, mem_delta=x_mem, waits_for_pages=rest,
                                     fitted_s=last * fitted_share)
            else:
                self.main = self.add(x_stage, layer, "compute", "compute", (self.main, copy),
                                     seconds=x_seconds, mem_delta=x_mem, waits_for_pages=copy, fitted_s=x_fitted)
            self.x_last = self.main
            for batch in batches(a_ops):
                self.chain(a_stage, layer, "ops", "comm", ops=batch)
            return
        start = self.main
        comm_last, x_last = start, start
        b_end = [None] * n
        b_split = [[split_op(op, n, i) for op in b_ops] for i in range(n)]
        a_split = [[split_op(op, n, i) for op in a_ops] for i in range(n)]

        def comm(stage, ops, extra_dep):
            nonlocal comm_last
            for batch in batches(ops):
                comm_last = self.add(stage, layer, "ops", "comm", (comm_last, extra_dep), ops=batch)
            return comm_last

        for i in range(n + 1):
            if i < n:
                b_end[i] = comm(b_stage, b_split[i], start)
            if i >= 1:
                j = i - 1
                seconds = x_seconds / n
                if self.sm_share > 0:  # beside j-1's combine and j+1's dispatch (module doc)
                    beside = self.batch_seconds(a_split[j - 1] if j >= 1 else [])
                    beside = beside + self.batch_seconds(b_split[j + 1] if j + 1 < n else [])
                    seconds = sm_slowed(seconds, beside, self.sm_share)
                x_last = self.add(x_stage, layer, "compute", "compute", (b_end[j], x_last, copy),
                                  seconds=seconds, mem_delta=x_mem / n,
                                  waits_for_pages=copy if j == 0 else -1, fitted_s=x_fitted / n)
                comm(a_stage, a_split[j], x_last)
        self.x_last = x_last
        self.main = comm_last

    def batch_seconds(self, ops: list[CollectiveOp]) -> np.ndarray:
        """[W] seconds of ``ops`` on each rank, batch after batch, each op alone."""
        out = np.zeros(self.layout.world)
        for batch in batches(ops):
            out += self.op_seconds(batch)
        return out
