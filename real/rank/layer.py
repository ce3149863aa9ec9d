"""One rank's forward of one MoE layer: route -> (paging) -> dispatch -> experts -> combine,
and the shared experts (``real.rank.shared_experts``) on the rank's own tokens before the
dispatch (stage ``experts``).

The route stage ends with the planner's ``route_ops``: the routed counts all-gathered
within the rank's EP group, which is all the token exchange needs (split sizes) and all
this rank's controller is told of the layer's routing (the rows of other groups stay
zero). While a replica of the rank's shard is stale, the paging stage starts with the
shard's refresh requests (``Controller.refresh_request_ops``, M9): an all-gather within
the replica group of which EP groups use each of the shard's experts, so that the
controller knows which refreshes this rank sends or receives.

The token strategies differ only in how kept slots reach the experts and come back:
``alltoall`` and ``hierarchical`` move slot rows with one or two all-to-all stages
(``exchange_plan``), ``allgather`` gathers every token of the EP group with its routing
metadata and reduce-scatters the weighted partial outputs, ``deepep`` sends each token
once per node and member it goes to, with its routing metadata, and brings back one
weighted sum per (token, member), then per (token, node) (``real.comm.deepep``). Each
expert sees its rows in the same *expert layout* (expert, source member, token, slot)
whatever the strategy.
With expert tensor parallelism (``parallelism.etp_size`` > 1, the two all-to-all strategies)
each rank holds 1/ETP of each of its shard's experts: after the all-to-all its ETP group
all-gathers the rows its members received, each member computes its slice on all of them
and the partial outputs are reduce-scattered back before the all-to-all back
(``real.comm.expert_tensor_parallel``); the route's counts are then gathered over the
TP x EP group (``Planner.route_ops``), which sizes the all-gather. The EP, ETP and
expert-DP groups are the layout's, folded or nested (``parallelism.moe_layout``).
Stage markers in the autograd graph time the backward stages. With FP8 payloads (M22)
token rows and their gradients travel compressed (``rank_state.codec``); routing
metadata and probabilities never are (the planner counts them at full width).
"""

from __future__ import annotations

import numpy as np
import torch

from real.comm.collectives import AllGather, AllToAll, ReduceScatter
from real.comm.deepep import DeepEPExchange, fanout_row
from real.comm.exchange_plan import hierarchical_stages, plan_exchange, plan_flat
from real.comm.expert_tensor_parallel import ExpertTensorGroup, GatherRows, ScatterPartials
from real.comm.micro_batches import Exchange, PipelinedExchange, plan_chunks
from real.kernels.experts import PagedExpertFFN, combine_slots, source_slots
from real.rank.clock import mark
from testbed.policy.capacity import kept_counts
from testbed.policy.router import route


