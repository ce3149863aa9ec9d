"""The gradient sync of one step on the real backend: expert gradients (all-reduce, or
two-stage within the active groups, M8-M10) and router gradients, with the whole
transformer the dense weights' too (DDP-style buckets).

It runs one of two ways, with the same collectives in the same order on every rank:

- after the backward (the default): the step's active-group discovery all-gather
  (M10) with bias balancing's all-reduce of the routed counts beside it, and the
  controller's plan, then layer after layer, last first, its expert sync (the two-stage
  all-gathers once the reduce-scatters are in), each waited for before the next, then
  the buckets one after another - as the simulator chains them;
- during the backward (M22, ``overlap.sync_with_backward``): what the simulator's sync
  stream does, as async collectives (gloo's worker threads, NCCL's stream) issued from
  points of the backward that every rank passes in the same order:
  - once the forward is done, every layer's backward page loads are decided (so that the
    controller decides the sync after them, as the simulator's does) and the discovery
    all-gather is issued, with bias balancing's all-reduce of the routed counts beside it
    (``Planner.balance_ops``); they are waited for, the controller plans the sync and the
    group cache's communicators are made, when the first layer's expert gradients are
    complete;
  - when a layer's expert gradients are complete (its experts' backward ran), its expert
    sync is issued, and the two-stage all-gathers of the layer before (whose
    reduce-scatters were issued a layer ago: a fixed point of every rank's backward, so
    the collectives on each group keep one order on every rank);
  - when every router gradient of a bucket has been accumulated (a post-accumulate hook
    per parameter, as torch DDP does), the bucket's all-reduce is issued;
  after the backward the rank waits for what is still in flight (stages ``expert_sync``
  and ``dense_sync``: what the overlap did not hide).
"""

from __future__ import annotations

import numpy as np
import torch

from testbed.policy.planner import Planner, padded_elements


