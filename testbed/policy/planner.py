"""The communication planner (M5, M7-M9): routing counts + placement + strategy -> ops.

Token bytes per kept (token, expert) slot are ``H * dtype_bytes`` (M5), or ``H`` bytes
with FP8 payloads (``comm.payload_dtype = "fp8"``, M22). For an EP group
with members m_0..m_{P-1}, ``D[i, j]`` is the bytes member i's tokens send to member j's
experts in the dispatch; every token strategy moves the same slots, in different ops:

- ``alltoall``: dispatch = all_to_all_v(D); combine = all_to_all_v(D^T); backward
  mirrors (combine_backward = D, dispatch_backward = D^T).
- ``allgather``: dispatch = all_gather of all T tokens, of each slot's expert index
  (int32) and of its probability (fp32), three calls; combine = reduce_scatter of the
  P*T partial outputs; backward: all_gather of output gradients, reduce_scatter of
  token gradients and of probability gradients. With FP8 payloads the two token
  reduce-scatters are all_to_all_v of T-row shards (decoded, then summed in fp32).
- ``hierarchical`` (Tutel's 2DH): the group as a (nodes A x members per node B) grid;
  stage 1 inside each node sends member (a,b) -> (a,b') everything bound for column b'
  (S1 = sum over destination node of D), stage 2 across nodes sends (a,b') -> (a',b')
  the aggregate (S2 = sum over source member-in-node of D). Combine runs them reversed.
- ``deepep`` (DeepEP's normal kernels, ``testbed.policy.deepep``): on the same grid a
  token crosses to each destination node once, to its rail peer there, which forwards it
  over NVLink to each member holding one of its experts; the combine brings back one
  partial sum per (token, member), then per (token, node). Its rows are distinct tokens,
  not slots: the members' *fanout* (tokens per destination member and node), shared
  first in the dispatch (an all_gather: DeepEP's notify), told by the backend
  (``tell_fanout``: a replayed real run's) or modelled from the kept counts.

Expert sync (M8-M9) of replicated experts, per layer:
- ``allreduce``: one all_reduce of the shard's gradients over its R replicas;
- ``two_stage``: per expert e with an active group A_e (replicas whose EP group kept at
  least one token for e) of two or more ranks, reduce_scatter then all_gather within
  A_e; experts are taken ``sync_batch_experts`` at a time on concurrent streams.

Small ops, where the policies need them (the rest of a step's traffic is tokens and
expert gradients):

- ``route`` (per layer, cannot wait for later layers: their routing needs this layer's
  output): an all_gather of every member's routed counts (E int32) *within each EP
  group*, the split sizes of the group's token exchange (and its members' capacity
  decisions, M2; paging needs only the group's own experts).
- ``paging``, refresh requests (per layer, only while a replica of the shard's experts
  is stale, M9): an all_gather within a replica group of each replica's "my EP group
  uses this expert" bits for the shard's experts of the layer, so that the up-to-date
  replica that must send knows who needs it; it precedes the refresh p2p ops (batch 1).
- ``expert_sync``, discovery (once per step, every layer batched, M10): an all_gather
  over all ranks of each rank's bitmask of the experts it kept tokens for, L x E bits,
  after the forward. Every rank needs the world view here: the group cache's lookups
  and the communicators it creates must be the same on every rank (``new_group`` is
  called in the same order everywhere), the weight update decides which replicas change
  and which go stale, and memory heat counts the groups that used each expert.
- ``expert_sync``, bias balancing's counts (once per step with several replicas,
  ``router.bias_update_rate``, DeepSeek-V3 §2.1.2): an all_reduce within each replica
  group of every layer's routed counts of the member's EP group (L x E int32), beside
  the discovery (``balance_ops``: why there, and why the replica groups).
- ``heat`` (once per heat update, every ``heat.update_interval`` steps, M18): an
  all_reduce of the compute heat per expert instance of the steps since the last update
  (steps x L x E float64: kept slots, or measured kernel seconds), because the heat
  map's percentiles, and the pager's cold / hot decisions that follow from them, are
  over every instance and must agree on every rank; the map is read only at updates.
- ``dense_sync``: the router's gradients (replicated on every rank) all-reduced over
  all ranks in DDP-style buckets of at most ``comm.grad_bucket_bytes``, filled in
  backward order (last layer first); a bucket's all-reduce belongs to the layer whose
  gradient completes it, so with ``overlap.sync_with_backward`` it runs as soon as that
  layer's backward is done, else all run after the backward.
- the distributed optimizer (``testbed.policy.distributed_optimizer``; ZeRO >= 1 with adam):
  each ``dense_sync`` bucket's and each layer's ``allreduce`` expert sync's all-reduce is a
  reduce-scatter, then an all-gather of the updated parameters (batch 1); the gradients in
  ``transformer.grad_reduce_dtype`` (two_stage's reduce-scatters too).

When the EP group is the world (one replica) the route all_gather already gives every
rank the world's counts, and discovery, refresh requests and (for kept-slot heat) the
heat all_reduce are not needed.

Expert tensor parallelism (``parallelism.etp_size`` > 1, ``testbed.policy.expert_tensor_parallel``):
the route's counts are gathered over each ETP x EP group (Megatron-Core's ``tp_ep``), each
token stage adds the ETP group's all-gather after the all-to-all (dispatch,
combine_backward) or its reduce-scatter before it (combine, dispatch_backward), and the
expert sync all-reduces each slice over its expert-DP group.

Ops with a single member move nothing and are left out.
"""