def seed_of(*parts: int) -> int:
    """A 63-bit seed from integers (same on every process)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint64)[0] >> 1)


def noise_generator(run_seed: int, step: int, layer: int, rank: int, device="cpu",
                    micro_batch: int = 0) -> torch.Generator:
    """Generator of the router's Gumbel noise for one rank, step, layer and micro-batch
    (``transformer.micro_batches``: each draws its own), on the rank's device (the noise is
    drawn there). Micro-batch 0's is the step's generator of a run without micro-batches."""
    parts = (run_seed, step, layer, rank, 0x6E0) + ((micro_batch,) if micro_batch else ())
    return torch.Generator(device=device).manual_seed(seed_of(*parts))


def inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(len(perm), device=perm.device)
    return inv


class LayerRunner:
    """Runs MoE layers for one rank; ``rank_state`` holds the rank's shared pieces."""

    def __init__(self, rank_state):
        self.r = rank_state
        #: deepep: layer -> this rank's fanout [P + A] of its last forward (the routing trace's)
        self.fanout: dict[int, np.ndarray] = {}

    def forward(self, layer: int, x_TH: torch.Tensor, step: int, micro_batch: int = 0):
        """(h_TH = x + MoE(x), aux loss, the controller's LayerForward) of micro-batch
        ``micro_batch`` of the step (``transformer.micro_batches``; 0 without)."""
        r = self.r
        s, clock = r.scenario, r.clock
        top_k, tokens = s.model.top_k, x_TH.shape[0]
        clock.switch("route")
        w_EH, b_E = r.router[layer]
        routing = route(x_TH, w_EH, b_E, s.router, top_k, r.controller.capacity, step,
                        noise_generator(s.run.seed, step, layer + r.layer_offset, r.rank, r.device, micro_batch),
                        local_bias_E=r.local_bias_E, balance_bias_E=r.balance_bias(layer),
                        sequence_tokens=r.sequence_tokens)
        probs_TK = mark(routing.probs_TK, clock, "route_backward")
        routed = self._exchange_counts(layer, routing.routed_E)
        clock.switch("paging")
        plan = r.controller.forward_layer(layer, routed, self._refresh_requests(layer, routed), micro_batch)
        if r.self_check and not np.array_equal(plan.kept[r.rank], routing.kept_E.cpu().numpy()):
            raise RuntimeError("router capacity and controller capacity disagree")  # a testbed bug
        r.refresh(plan.refresh_ops)
        r.execute_moves(plan.page_moves.get(r.rank), r.take_incoming(), forward=True)
        if not plan.heat_moves.empty:  # heat.deferred (M18): after the layer's own copies, beside it
            clock.switch("heat")
            r.execute_moves(plan.heat_moves.get(r.rank))
            clock.switch("paging")
        r.execute_moves(plan.prefetch_moves.get(r.rank))  # M14: the next layer's first pages, beside this one
        shared = None
        if r.shared is not None:  # every token through the shared experts, on its own rank (no exchange)
            clock.switch("experts")
            shared = r.shared.forward(layer, x_TH)
        clock.switch("dispatch")
        slot_idx = source_slots(routing.experts_TK, routing.keep_TK, int(plan.kept[r.rank].sum()))
        instances = [layer * s.model.num_experts + e for e in r.layout.local_experts(r.rank)]
        if s.overlap.micro_batches > 1:  # M22: checked to be the flat all-to-all (real.backend)
            out_TH = self._pipelined(layer, x_TH, plan, slot_idx, probs_TK, tokens, instances, micro_batch)
            return _residual(x_TH, out_TH, shared), routing.aux_loss, plan
        if s.comm.token_strategy == "allgather":
            expert_in, counts_e, combine = self._allgather(layer, x_TH, routing, probs_TK, tokens, plan)
        elif s.comm.token_strategy == "deepep":
            expert_in, counts_e, combine = self._deepep(layer, x_TH, routing, probs_TK, plan)
        else:
            expert_in, counts_e, combine = self._alltoall(layer, x_TH, plan, slot_idx, probs_TK, tokens)
        clock.switch("experts")
        expert_in = mark(expert_in, clock, "dispatch_backward", hook=lambda: r.experts_done(layer))
        y_RH = self._experts(expert_in, instances, counts_e)
        y_RH = mark(y_RH, clock, "experts_backward")
        clock.switch("combine")
        # the backward of this layer starts here: bring its experts' pages back first
        out_TH = mark(combine(y_RH), clock, "combine_backward", hook=lambda: r.backward_pages(layer, micro_batch))
        return _residual(x_TH, out_TH, shared), routing.aux_loss, plan

    # ---- what the controller is told -------------------------------------------------------------
    def _exchange_counts(self, layer: int, routed_E: torch.Tensor) -> np.ndarray:
        """The route all-gather within the EP group (``Planner.route_ops``): routed counts
        [W, E] with the group's rows filled and the others zero."""
        r = self.r
        lay = r.layout
        routed = np.zeros((lay.world, lay.num_experts), dtype=np.int64)
        mine = routed_E.to(torch.int32)  # on the device: NCCL gathers device tensors only
        op = own_op(r.planner.route_ops(layer), r.rank, mine)
        if op is None:  # an EP group of one
            routed[r.rank] = mine.cpu().numpy()
            return routed
        counts = r.comm.all_gather(mine, op.members, r.groups.get(op.members))
        routed[list(op.members)] = counts.view(len(op.members), -1).cpu().numpy()
        return routed

    def _refresh_requests(self, layer: int, routed: np.ndarray) -> dict[int, np.ndarray] | None:
        """The shard's refresh requests, when the controller plans them: every replica
        tells the others whether its EP group kept tokens for each of the shard's experts
        (packed bits); returns {shard: [R, E/P]} for ``Controller.forward_layer``."""
        r = self.r
        ops = [op for op in r.controller.refresh_request_ops(layer) if r.rank in op.members]
        if not ops:
            return None
        lay = r.layout
        experts = lay.local_experts(r.rank)
        members = list(lay.ep_group(int(lay.group_of[r.rank])))
        used = kept_counts(routed[members], r.controller.capacity)[:, experts.start:experts.stop].sum(axis=0) > 0
        bits = torch.from_numpy(np.packbits(used)).to(r.device)
        op = own_op(ops, r.rank, bits)
        got = r.comm.all_gather(bits, op.members, r.groups.get(op.members)).view(len(op.members), -1).cpu().numpy()
        told = np.zeros((lay.replicas, len(experts)), dtype=bool)
        told[lay.group_of[list(op.members)]] = np.unpackbits(got, axis=1, count=len(experts)).astype(bool)
        return {int(lay.index_of[r.rank]): told}

    def _experts(self, rows, instances, counts):
        """The rank's experts on ``rows`` (``counts`` per instance), weights from its store."""
        r, m = self.r, self.r.scenario.model
        return PagedExpertFFN.apply(rows, r, instances, counts, m.hidden_size, r.expert_ffn, r.grads, r.timer,
                                    r.grouped, r.swiglu)

    # ---- token strategies ----------------------------------------------------------------------
    def _exchange_plan(self, plan):
        """This rank's token exchange within its EP group for the layer's kept counts:
        the flat all-to-all, or the hierarchical stages (``comm.token_strategy``)."""
        r = self.r
        lay = r.layout
        g = int(lay.group_of[r.rank])
        members = list(lay.ep_group(g))
        kept = plan.kept[lay.rank_of[g]]  # [P, E] in EP-index order
        owner = lambda e: e // lay.experts_per_rank  # noqa: E731
        if r.scenario.comm.token_strategy == "hierarchical":
            return plan_exchange(kept, members, owner, hierarchical_stages(lay.index_of[r.planner.grids[g]], owner),
                                 r.rank)
        return plan_flat(kept, members, owner, r.rank)

    def _alltoall(self, layer, x_TH, plan, slot_idx, probs_TK, tokens):
        r = self.r
        xp = self._exchange_plan(plan)
        dev = x_TH.device
        perms = [torch.as_tensor(st.send_rows, dtype=torch.long, device=dev) for st in xp.stages]
        expert_rows = torch.as_tensor(xp.expert_rows, dtype=torch.long, device=dev)
        buf = x_TH.index_select(0, slot_idx // probs_TK.shape[1])
        for st, perm in zip(xp.stages, perms):
            buf = buf.index_select(0, perm)
            if len(st.group) > 1:
                buf = AllToAll.apply(buf, r.comm, st.send_splits, st.recv_splits, st.group, r.groups.get(st.group),
                                     r.codec)
        expert_in = buf.index_select(0, expert_rows)
        counts_e = [int(c) for c in xp.expert_counts]
        etp = self._expert_tensor_group(plan)
        if etp is not None:  # the ETP group's all-gather after the all-to-all: every member's rows
            expert_in, counts_e = GatherRows.apply(expert_in, etp), [int(c) for c in etp.counts_E]

        def combine(y_RH):
            if etp is not None:  # the partial sums back to their rows' members, before the all-to-all
                y_RH = ScatterPartials.apply(y_RH, etp)
            back = y_RH.index_select(0, inverse(expert_rows))
            for st, perm in zip(reversed(xp.stages), reversed(perms)):
                if len(st.group) > 1:
                    back = AllToAll.apply(back, r.comm, st.recv_splits, st.send_splits, st.group,
                                          r.groups.get(st.group), r.codec)
                back = back.index_select(0, inverse(perm))
            return combine_slots(back, slot_idx, probs_TK, tokens)

        return expert_in, counts_e, combine

    def _expert_tensor_group(self, plan) -> ExpertTensorGroup | None:
        """This rank's ETP exchange of the layer (``parallelism.etp_size`` > 1, else None):
        the rows each member of its ETP group receives per local expert, from the kept
        counts of the member's EP group (the route's all-gather over TP x EP told them)."""
        r = self.r
        lay = r.layout
        if lay.etp_size == 1:
            return None
        members = tuple(sorted(int(m) for m in lay.etp_members[r.rank]))
        experts = lay.local_experts(r.rank)  # the same shard on every member
        counts = np.stack([plan.kept[list(lay.ep_group(int(lay.group_of[m])))][:, experts.start:experts.stop]
                           .sum(axis=0) for m in members])
        return ExpertTensorGroup(r.comm, members, r.groups.get(members), r.rank, counts, r.codec)

    def _pipelined(self, layer, x_TH, plan, slot_idx, probs_TK, tokens, instances, micro_batch=0):
        """The flat exchange and the experts in ``overlap.micro_batches`` micro-batches
        (``real.comm.micro_batches``): the layer's MoE output [T, H]."""
        r = self.r
        s = r.scenario
        xp = self._exchange_plan(plan)
        (st,) = xp.stages  # the flat all-to-all (checked: real.backend)
        dev = x_TH.device
        chunks = plan_chunks(st.send_splits, st.recv_splits, xp.expert_rows, xp.expert_counts,
                             s.overlap.micro_batches, dev)
        ex = Exchange(r.comm, r.clock, st.group, r.groups.get(st.group), r.codec, chunks,
                      lambda rows, counts: self._experts(rows, instances, counts),
                      hook=lambda: r.backward_pages(layer, micro_batch), experts_done=lambda: r.experts_done(layer))
        send_rows = torch.as_tensor(st.send_rows, dtype=torch.long, device=dev)
        buf = x_TH.index_select(0, slot_idx // probs_TK.shape[1]).index_select(0, send_rows)
        back = PipelinedExchange.apply(buf, ex)
        r.clock.switch("combine")
        out = combine_slots(back.index_select(0, inverse(send_rows)), slot_idx, probs_TK, tokens)
        return mark(out, r.clock, "combine_backward")

    def _deepep(self, layer, x_TH, routing, probs_TK, plan):
        """DeepEP's dispatch (``real.comm.deepep``): first the fanout all-gather
        (``Planner.fanout_ops``: the hops' split sizes), kept in ``fanout`` for the run's
        routing trace."""
        r = self.r
        lay = r.layout
        g = int(lay.group_of[r.rank])
        grid = r.planner.grids[g]
        mine = torch.as_tensor(fanout_row(lay, grid, routing.experts_TK, routing.keep_TK), dtype=torch.int32,
                               device=x_TH.device)
        fanout = np.zeros((lay.ep_size, len(mine)), dtype=np.int64)  # EP-index order
        op = own_op(r.planner.fanout_ops(layer), r.rank, mine)
        if op is None:  # an EP group of one
            fanout[0] = mine.cpu().numpy()
        else:
            got = r.comm.all_gather(mine, op.members, r.groups.get(op.members))
            fanout[lay.index_of[list(op.members)]] = got.view(len(op.members), -1).cpu().numpy()
        self.fanout[layer] = fanout[lay.index_of[r.rank]]
        ex = DeepEPExchange(r.comm, lay, grid, fanout, r.groups.get, r.codec)
        expert_in, counts_e, combine = ex.dispatch(x_TH, routing.experts_TK, routing.keep_TK, probs_TK)
        experts = lay.local_experts(r.rank)
        if counts_e != plan.kept[list(lay.ep_group(g))][:, experts.start:experts.stop].sum(axis=0).tolist():
            raise RuntimeError("deepep's rows per expert and the controller's kept counts disagree")  # a testbed bug
        return expert_in, counts_e, combine

    def _allgather(self, layer, x_TH, routing, probs_TK, tokens, plan):
        r = self.r
        lay = r.layout
        members = tuple(sorted(lay.ep_group(int(lay.group_of[r.rank]))))
        pg = r.groups.get(members)
        top_k = probs_TK.shape[1]
        x_all = AllGather.apply(x_TH.contiguous(), r.comm, members, pg, r.codec)  # [P*T, H]
        masked = torch.where(routing.keep_TK, routing.experts_TK, -1).to(torch.int32)
        e_all = r.comm.all_gather(masked.contiguous(), members, pg).reshape(-1).long()  # (src, t, k)
        p_all = AllGather.apply(probs_TK.contiguous(), r.comm, members, pg).reshape(-1)
        experts = lay.local_experts(r.rank)
        # the slots of this rank's experts in expert layout (expert, src, t, k): their counts
        # are the plan's, so nothing is read back from the device
        counts_e = plan.kept[list(members)][:, experts.start:experts.stop].sum(axis=0).tolist()
        local = (e_all >= experts.start) & (e_all < experts.stop)
        key = torch.where(local, e_all - experts.start, torch.full_like(e_all, len(experts)))
        mine = torch.argsort(key, stable=True)[:sum(counts_e)]
        rows = mine // top_k
        expert_in = x_all.index_select(0, rows)

        def combine(y_RH):
            w_R = p_all.index_select(0, mine).to(y_RH.dtype)
            partial = y_RH.new_zeros((x_all.shape[0], y_RH.shape[1])).index_add(0, rows, y_RH * w_R[:, None])
            return ReduceScatter.apply(partial, r.comm, members, pg, r.codec)

        return expert_in, counts_e, combine


def _residual(x_TH: torch.Tensor, routed_TH: torch.Tensor, shared_TH: torch.Tensor | None) -> torch.Tensor:
    """The MoE layer's output: its input, the routed experts' weighted sum and the shared
    experts' output (``model.shared_experts``; DeepSeek-V3 eq. 12)."""
    return x_TH + routed_TH if shared_TH is None else x_TH + shared_TH + routed_TH


def own_op(ops, rank: int, payload: torch.Tensor):
    """The op of ``ops`` that ``rank`` takes part in (None if none), checked to carry
    ``payload`` as the planner costed it: both backends must move the same bytes."""
    mine = [op for op in ops if rank in op.members]
    if not mine:
        return None
    (op,) = mine
    if op.size != payload.numel() * payload.element_size():
        raise RuntimeError(f"{op.label}: the planner costs {op.size} bytes, the rank sends "
                           f"{payload.numel() * payload.element_size()}")  # a testbed bug
    return op