class GradientSync:
    """One step's gradient sync (module doc). ``during_backward``: made before the
    backward, which then issues the collectives through the rank's hooks; else made
    after it and run at once (``after_backward``)."""

    def __init__(self, runner, kept_LE: np.ndarray, during_backward: bool):
        self.runner, self.st = runner, runner.st
        if during_backward:
            self.st.plan_backward_pages()  # the controller decides the backward's pages before the sync
        else:
            self.st.clock.switch("expert_sync")
        self.discovery = runner.start_discovery(kept_LE)  # () -> active groups [L, R, E] or None
        self.balance_sum = runner.start_balance_sum()  # () -> tells the controller the whole batch's load
        self.plan = None
        self.synced: dict[int, torch.Tensor] = {}
        self.reducing: list = []  # (stage, work, finish) of issued all-reduces, in issue order
        self.scattering: list = []  # (layer, [(op, shard, work)]) awaiting their all-gathers
        self.gathering: list = []  # (inst, out, work)
        self.bucket_of: dict[int, int] = {}  # id of a weight -> the dense op index of its bucket
        self.bucket_left: dict[int, int] = {}  # dense op index -> its weights not yet accumulated
        self.issued_buckets: set[int] = set()
        if during_backward:
            self.st.sync_hooks = self

    def after_backward(self):
        """The whole sync now, one collective (or batch) after another; returns the plan."""
        st = self.st
        for layer in reversed(range(st.scenario.model.num_layers)):
            self.experts_done(layer)
            self._drain()
        st.clock.switch("dense_sync")
        for k in range(len(self.plan.dense_sync_ops)):
            self._issue_bucket(k)
            self._drain()
        return self.finish()

    # ---- called from the backward ------------------------------------------------------------
    def experts_done(self, layer: int) -> None:
        """Layer ``layer``'s expert gradients are complete: issue its expert sync, and the
        all-gathers of the layer before (its reduce-scatters were issued a layer ago)."""
        self._planned()
        st = self.st
        E, n = st.scenario.model.num_experts, st.scenario.model.expert_params
        local = list(st.layout.local_experts(st.rank))
        mine = [op for op in self.plan.expert_sync_ops if st.rank in op.members and op.layer == layer]
        scatters = []
        for op in mine:
            if op.kind == "all_reduce":  # the shard's experts of one layer, one buffer
                insts = [layer * E + e for e in local]
                buf = torch.cat([self.runner._grad(i) for i in insts])
                work = st.comm.all_reduce(buf, op.members, st.groups.get(op.members), async_op=True, stage="expert_sync")

                def finish(insts=insts, buf=buf):
                    for i, part in zip(insts, buf.chunk(len(insts))):
                        self.synced[i] = part
                self.reducing.append(("expert_sync", work, finish))
            elif op.kind == "reduce_scatter":
                inst = layer * E + int(op.label.split()[-1])
                g = self.runner._grad(inst)
                padded = torch.zeros(padded_elements(n, len(op.members)), dtype=g.dtype, device=g.device)
                padded[:n] = g
                shard, work = st.comm.reduce_scatter(padded, op.members, st.groups.get(op.members, cached=True),
                                                     async_op=True, stage="expert_sync")
                scatters.append((op, inst, shard, work))
        self._gather_previous()
        if scatters:
            self.scattering.append((layer, scatters))

    def router_grad_ready(self, param: torch.Tensor) -> None:
        """A weight's gradient (a router's or a dense one) was accumulated: issue its bucket once full."""
        self._planned()
        k = self.bucket_of.get(id(param))
        if k is None:  # a shard's weight whose bucket goes over another peer group
            return
        self.bucket_left[k] -= 1
        if self.bucket_left[k] == 0:
            self._issue_bucket(k)

    # ---- after the backward -------------------------------------------------------------------
    def finish(self):
        """Wait for every issued collective (and issue the last all-gathers); returns the
        plan. Expert gradients synced are in ``synced``; router gradients are in place."""
        st = self.st
        self._planned()
        for k in range(len(self.plan.dense_sync_ops)):  # a bucket whose hooks never all fired (no gradient)
            self._issue_bucket(k)
        self._drain()
        st.groups.retire()
        st.sync_hooks = None
        return self.plan

    # ---- inside --------------------------------------------------------------------------------
    def _planned(self) -> None:
        """The sync plan, made when first needed: discovery's answer, the controller's
        plan, the cached communicators, and the router buckets to fill."""
        if self.plan is not None:
            return
        st = self.st
        previous = st.clock.current
        st.clock.switch("expert_sync")
        active = self.discovery()
        self.balance_sum()  # beside the discovery, as the simulator runs both in one phase
        self.plan = st.controller.sync(active)
        if self.plan.cache is not None:
            st.groups.apply(self.plan.cache)
        for k, op in enumerate(self.plan.dense_sync_ops):
            if st.rank in op.members:  # tensor parallel: one shard's bucket per peer group
                params = self._bucket_params(op)
                self.bucket_left[k] = len(params)
                self.bucket_of.update((id(p), k) for p in params)
        st.clock.switch(previous)

    def _gather_previous(self, everything: bool = False) -> None:
        """Issue the all-gathers of the layers whose reduce-scatters were issued before
        (all of them at the end), waiting for those reduce-scatters."""
        st = self.st
        while self.scattering:
            _, scatters = self.scattering.pop(0)
            for op, inst, shard, work in scatters:
                if work is not None:
                    work.wait()
                pg = st.groups.get(op.members, cached=True)
                out, gather = st.comm.all_gather(shard, op.members, pg, async_op=True, stage="expert_sync")
                self.gathering.append((inst, out, gather))
            if not everything:
                break

    def _drain(self) -> None:
        """Wait for every collective issued so far (the two-stage all-gathers issued first),
        expert sync before buckets, each waited for in its stage."""
        st = self.st
        if self.scattering:
            st.clock.switch("expert_sync")
        self._gather_previous(everything=True)
        for stage, work, done in sorted(self.reducing, key=lambda r: r[0] == "dense_sync"):
            st.clock.switch(stage)
            if work is not None:
                work.wait()
            done()
        self.reducing = []
        if self.gathering:
            st.clock.switch("expert_sync")
        for inst, out, work in self.gathering:
            if work is not None:
                work.wait()
            self.synced[inst] = out[:st.scenario.model.expert_params]
        self.gathering = []

    def _bucket_params(self, op) -> list[torch.Tensor]:
        """The weights whose gradients bucket ``op`` sums, last layer first (``Planner.bucket_part``)."""
        st, part = self.st, Planner.bucket_part(op)
        out = []
        split = st.shared is not None and st.shared.split  # tensor parallel: shards of the shared experts
        for layer in reversed(Planner.bucket_layers(op)):
            shared = [p for _, p in st.shared.named_layer_params(layer)] if st.shared is not None else []
            if part in ("all", "routers"):  # the MoE layer's replicated weights: its router's, whole shared experts'
                out += list(st.router[layer])
                if not split:
                    out += shared
            if part in ("all", "dense"):  # split shared experts' shards sum with the dense ones (block_grad_bytes)
                if split:
                    out += shared
                if st.dense is not None:
                    out += st.dense.layer_params(layer)
        return out

    def _issue_bucket(self, k: int) -> None:
        """The all-reduce of router-gradient bucket ``k`` (``plan.dense_sync_ops[k]``), once."""
        st = self.st
        op = self.plan.dense_sync_ops[k]
        if k in self.issued_buckets or st.rank not in op.members:
            return
        self.issued_buckets.add(k)
        params = self._bucket_params(op)
        # one buffer per dtype (fp32 routers beside 16-bit dense weights): the bucket's bytes
        for dtype in dict.fromkeys(p.grad.dtype for p in params):
            same = [p for p in params if p.grad.dtype == dtype]
            buf = torch.cat([p.grad.reshape(-1) for p in same])
            work = st.comm.all_reduce(buf, op.members, st.groups.get(op.members), async_op=True, stage="dense_sync")

            def done(params=same, buf=buf):
                for p, part in zip(params, buf.split([p.numel() for p in params])):
                    p.grad.copy_(part.view_as(p))
            self.reducing.append(("dense_sync", work, done))
