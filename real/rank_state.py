"""What one rank of the real backend holds: its model state and how it moves weights.

``RankState`` owns the rank's controller (the shared policies, paging only this GPU),
process groups, counted collectives, stage clock, router parameters, and the expert
weights in a ``PagedExpertStore`` (or unpaged when ``pager.enabled`` is false). It
executes page moves and replica refreshes for the layers and the step loop.

Weights: expert instance i starts from a generator seeded by (run.seed, i), the same on
every replica and in the single-process reference. With ``real.check_weights`` the rank
keeps an unpaged copy that the step loop checks the pages against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from real.clock import StageClock
from real.comm import Comm
from real.groups import Groups
from real.layer import seed_of
from real.paged_store import PagedExpertStore
from testbed.collectives import ByteLedger
from testbed.controller import Controller
from testbed.page_moves import PageMoves, page_move_count
from testbed.router import init_router_params
from testbed.scenario import Scenario
from testbed.topology import Layout

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def initial_expert_flat(run_seed: int, instance: int, hidden: int, ffn: int) -> torch.Tensor:
    """Initial flat weights (w1 then w2, fp32) of expert instance ``instance``."""
    g = torch.Generator().manual_seed(seed_of(run_seed, instance, 0xE4))
    w1 = torch.randn(hidden, ffn, generator=g) / hidden ** 0.5
    w2 = torch.randn(ffn, hidden, generator=g) / ffn ** 0.5
    return torch.cat([w1.reshape(-1), w2.reshape(-1)])


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
        self.comm = Comm(self.rank, self.ledger, lambda: self.clock.current or "route")
        self.groups = Groups(self.planner)
        m = s.model
        self.router = []
        for layer in range(m.num_layers):
            w, b = initial_router(s.run.seed, layer, s)
            self.router.append((w.to(self.device).requires_grad_(), b.to(self.device).requires_grad_()))
        init = lambda i: initial_expert_flat(s.run.seed, i, m.hidden_size, m.ffn_hidden_size)  # noqa: E731
        self.store = None
        self.unpaged: dict[int, torch.Tensor] = {}
        if s.pager.enabled:
            self.store = PagedExpertStore(self.controller.pagers[self.rank], m.expert_params,
                                          self.dtype, self.device, init)
        else:
            for i in self.controller.local_instances(self.rank):
                self.unpaged[int(i)] = init(int(i)).to(self.device, self.dtype)
        self.shadow = ({int(i): init(int(i)).to(self.device, self.dtype)
                        for i in self.controller.local_instances(self.rank)}
                       if s.real.check_weights else None)
        self.grads: dict[int, torch.Tensor] = {}  # this step's expert weight gradients
        self.page_bytes = 0
        self.page_moves = 0
        self.stall_s = 0.0

    def begin_step(self, step: int) -> None:
        """Fresh per-step counters: gradients, page moves, stall time, bytes."""
        self.controller.begin_step(step)
        self.grads.clear()
        self.page_moves, self.stall_s = 0, 0.0
        self.ledger = ByteLedger(self.layout)
        self.comm.ledger = self.ledger

    # ---- expert weights ----------------------------------------------------------------------
    def read_weights(self, instance: int) -> torch.Tensor:
        return self.store.read(instance) if self.store else self.unpaged[instance].clone()

    # ---- paging -------------------------------------------------------------------------------
    def execute_moves(self, moves: PageMoves | None, incoming=None, forward: bool = False) -> None:
        if moves is None or len(moves) == 0 or self.store is None:
            return
        t0 = time.perf_counter()
        nbytes = self.store.execute(moves, incoming)
        self.ledger.add_pcie("paging", nbytes)
        self.page_moves += page_move_count(moves)
        if forward:  # compute waits for these copies (M14 pipelining would hide part of it)
            self.stall_s += time.perf_counter() - t0

    def backward_pages(self, layer: int) -> None:
        """Start of a layer's backward: reload the pages of its experts (stage paging)."""
        with self.clock.region("paging"):
            plan = self.controller.backward_layer(layer)
            self.execute_moves(plan.page_moves.get(self.rank), forward=True)

    def refresh(self, ops) -> None:
        """Stale replicas needed now receive the weights from an up-to-date replica (M9)."""
        mine = [op for op in ops if self.rank in op.members]
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
            if self.shadow is not None:
                self.shadow[inst] = flat.clone()
            if self.store is None:
                self.unpaged[inst] = flat.clone()
        self._incoming = incoming

    def take_incoming(self):
        incoming, self._incoming = getattr(self, "_incoming", {}), {}
        return incoming


class ActivationMeter:
    """Bytes of tensors autograd saves for the backward during the forward (CPU memory
    accounting: the activations a GPU would hold at the end of the forward)."""

    def __init__(self):
        self.peak_bytes = 0
        self._seen: set[int] = set()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            self.peak_bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