from __future__ import annotations

import numpy as np

from testbed.model.whole_model import (
    block_attention_layers,
    block_grad_bytes,
    dense_weight_split,
    is_ulysses,
    mla_down_projection_params,
    shape_of,
)
from testbed.policy import deepep
from testbed.policy.collectives import CollectiveOp
from testbed.policy.context_parallel import ContextParallelOps
from testbed.policy.distributed_optimizer import check_distributed_optimizer, gradient_sum_ops, reduced_bytes
from testbed.policy.expert_tensor_parallel import check_expert_tensor_parallel, etp_token_ops, with_etp_ops
from testbed.policy.tensor_parallel_ops import TensorParallelOps
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout

COUNT_BYTES = 4  # routed counts travel as int32
HEAT_BYTES = 8  # compute heat per expert instance travels as float64
ROUTER_PARAM_BYTES = 4  # the router (weight H x E and bias E) is kept in fp32
INDEX_BYTES = 4  # allgather: each slot's expert index travels as int32
PROB_BYTES = 4  # ... and its probability as fp32
PROB_GRAD_BYTES = 4


class Planner:
    """Turns per-layer routing counts into the collective ops of a step."""

    def __init__(self, scenario: Scenario, layout: Layout | None = None):
        self.s = scenario
        self.layout = layout or Layout(scenario)
        m = scenario.model
        payload = 1 if scenario.comm.payload_dtype == "fp8" else m.dtype_bytes  # M22 compression
        self.token_bytes = m.hidden_size * payload
        self.tokens = scenario.workload.tokens_per_rank
        self.world = tuple(range(self.layout.world))
        check_expert_tensor_parallel(scenario)
        check_distributed_optimizer(scenario)
        self.etp = self.layout.etp_size  # expert tensor parallelism (module doc)
        self.strategy = scenario.comm.token_strategy
        self.grids = ([self.layout.node_grid(g) for g in range(self.layout.replicas)]
                      if self.strategy == "hierarchical" else None)
        if self.strategy == "deepep":  # the same grid; its error names deepep
            self.grids = deepep.grids_of(self.layout)
            self.grid_positions = [deepep.grid_positions(self.layout, grid) for grid in self.grids]
        #: deepep: layer -> [W, P + A] fanout the backend told (``tell_fanout``); else modelled
        self._fanout: dict[int, np.ndarray] = {}
        self._modelled: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> (kept, its modelled fanout)
        self._tensor_parallel: TensorParallelOps | None = None
        self._context_parallel: ContextParallelOps | None = None

    # ---- route ----------------------------------------------------------------------------
    def route_ops(self, layer: int) -> list[CollectiveOp]:
        """Each EP group's members share their routed counts (E x int32): the split sizes
        of the group's token exchange (see the module doc)."""
        lay = self.layout
        if lay.ep_size < 2:
            return []
        size = self.s.model.num_experts * COUNT_BYTES
        if self.etp > 1:  # Megatron-Core's preprocess: over tp_ep, the ETP peers' counts size the all-gather
            return [CollectiveOp("all_gather", group, "route", layer, size=size, label="routed counts")
                    for group in lay.tp_ep_groups()]
        return [CollectiveOp("all_gather", tuple(sorted(lay.ep_group(g))), "route", layer, size=size,
                             label="routed counts") for g in range(lay.replicas)]

    def refresh_request_ops(self, layer: int, shards) -> list[CollectiveOp]:
        """For each shard (EP index) in ``shards``, an all_gather within its replica group
        of every replica's bits "my EP group kept tokens for this expert" for the shard's
        experts of ``layer`` (M9: a stale replica that is needed now is sent by an
        up-to-date one, which must know). Batch 0 of the layer's ``paging`` ops."""
        lay = self.layout
        if lay.replicas < 2:
            return []
        size = packed_bytes(lay.experts_per_rank)
        return [CollectiveOp("all_gather", tuple(sorted(lay.replica_group(j))), "paging", layer, size=size,
                             label=f"refresh requests, shard {j}") for j in shards]

    def discovery_ops(self) -> list[CollectiveOp]:
        """Once per step: every rank's bitmask of the experts it kept tokens for, in every
        layer (L x E bits), gathered over all ranks (M10; why the world: module doc).
        Layer -1, stage ``expert_sync``; not needed with one replica."""
        if self.layout.replicas < 2:
            return []
        m = self.s.model
        return [CollectiveOp("all_gather", self.world, "expert_sync", -1, size=packed_bytes(m.num_layers * m.num_experts),
                             label="active experts, all layers (M10 discovery)")]

    def balance_ops(self) -> list[CollectiveOp]:
        """Bias balancing with several replicas (``router.bias_update_rate``; DeepSeek-V3
        §2.1.2 balances "the whole batch of each training step"): once per step, the
        routed counts of every layer (L x E int32) summed so that every rank holds the
        whole batch's and moves the one bias (``testbed.policy.bias_balance``).

        Over each replica group, not the world: a member contributes its EP group's
        counts, which the route all_gather already gave it, and a replica group holds one
        member of every EP group, so each of its sums is the whole batch's. Its P rings of
        R members send 2 (R-1) x 4 L E bytes each, 2 (W - P) x 4 L E in all, against the
        world ring's 2 (W-1) x 4 L E, in 2 (R-1) steps instead of 2 (W-1), on
        communicators every rank holds already (``fixed_groups``).

        Stage ``expert_sync``, layer -1, batch 0, beside the M10 discovery: its counts are
        the forward's (known once it is done), the bias is needed only at the next step,
        and that is the once-per-step op slot both backends time (the simulator's phase
        of the discovery, the real backend's ``GradientSync``); route_backward and the
        optimizer hold no ops on either, and heat ops run only at heat updates. With one
        replica the route all_gather told every rank every count: none."""
        lay = self.layout
        if self.s.router.bias_update_rate <= 0 or lay.replicas < 2:
            return []
        m = self.s.model
        size = m.num_layers * m.num_experts * COUNT_BYTES
        return [CollectiveOp("all_reduce", tuple(sorted(lay.replica_group(j))), "expert_sync", -1, size=size,
                             label=f"routed counts, all layers (bias balancing), replica group {j}")
                for j in range(lay.ep_size)]

    # ---- token exchange ---------------------------------------------------------------------
    def dispatch_matrix(self, kept: np.ndarray, group: int) -> np.ndarray:
        """D[i, j]: bytes EP member i sends member j (kept: ranks x experts slot counts)."""
        lay = self.layout
        members = lay.rank_of[group]
        per_expert = kept[members]  # P x E
        p = lay.ep_size
        return per_expert.reshape(p, p, lay.experts_per_rank).sum(-1).astype(np.int64) * self.token_bytes

    def dispatch_matrices(self, kept: np.ndarray) -> np.ndarray:
        """``dispatch_matrix`` of every EP group at once: [R, P, P]."""
        lay = self.layout
        p = lay.ep_size
        per_expert = kept[lay.rank_of]  # R x P x E
        return per_expert.reshape(lay.replicas, p, p, lay.experts_per_rank).sum(-1).astype(np.int64) * self.token_bytes

    def token_ops(self, stage: str, layer: int, kept: np.ndarray) -> list[CollectiveOp]:
        """Ops of one token stage (dispatch, combine or their backward) for all groups;
        with expert TP the ETP groups' all-gather or reduce-scatter besides (module doc)."""
        ops = self._ep_token_ops(stage, layer, kept)
        if self.etp == 1:
            return ops
        m = self.s.model
        return with_etp_ops(stage, ops, etp_token_ops(stage, layer, kept, self.layout, self.token_bytes,
                                                      m.hidden_size * m.dtype_bytes))

    def _ep_token_ops(self, stage: str, layer: int, kept: np.ndarray) -> list[CollectiveOp]:
        """The EP groups' ops of one token stage (the module doc's strategies)."""
        ops: list[CollectiveOp] = []
        lay = self.layout
        if lay.ep_size < 2:
            return ops
        if self.strategy == "allgather":
            for g in range(lay.replicas):
                ops += self._allgather_ops(stage, layer, tuple(sorted(lay.ep_group(g))))
            return ops
        if self.strategy == "deepep":
            return self._deepep_ops(stage, layer, kept)
        ds = self.dispatch_matrices(kept)
        if self.strategy == "alltoall":
            forward = stage in ("dispatch", "combine_backward")
            for g in range(lay.replicas):
                members = lay.rank_of[g]
                order = np.argsort(members)  # ops list members by ascending rank
                mat = ds[g] if forward else ds[g].T
                if (order != np.arange(len(order))).any():
                    mat = mat[np.ix_(order, order)]
                ops.append(CollectiveOp("all_to_all_v", tuple(members[order].tolist()), stage, layer,
                                        matrix=mat, label="tokens", row_bytes=self.token_bytes))
            return ops
        for g in range(lay.replicas):
            ops += self._hierarchical_ops(stage, layer, g, ds[g])
        return ops

    # ---- deepep ------------------------------------------------------------------------------
    def tell_fanout(self, layer: int, fanout: np.ndarray | None) -> None:
        """deepep: the fanout [W, P + A] of ``layer``'s kept slots this step (each rank's
        ``deepep.fanout_of_tokens``, as the route stage shared it), for its token ops
        until told again; None: model it from the kept counts (``deepep.modelled_fanout``).
        A replay must keep the traced run's capacity: the fanout counts kept slots."""
        if fanout is None:
            self._fanout.pop(layer, None)
        else:
            self._fanout[layer] = np.asarray(fanout, dtype=np.int64)

    def fanout(self, layer: int, kept: np.ndarray) -> np.ndarray:
        """deepep: the told fanout of ``layer``, else the one modelled from ``kept``."""
        told = self._fanout.get(layer)
        if told is not None:
            return told
        last = self._modelled.get(layer)
        if last is None or last[0] is not kept:  # the layer's four stages ask for the same counts
            last = self._modelled[layer] = (kept, deepep.modelled_fanout(kept, self.tokens, self.layout, self.grids))
        return last[1]

    def _deepep_ops(self, stage: str, layer: int, kept: np.ndarray) -> list[CollectiveOp]:
        m = self.s.model
        messages = deepep.row_bytes(stage, self.token_bytes, m.hidden_size * m.dtype_bytes, m.top_k)
        fan = self.fanout(layer, kept)
        ops = self.fanout_ops(layer) if stage == "dispatch" else []
        for g, (grid, pos) in enumerate(zip(self.grids, self.grid_positions)):
            ops += deepep.deepep_ops(stage, layer, grid, pos, fan[self.layout.rank_of[g]], messages,
                                     batch=1 if stage == "dispatch" else 0, sms=self.s.comm.deepep_sms)
        return ops

    def fanout_ops(self, layer: int) -> list[CollectiveOp]:
        """deepep: each EP group's all_gather of its members' fanout, batch 0 of the
        dispatch (``deepep.fanout_op``)."""
        return [deepep.fanout_op(self.layout, g, layer, grid.shape[0]) for g, grid in enumerate(self.grids)]

    def _allgather_ops(self, stage, layer, members):
        p = len(members)
        t, tb = self.tokens, self.token_bytes
        slots = t * self.s.model.top_k
        if stage == "dispatch":  # tokens, then each slot's expert index (int32) and probability (fp32)
            return [CollectiveOp("all_gather", members, stage, layer, size=t * tb, label="tokens"),
                    CollectiveOp("all_gather", members, stage, layer, size=slots * INDEX_BYTES, label="expert indices"),
                    CollectiveOp("all_gather", members, stage, layer, size=slots * PROB_BYTES, label="probabilities")]
        if stage == "combine":
            return [self._token_reduce_scatter(members, stage, layer, "partial outputs")]
        if stage == "combine_backward":
            return [CollectiveOp("all_gather", members, stage, layer, size=t * tb, label="output gradients")]
        return [self._token_reduce_scatter(members, stage, layer, "token gradients"),
                CollectiveOp("reduce_scatter", members, stage, layer, size=p * slots * PROB_GRAD_BYTES, label="probability gradients")]

    def _token_reduce_scatter(self, members, stage, layer, label) -> CollectiveOp:
        """The reduce-scatter of every member's P x T token rows: FP8 payloads (M22) are
        summed after decoding, so they travel as an all-to-all of shards (member i sends
        member j its T rows for j; ``real.comm.collectives.Comm.reduce_scatter_coded``)."""
        p, t, tb = len(members), self.tokens, self.token_bytes
        if self.s.comm.payload_dtype == "fp8":
            return CollectiveOp("all_to_all_v", members, stage, layer, matrix=np.full((p, p), t * tb, dtype=np.int64),
                                label=label, row_bytes=tb)
        return CollectiveOp("reduce_scatter", members, stage, layer, size=p * t * tb, label=label)

    def hierarchical_matrices(self, d: np.ndarray, group: int):
        """(grid, S1, S2) for EP group ``group``; S1[a] is node a's intra-node matrix
        (B x B), S2[b'] column b''s inter-node matrix (A x A). D is in EP-index order."""
        grid = self.grids[group]
        a_nodes, b = grid.shape
        pos = self.layout.index_of[grid.reshape(-1)]  # EP index of each grid cell
        dg = d[np.ix_(pos, pos)].reshape(a_nodes, b, a_nodes, b)  # [a, b, a', b']
        s1 = dg.sum(axis=2)  # [a, b, b']: (a,b) -> (a,b')
        s2 = dg.sum(axis=1).transpose(2, 0, 1)  # [b', a, a']: (a,b') -> (a',b')
        return grid, s1, s2

    def _hierarchical_ops(self, stage, layer, group, d):
        grid, s1, s2 = self.hierarchical_matrices(d, group)
        a_nodes, b = grid.shape
        # forward direction: intra-node first (batch 0), then inter-node (batch 1);
        # the reverse direction transposes both and runs inter-node first
        forward = stage in ("dispatch", "combine_backward")
        intra_batch, inter_batch = (0, 1) if forward else (1, 0)
        intra = [CollectiveOp("all_to_all_v", tuple(int(r) for r in grid[a]), stage, layer,
                              matrix=s1[a] if forward else s1[a].T, batch=intra_batch,
                              label="tokens intra-node", row_bytes=self.token_bytes)
                 for a in range(a_nodes) if b > 1]
        inter = [CollectiveOp("all_to_all_v", tuple(int(r) for r in grid[:, c]), stage, layer,
                              matrix=s2[c] if forward else s2[c].T, batch=inter_batch,
                              label="tokens inter-node", row_bytes=self.token_bytes)
                 for c in range(b) if a_nodes > 1]
        return intra + inter if forward else inter + intra

    # ---- gradient sync ------------------------------------------------------------------------
    @property
    def router_grad_bytes(self) -> int:
        """One layer's router gradient: H x E weight + E bias, fp32."""
        m = self.s.model
        return (m.hidden_size * m.num_experts + m.num_experts) * ROUTER_PARAM_BYTES

    def layer_grad_bytes(self, layer: int) -> int:
        """Bytes of ``layer``'s gradients that all ranks sum: its router's, and with the
        whole transformer its block's (``testbed.model.whole_model.block_grad_bytes``)."""
        return self.router_grad_bytes + block_grad_bytes(self.s, layer)

    def grad_buckets(self) -> list[list[int]]:
        """Layers of each router-gradient bucket, in the order their gradients are ready
        (last layer first), as torch DDP fills its buckets: a bucket takes layers until
        the next would take it over ``comm.grad_bucket_bytes`` (a layer larger than that
        gets a bucket of its own; 0 = one bucket). (DDP's smaller first bucket is not
        modelled.)"""
        cap = self.s.comm.grad_bucket_bytes
        buckets: list[list[int]] = []
        fill = 0  # bytes in the last bucket
        for layer in reversed(range(self.s.model.num_layers)):
            size = self.layer_grad_bytes(layer)
            if buckets and (cap == 0 or fill + size <= cap):
                buckets[-1].append(layer)
                fill += size
            else:
                buckets.append([layer])
                fill = size
        return buckets

    def dense_sync_ops(self) -> list[CollectiveOp]:
        """One all-reduce over all ranks per router-gradient bucket (``grad_buckets``),
        in backward order; its ``layer`` is the bucket's last-ready (lowest) layer.
        Expert weights never go through it (M8's pitfall). With Megatron-Core's distributed
        optimizer (``testbed.policy.distributed_optimizer``: ZeRO >= 1 with adam) each
        all-reduce is a reduce-scatter, and the bucket's ops are followed by the all-gathers
        of its updated parameters; ``transformer.grad_reduce_dtype`` sizes the gradients."""
        if len(self.world) < 2:
            return []
        tp = dense_weight_split(self.s)  # 1 under Ulysses: every dense weight whole, summed over all
        ops = []
        for b in self.grad_buckets():
            label = f"layers {min(b)}-{max(b)}"
            routers, dense = len(b) * self.router_grad_bytes, sum(block_grad_bytes(self.s, layer) for layer in b)
            if tp == 1:
                what = "dense gradients" if self.s.transformer.enabled else "router gradients"
                parts = [(self.world, routers, dense, f"{what}, {label}")]
            else:  # the routers (whole on every rank) over all ranks, each rank's 1/tp of the rest
                # over the ranks that hold the same 1/tp (the same index in their group)
                parts = [(self.world, routers, 0, f"router gradients, {label}")]
                parts += [(group, 0, dense, f"dense gradients (tensor-parallel shard {i}), {label}")
                          for i, group in enumerate(self.tp_peer_groups())]
            summed = [gradient_sum_ops(self.s, "dense_sync", members, min(b), fp32, model, text)
                      for members, fp32, model, text in parts]
            ops += [o[0] for o in summed] + [o[1] for o in summed if len(o) > 1]  # sums, then gathers
        return ops + self.replicated_grad_ops(min(self.grad_buckets()[-1]))

    def replicated_grad_ops(self, layer: int) -> list[CollectiveOp]:
        """With tensor and sequence parallelism, the gradients of the weights every member of
        a tensor-parallel group holds whole and computes on its own rows, MLA's down
        projections (``testbed.model.whole_model.mla_down_projection_params``), summed over
        each group after the backward: one all-reduce per group, every layer's coalesced
        (Megatron-Core's ``finalize_model_grads``, ``_allreduce_non_tensor_model_parallel_grads``),
        with MoE layer ``layer``'s bucket; the norms' are not counted, as ``block_grad_bytes``
        counts none."""
        t, p = self.s.transformer, self.s.parallelism
        if p.tp_size < 2 or not p.sequence_parallel or not t.enabled or is_ulysses(self.s):
            return []
        per_layer = mla_down_projection_params(shape_of(self.s)) * self.s.model.dtype_bytes
        size = reduced_bytes(self.s, per_layer * sum(block_attention_layers(self.s, i)
                                                     for i in range(self.s.model.num_layers)))
        if not size:
            return []
        label = f"replicated gradients (MLA down projections, tensor-parallel group), layers {layer}-{layer}"
        return [CollectiveOp("all_reduce", g, "dense_sync", layer, size=size, label=label) for g in self.tp_groups()]

    def fixed_groups(self) -> list[tuple[int, ...]]:
        """Member sets of the communicators every rank set holds from the start, each once,
        in the order the real backend creates them: the world, the EP groups, the replica
        groups, with tensor parallelism its groups and its shards' peers, and the node /
        column groups of the hierarchical all-to-all and of deepep. Sets of one rank need none."""
        lay = self.layout
        wanted = [self.world] + [tuple(sorted(lay.ep_group(g))) for g in range(lay.replicas)]
        wanted += [tuple(sorted(lay.replica_group(j))) for j in range(lay.ep_size)]
        if self.etp > 1:  # expert TP: its route's, its token ops' and its sync's groups
            wanted += lay.tp_ep_groups() + [tuple(sorted(g)) for g in lay.etp_groups()] + lay.expert_dp_groups()
        if self.s.parallelism.tp_size > 1 and self.s.transformer.enabled:
            wanted += self.tp_groups() + self.tp_peer_groups()
        for grid in self.grids or []:
            wanted += [tuple(int(r) for r in row) for row in grid]
            wanted += [tuple(int(r) for r in grid[:, c]) for c in range(grid.shape[1])]
        return [g for g in dict.fromkeys(wanted) if len(g) > 1]

    @property
    def tensor_parallel(self) -> TensorParallelOps:
        if self._tensor_parallel is None:
            self._tensor_parallel = TensorParallelOps(self.s, self.tp_groups())
        return self._tensor_parallel

    def tp_groups(self) -> list[tuple[int, ...]]:
        """The tensor-parallel groups: ``parallelism.tp_size`` consecutive ranks of a node."""
        tp = self.s.parallelism.tp_size
        return [tuple(range(r, r + tp)) for r in range(0, self.layout.world, tp)]

    def tp_peer_groups(self) -> list[tuple[int, ...]]:
        """The ranks holding the same 1/tp of the dense weights: one index in every group."""
        tp = self.s.parallelism.tp_size
        return [tuple(range(i, self.layout.world, tp)) for i in range(tp)]

    def dense_tp_ops(self, layer: int, backward: bool) -> list[list[CollectiveOp]]:
        """The tensor-parallel collectives of MoE layer ``layer``'s dense work, in order
        (``testbed.policy.tensor_parallel_ops``: its block's, with layer 0 the embedding's, with
        the last layer the output head's), then the context-parallel ring's steps of its
        attention sublayers (``testbed.policy.context_parallel``; ``is_ring_batch``)."""
        if self._context_parallel is None:
            self._context_parallel = ContextParallelOps(self.s)
        return self.tensor_parallel.dense(layer, backward) + self._context_parallel.block(layer, backward)

    @staticmethod
    def bucket_part(op: CollectiveOp) -> str:
        """What a ``dense_sync_ops`` op carries of its layers' weights: ``routers`` (tensor
        parallel: over all ranks), ``dense`` (tensor parallel: one shard's, over its peer
        group) or ``all`` (routers and dense weights over all ranks; the MoE stack's router
        buckets are ``routers``: it has no dense weights)."""
        if "tensor-parallel shard" in op.label:
            return "dense"
        return "routers" if op.label.startswith("router gradients") else "all"

    @staticmethod
    def bucket_layers(op: CollectiveOp) -> range:
        """The layers whose router gradients a ``dense_sync_ops`` op carries."""
        lo, hi = op.label.split()[-1].split("-")
        return range(int(lo), int(hi) + 1)

    def heat_ops(self, steps: int = 1) -> list[CollectiveOp]:
        """At a heat update (M18, every ``heat.update_interval`` steps): the compute heat of
        every expert instance in each of the ``steps`` steps since the last update
        (steps x L x E float64: kept slots, or the measured expert kernel seconds with
        ``heat.compute_source = "measured"``) summed over all ranks in one all-reduce, so
        that every rank's heat map, and the pager decisions drawn from it, are the same.
        Not needed for kept slots with one replica: the route all_gather already gave
        every rank the world's counts."""
        paged = self.s.pager.enabled  # memory heat is counted by each GPU's pager: summed too
        if not self.s.heat.enabled or len(self.world) < 2 or (not paged and self.s.heat.compute_source != "measured" and self.layout.replicas < 2):
            return []
        m = self.s.model
        rows = 2 if paged else 1
        what = "compute and memory heat" if paged else "compute heat"
        return [CollectiveOp("all_reduce", self.world, "heat", size=steps * rows * m.num_layers * m.num_experts * HEAT_BYTES,
                             label=f"{what} of {steps} steps")]

    def probe_ops(self, probed: int) -> list[CollectiveOp]:
        """M20 at a heat update: the seconds each of the ``probed`` experts took to answer its
        probe activation (float64 each, 0 on ranks without a replica of it), maximised over
        all ranks in one all-reduce, so that every rank wakes the same experts."""
        if len(self.world) < 2 or probed <= 0:
            return []
        return [CollectiveOp("all_reduce", self.world, "heat", size=probed * HEAT_BYTES,
                             label=f"probe answers of {probed} experts")]

    def expert_sync_ops(self, layer: int, active_groups: list[tuple[int, ...]]) -> list[CollectiveOp]:
        """Expert-gradient sync of one layer.

        ``active_groups[e]``: the ranks of e's replicas that hold a gradient (two_stage),
        ignored by allreduce.
        """
        lay, m = self.layout, self.s.model
        if lay.replicas < 2:
            return []
        if self.s.comm.expert_sync == "allreduce":  # each shard (expert TP: slice) over its replicas (expert DP)
            if self.etp > 1:
                size = lay.experts_per_rank * m.expert_bytes // self.etp
                parts = [(group, int(lay.index_of[group[0]]),
                          f"expert-TP slice {lay.etp_index[group[0]]}, shard {lay.index_of[group[0]]}")
                         for group in lay.expert_dp_groups() if len(group) > 1]
            else:
                size = lay.experts_per_rank * m.expert_bytes
                parts = [(tuple(sorted(lay.replica_group(j))), j, f"shard {j}") for j in range(lay.ep_size)]
            # the distributed optimizer's (testbed.policy.distributed_optimizer): reduce-scatters, then all-gathers
            summed = [gradient_sum_ops(self.s, "expert_sync", group, layer, 0, size, label, stream)
                      for group, stream, label in parts]
            return [o[0] for o in summed] + [o[1] for o in summed if len(o) > 1]
        ops = []
        synced = [e for e, grp in enumerate(active_groups) if len(grp) >= 2]
        per_batch = self.s.comm.sync_batch_experts
        # a batch of experts runs together (M9): every reduce-scatter of the batch, then
        # every all-gather, so that consecutive ops of one (layer, batch) are the batch
        # (both backends run consecutive ops of one batch concurrently)
        for first in range(0, len(synced), per_batch):
            batch = first // per_batch
            chunk = list(enumerate(synced[first:first + per_batch]))
            for stream, e in chunk:
                grp = active_groups[e]
                padded = padded_elements(m.expert_params, len(grp))
                ops.append(CollectiveOp("reduce_scatter", grp, "expert_sync", layer,
                                        size=reduced_bytes(self.s, padded * m.dtype_bytes),
                                        batch=2 * batch, stream=stream, cached=True, label=f"expert {e}"))
            for stream, e in chunk:
                grp = active_groups[e]
                padded = padded_elements(m.expert_params, len(grp))
                ops.append(CollectiveOp("all_gather", grp, "expert_sync", layer,
                                        size=padded // len(grp) * m.dtype_bytes, batch=2 * batch + 1, stream=stream,
                                        cached=True, label=f"expert {e}"))
        return ops


def packed_bytes(bits: int) -> int:
    """Bytes of ``bits`` booleans packed 8 to a byte (``numpy.packbits``): the size of
    the discovery and refresh-request payloads."""
    return -(-bits // 8)


def padded_elements(elements: int, group_size: int) -> int:
    """Elements of a tensor padded so ``group_size`` members get equal shards (M9)."""
    return -(-elements // group_size) * group_size
