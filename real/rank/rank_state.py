"""What one rank of the real backend holds: its model state and how it moves weights.

``RankState`` owns the rank's controller (the shared policies, paging only this GPU),
process groups, counted collectives, stage clock, router parameters, and the expert
weights in a ``PagedExpertStore`` (or unpaged when ``pager.enabled`` is false). It
executes page moves and replica refreshes for the layers and the step loop.

Weights: expert instance i starts from a generator seeded by (run.seed, i), the same on
every replica and in the single-process reference; under expert tensor parallelism
(``parallelism.etp_size``) a rank holds its slice of that whole expert (``expert_slice_flat``),
so the split run starts where the unsplit one does. With ``real.check_weights`` the rank
keeps an unpaged copy that the step loop checks the pages against.

Checkpoints (M23) see the expert weights as *pages*: the store's pages, or one page per
expert instance when paging is off (``weight_pages`` / ``restore``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from real.comm.collectives import Comm, PayloadCodec
from real.comm.groups import Groups
from real.kernels.adam import MixedAdam
from real.kernels.experts import ExpertTimer, grouped_supported
from real.kernels.ffn_activation import input_width, split_ffn
from real.kernels.stacked_weights import StackedWeights, grouped_members, strided_rows
from real.paging.paged_store import PagedExpertStore
from real.rank.clock import StageClock
from real.rank.context_parallel import context_ring
from real.rank.dense_model import DenseModel, TensorGroup
from real.rank.layer import seed_of
from real.rank.shared_experts import SharedExperts
from testbed.policy.balance_losses import sequence_tokens
from testbed.policy.collectives import ByteLedger
from testbed.policy.controller import Controller
from testbed.policy.page_moves import PageMoves, add_reason_counts, page_move_count
from testbed.policy.pipeline_stages import StagePlace
from testbed.policy.router import init_router_params
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def initial_expert_flat(run_seed: int, instance: int, hidden: int, ffn: int, swiglu: bool = False) -> torch.Tensor:
    """Initial flat weights (w1 then w2, fp32) of expert instance ``instance``: w1 [H, W]
    (SwiGLU's gate and up side by side, ``real.kernels.ffn_activation``), w2 [F, H]."""
    g = torch.Generator().manual_seed(seed_of(run_seed, instance, 0xE4))
    w1 = torch.randn(hidden, input_width(ffn, swiglu), generator=g) / hidden ** 0.5
    w2 = torch.randn(ffn, hidden, generator=g) / ffn ** 0.5
    return torch.cat([w1.reshape(-1), w2.reshape(-1)])


def expert_slice_flat(flat: torch.Tensor, hidden: int, ffn: int, swiglu: bool, etp: int, index: int) -> torch.Tensor:
    """Slice ``index`` of ``etp`` of an expert's flat weights (``parallelism.etp_size``,
    ``testbed.policy.expert_tensor_parallel.expert_slice_shape``): the flat weights of an
    FFN of inner dimension ``ffn / etp``, w1's columns of that share of the inner dimension
    (SwiGLU's gate's and up's alike: its gate then its up, as ``real.kernels.ffn_activation``
    lays them out) and w2's rows of it; the whole expert for ``etp`` 1."""
    if etp == 1:
        return flat
    w1, w2 = split_ffn(flat, hidden, ffn, swiglu)
    part = ffn // etp
    cols = slice(index * part, (index + 1) * part)
    w1_part = torch.cat([w1[:, cols], w1[:, ffn:][:, cols]], dim=1) if swiglu else w1[:, cols]
    return torch.cat([w1_part.reshape(-1), w2[cols].reshape(-1)])


def initial_router(run_seed: int, layer: int, scenario: Scenario):
    g = torch.Generator().manual_seed(seed_of(run_seed, layer, 0x7047))
    m = scenario.model
    return init_router_params(m.hidden_size, m.num_experts, scenario.router, g)


@dataclass
class RankState:
    """Everything one rank holds; the layer runner and the step loop share it."""

    scenario: Scenario
    rank: int
    device: torch.device
    #: pipeline parallelism (testbed.policy.pipeline_stages): where this rank's stage sits; ``scenario``
    #: and ``rank`` are then the stage's own
    place: StagePlace | None = None
    #: the whole model's scenario, when ``scenario`` is the controller's with more MoE layers
    #: (MTP modules: ``testbed.model.mtp_layers.controller_scenario``); None: ``scenario``
    model: Scenario | None = None
    layout: Layout = field(init=False)

    def __post_init__(self):
        s = self.scenario
        self.dtype = TORCH_DTYPES[s.model.dtype]
        self.layout = Layout(s)
        self.controller = Controller(s, paged_ranks=[self.rank], layout=self.layout)
        self.planner = self.controller.planner
        self.origin = time.perf_counter()
        self.clock = StageClock(self.origin, cuda=self.device.type == "cuda")
        self.ledger = ByteLedger(self.layout)
        place = self.place
        #: the model's first layer in this rank's stage: seeds follow the model's layers and experts
        self.layer_offset = place.first_layer if place is not None else 0
        self.comm = Comm(self.rank, self.ledger, lambda: self.clock.current or "route",
                         p2p_all_to_all=s.real.network == "emulated",
                         global_rank=place.global_rank if place is not None else None)
        self.groups = Groups(self.planner, self.device, place)
        m = s.model
        self.codec = PayloadCodec(fp8_grad_scale(s)) if s.comm.payload_dtype == "fp8" else None
        self.timer = ExpertTimer(self.device.type == "cuda") if s.heat.compute_source == "measured" else None
        #: expert tensor parallelism (``parallelism.etp_size``): this rank holds slice ``etp_index`` of
        #: its shard's experts, FFNs of inner dimension ``expert_ffn`` and ``expert_elems`` weights each
        self.etp, self.etp_index = self.layout.etp_size, int(self.layout.etp_index[self.rank])
        self.expert_ffn = m.ffn_hidden_size // self.etp
        self.expert_elems = m.expert_params // self.etp
        self.grouped = grouped_supported(self.device, self.dtype, m.hidden_size, self.expert_ffn)
        self.swiglu = m.ffn_activation == "swiglu"  # the experts' activation (real.kernels.ffn_activation)
        # M22 local-first routing: router.local_bias on the logits of this rank's local experts
        self.local_bias_E = None
        if s.router.local_bias > 0:
            local = self.layout.local_expert_mask(s.router.local_scope)[self.rank]
            self.local_bias_E = torch.as_tensor(local * s.router.local_bias, dtype=torch.float32, device=self.device)
        #: tokens per sequence of the router's sequence-wise balance loss
        self.sequence_tokens = sequence_tokens(s)
        #: [L, E] this step's auxiliary-loss-free balancing bias (the same on every rank), on the
        #: device (``begin_step``); None when bias balancing is off
        self.balance_bias_LE: torch.Tensor | None = None
        self.router = []
        for layer in range(m.num_layers):
            w, b = initial_router(s.run.seed, layer + self.layer_offset, s)
            self.router.append((w.to(self.device).requires_grad_(), b.to(self.device).requires_grad_()))
        #: the step's ``real.comm.gradient_sync.GradientSync`` while the backward runs, else None
        self.sync_hooks = None
        self.backward_plans: dict | None = None  # layer -> its backward page plan, decided ahead
        self.force_blocks = False  # tests: compute every paged expert page by page (M14)
        # the router's kept counts checked against the controller's each layer: a testbed
        # self-check that reads the device back, so on CUDA only with real.check_weights
        self.self_check = self.device.type != "cuda" or s.real.check_weights
        self.blocked_experts = 0  # expert forwards computed page by page (M14)
        self.weight_copy_bytes = 0  # device bytes of expert weights copied to be computed on
        self.last_other_bytes = 0.0  # bytes besides pages at the last step's peak (M15's model on CPU)
        self._dense_params: list[torch.Tensor] | None = None
        #: every MoE layer's shared experts (model.shared_experts): whole on every rank, or split over its
        #: tensor-parallel group as the dense FFNs are
        self.shared = (SharedExperts(s, m.num_layers, self.dtype, self.device, self.layer_offset,
                                     tp=self._tensor_group(), clock=self.clock)
                       if m.shared_experts else None)
        # the whole transformer's dense weights (issue 13) and the optimizer's state
        self.dense = (DenseModel(self.model or s, self.dtype, self.device, self._tensor_group(), place,
                                 ring=context_ring(s, self.rank, self.comm)) if s.transformer.enabled else None)
        self.adam = MixedAdam(s) if s.transformer.enabled and s.transformer.optimizer == "adam" else None
        for layer in range(m.num_layers):
            for p in self.layer_params(layer):  # a bucket's all-reduce goes once its gradients are in
                p.register_post_accumulate_grad_hook(self._router_grad_ready)
        first = self.layer_offset * m.num_experts  # the model's instance number of this stage's first
        # each rank's slice of the same whole expert as the unsplit run's (expert TP 1: the whole)
        init = lambda i: expert_slice_flat(  # noqa: E731
            initial_expert_flat(s.run.seed, i + first, m.hidden_size, m.ffn_hidden_size, self.swiglu),
            m.hidden_size, m.ffn_hidden_size, self.swiglu, self.etp, self.etp_index)
        self.store = None
        self.unpaged: dict[int, torch.Tensor] = {}
        if s.pager.enabled:
            self.store = PagedExpertStore(self.controller.pager_of(self.rank), m.expert_params,
                                          self.dtype, self.device, init)
            self.store.page_events = s.pager.pipeline_pages
            self.page_elems = self.store.page_elems
        else:  # one tensor, a row per instance: a grouped GEMM reads its rows in place
            local = [int(i) for i in self.controller.local_instances(self.rank)]
            self.unpaged_rows = torch.stack([init(i) for i in local]).to(self.device, self.dtype) if local else None
            self.unpaged = {i: self.unpaged_rows[k] for k, i in enumerate(local)}
            self.page_elems = self.expert_elems
        self.shadow = ({int(i): init(int(i)).to(self.device, self.dtype)
                        for i in self.controller.local_instances(self.rank)}
                       if s.real.check_weights else None)
        if self.adam is not None:
            for k, p in enumerate(self.dense_params()):
                self.adam.add(("dense", k), p)
            for i in self.controller.local_instances(self.rank):
                self.adam.add(("expert", int(i)), init(int(i)).to(self.device))  # the state beside its weights
        self.modified: set[int] = set()  # unpaged instances changed since the last optimizer checkpoint
        self.grads: dict[int, torch.Tensor] = {}  # this step's expert weight gradients
        self.page_bytes = 0
        self.page_moves = 0
        self.moves_by_reason: dict[str, int] = {}
        self.stall_s = 0.0

    def _tensor_group(self) -> TensorGroup | None:
        """This rank's tensor-parallel group (``parallelism.tp_size`` > 1), else None."""
        if self.scenario.parallelism.tp_size == 1:
            return None
        (members,) = [g for g in self.planner.tp_groups() if self.rank in g]
        return TensorGroup(len(members), members.index(self.rank), members, self.groups.get(members), self.comm,
                           self.scenario.parallelism.sequence_parallel)

    def named_layer_params(self, layer: int) -> list[tuple[str, torch.Tensor]]:
        """(name, weight) of the weights besides routed experts whose gradients MoE layer
        ``layer``'s gradient bucket sums over all ranks (``Planner.layer_grad_bytes``), in
        bucket order: its router's, its shared experts' and, with the whole transformer,
        its block's (``DenseModel.named_layer_params``)."""
        w, b = self.router[layer]
        out = [(f"router{layer}.w", w), (f"router{layer}.b", b)]
        if self.shared is not None:
            out += self.shared.named_layer_params(layer)
        if self.dense is not None:
            out += self.dense.named_layer_params(layer)
        return out

    def layer_params(self, layer: int) -> list[torch.Tensor]:
        """The weights of ``named_layer_params``."""
        return [p for _, p in self.named_layer_params(layer)]

    def shared_params(self) -> list[torch.Tensor]:
        """Every shared expert's weights (none without them)."""
        if self.shared is None:
            return []
        return [p for layer in range(self.scenario.model.num_layers) for _, p in self.shared.named_layer_params(layer)]

    def named_params(self) -> dict[str, torch.Tensor]:
        """Every weight besides routed experts, by name (tests compare them with the reference's)."""
        return {k: p for layer in range(self.scenario.model.num_layers) for k, p in self.named_layer_params(layer)}

    def dense_params(self) -> list[torch.Tensor]:
        """Every weight besides experts: routers and the whole transformer's dense ones
        (the same tensors all run: checkpoints restore them in place)."""
        if self._dense_params is None:
            self._dense_params = [p for layer in range(self.scenario.model.num_layers) for p in self.layer_params(layer)]
        return self._dense_params

    def free_memory(self) -> dict[int, tuple[float, float]] | None:
        """M15, ``pager.free_memory = device``: {rank: (bytes free on the device outside the
        page pool, device bytes)}. CUDA: the allocator's - the driver's free memory plus what
        torch holds cached but unallocated. CPU: modelled, ``pager.device_memory_bytes``
        less the pool and what the last step held besides pages (activations, gradients)."""
        cfg = self.scenario.pager
        if self.store is None or cfg.free_memory != "device":
            return None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            return {self.rank: (float(free), float(total))}
        pool = self.store.pool.numel() * self.store.elem
        device = float(cfg.device_memory_bytes)
        return {self.rank: (device - pool - self.last_other_bytes, device)}

    def begin_step(self, step: int) -> None:
        """Fresh per-step counters: gradients, page moves, stall time, bytes."""
        self.controller.begin_step(step, self.free_memory())
        balance = self.controller.balance  # the bias moved at the last step's end (and restored on resume)
        if balance is not None:  # one copy to the device a step, not one a layer; every rank's is the same
            self.balance_bias_LE = torch.as_tensor(balance.bias, dtype=torch.float32, device=self.device)
        self.grads.clear()
        if self.etp > 1:  # a slice without rows still sums its (zero) gradient over its expert-DP group
            self.grads.update((int(i), torch.zeros(self.expert_elems, dtype=self.dtype, device=self.device))
                              for i in self.controller.local_instances(self.rank))
        self.page_moves, self.stall_s = 0, 0.0
        self.moves_by_reason = {}
        self.ledger = ByteLedger(self.layout)
        self.comm.ledger = self.ledger
        if self.device.type == "cuda":  # the step's own peak (StepRecord.peak_memory_bytes)
            torch.cuda.reset_peak_memory_stats(self.device)

    def balance_bias(self, layer: int) -> torch.Tensor | None:
        """[E] the routing bias of MoE layer ``layer`` this step (None: bias balancing off)."""
        return None if self.balance_bias_LE is None else self.balance_bias_LE[layer]

    # ---- expert weights ----------------------------------------------------------------------
    def read_weights(self, instance: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """An expert's flat weights (a copy, into ``out`` if given)."""
        if self.store:
            return self.store.read(instance, out)
        return out.copy_(self.unpaged[instance]) if out is not None else self.unpaged[instance].clone()

    def compute_weights(self, instance: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """An expert's flat weights for compute (read, never written): without a copy
        where they lie in one piece - the unpaged tensor, or pages in consecutive pool
        slots (``PagedExpertStore.view``, M17) - else a copy (into ``out`` if given)."""
        if out is None:
            if self.store is None:
                return self.unpaged[instance]
            whole = self.store.view(instance)
            if whole is not None:
                return whole
        self.weight_copy_bytes += self.store.expert_elems * self.store.elem if self.store else 0
        return self.read_weights(instance, out)

    def read_blocks(self, instance: int):
        """M14: the pages of ``instance`` to compute on as they arrive (``pager.pipeline_pages``)
        while some are still being copied in, else None (read it whole). ``force_blocks``
        (tests): page by page even when nothing is in flight."""
        if self.store is None or not self.scenario.pager.pipeline_pages:
            return None
        if not (self.force_blocks or self.store.pending(instance)):
            return None
        self.blocked_experts += 1
        return self.store.segments(instance)

    def stacked_weights(self, instances: list[int], counts: list[int], may_pipeline: bool) -> StackedWeights:
        """The weights of one grouped GEMM (``real.kernels.stacked_weights``): the unpaged rows in
        place, or the store's pages (in place where they lie so). Pipelined block by block
        (M14) when ``may_pipeline``, ``pager.pipeline_pages`` is on and a member's pages
        are still arriving (or ``force_blocks``)."""
        if self.store is None:
            span, _ = grouped_members(instances, counts)
            rows = [self.unpaged[i] for i, _ in span]
            starts = [t.storage_offset() - self.unpaged_rows.storage_offset() for t in rows]
            return StackedWeights(span, strided_rows(self.unpaged_rows.view(-1), starts, self.page_elems))
        pipelined = (may_pipeline and self.scenario.pager.pipeline_pages
                     and (self.force_blocks or any(self.store.pending(i) for i, n in zip(instances, counts) if n)))
        sw = self.store.stacked(instances, counts, pipelined)
        self.blocked_experts += sum(1 for _, n in sw.members if n) if pipelined else 0
        self.weight_copy_bytes += sw.copied_bytes
        return sw

    def set_unpaged(self, instance: int, flat: torch.Tensor) -> None:
        """New weights of an unpaged instance, written into its row."""
        self.unpaged[instance].copy_(flat)
        self.modified.add(instance)

    # ---- checkpoints (M23) ----------------------------------------------------------------------
    def weight_pages(self, only_modified: bool) -> dict[int, torch.Tensor]:
        """CPU copies of the expert weight pages (all, or changed since ``clear_modified``)."""
        if self.store is not None:
            return self.store.snapshot(only_modified)
        keys = self.modified if only_modified else self.unpaged.keys()
        return {int(i): self.unpaged[int(i)].to("cpu", copy=True) for i in sorted(keys)}

    def clear_modified(self) -> None:
        if self.store is not None:
            self.store.clear_modified()
        self.modified.clear()

    def restore(self, controller: Controller, router: list, pages: dict[int, torch.Tensor],
                dense: list | None = None, adam: dict | None = None, shared: list | None = None) -> None:
        """Take over a checkpoint: the controller (policies, page table, caches), the
        router parameters, the shared experts, the expert weight pages and, with the whole
        transformer, its dense weights and the Adam state; the cached process groups of the
        restored group cache are created again (same order on every rank)."""
        self.controller = controller
        self.planner = controller.planner
        with torch.no_grad():
            for (w, b), (w0, b0) in zip(self.router, router):
                w.copy_(w0)
                b.copy_(b0)
            if self.dense is not None:
                for p, p0 in zip(self.dense.params(), dense):
                    p.copy_(p0)
            for p, p0 in zip(self.shared_params(), shared or []):
                p.copy_(p0)
        if self.adam is not None:
            self.adam.load_state_dict(adam)
        if self.store is not None:
            self.store.restore(controller.pager_of(self.rank), pages)
        else:
            for i, flat in pages.items():
                self.unpaged[int(i)].copy_(flat)
        self.clear_modified()
        if self.shadow is not None:  # the reference copy of every up-to-date replica
            g = self.layout.group_of[self.rank]
            for i in self.controller.local_instances(self.rank):
                if controller.fresh[int(i), g]:
                    self.shadow[int(i)] = self.read_weights(int(i))
        self.groups.restore(controller.cache)

    # ---- paging -------------------------------------------------------------------------------
    def _router_grad_ready(self, param: torch.Tensor) -> None:
        if self.sync_hooks is not None:
            self.sync_hooks.router_grad_ready(param)

    def experts_done(self, layer: int) -> None:
        """The backward has completed layer ``layer``'s expert gradients (M22's overlapped sync)."""
        if self.sync_hooks is not None:
            self.sync_hooks.experts_done(layer)

    def execute_moves(self, moves: PageMoves | None, incoming=None, forward: bool = False) -> None:
        if moves is None or len(moves) == 0 or self.store is None:
            return
        t0 = time.perf_counter()
        nbytes = self.store.execute(moves, incoming)
        self.ledger.add_pcie("paging", nbytes)
        self.page_moves += page_move_count(moves)
        add_reason_counts(self.moves_by_reason, moves)
        if forward and not self.store.cuda:  # CPU copies are synchronous: compute waited for them
            self.stall_s += time.perf_counter() - t0

    def settle_pages(self) -> None:
        """End of step: every page copy done; on CUDA add the measured compute stall (M14)."""
        if self.store is not None:
            self.stall_s += self.store.settle()

    def plan_backward_pages(self, micro_batch: int = 0) -> None:
        """Decide every layer's backward page loads now (of the step's micro-batch
        ``micro_batch``, its last), last layer first as the backward will need them (stage
        paging): the controller then decides the sync after them, in the order the
        simulator's controller does, even when the sync is planned during the backward (M22)."""
        with self.clock.region("paging"):
            self.backward_plans = {layer: self.controller.backward_layer(layer, micro_batch)
                                   for layer in reversed(range(self.scenario.model.num_layers))}

    def backward_pages(self, layer: int, micro_batch: int = 0) -> None:
        """Start of a layer's backward (of micro-batch ``micro_batch``): reload the pages of
        its experts (stage paging)."""
        with self.clock.region("paging"):
            plans = self.backward_plans
            plan = plans.pop(layer) if plans else self.controller.backward_layer(layer, micro_batch)
            self.execute_moves(plan.page_moves.get(self.rank), forward=True)

    def refresh(self, ops) -> None:
        """Stale replicas needed now receive the weights from an up-to-date replica (M9):
        the p2p ops of the layer's paging ops (its refresh requests ran before)."""
        mine = [op for op in ops if op.kind == "p2p" and self.rank in op.members]
        if not mine:
            self._incoming = {}
            return
        p2p, incoming = [], {}
        n = self.scenario.model.expert_params
        for op in mine:
            inst = op.layer * self.scenario.model.num_experts + int(op.label.split()[-1])
            src, dst = op.members
            if src == self.rank:
                p2p.append(("send", self.read_weights(inst).contiguous(), dst))
            else:
                incoming[inst] = torch.empty(n, dtype=self.dtype, device=self.device)
                p2p.append(("recv", incoming[inst], src))
        self.comm.p2p(p2p)
        for inst, flat in incoming.items():
            if self.adam is not None:
                self.adam.reset_weight(("expert", inst), flat)
            if self.shadow is not None:
                self.shadow[inst] = flat.clone()
            if self.store is None:
                self.set_unpaged(inst, flat)  # copied into its row
        self._incoming = incoming

    def take_incoming(self):
        incoming, self._incoming = getattr(self, "_incoming", {}), {}
        return incoming


def fp8_grad_scale(scenario: Scenario) -> float:
    """The power of two that brings payload gradients to O(1) for FP8 (M22): the loss is
    a mean over tokens x hidden x ranks, so that is what the gradients are divided by."""
    n = scenario.workload.tokens_per_rank * scenario.model.hidden_size * scenario.world_size
    return float(2 ** round(math.log2(n)))
