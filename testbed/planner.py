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
  token gradients and of probability gradients.
- ``hierarchical`` (Tutel's 2DH): the group as a (nodes A x members per node B) grid;
  stage 1 inside each node sends member (a,b) -> (a,b') everything bound for column b'
  (S1 = sum over destination node of D), stage 2 across nodes sends (a,b') -> (a',b')
  the aggregate (S2 = sum over source member-in-node of D). Combine runs them reversed.

Expert sync (M8-M9) of replicated experts, per layer:
- ``allreduce``: one all_reduce of the shard's gradients over its R replicas;
- ``two_stage``: per expert e with an active group A_e (replicas whose EP group kept at
  least one token for e) of two or more ranks, reduce_scatter then all_gather within
  A_e; experts are taken ``sync_batch_experts`` at a time on concurrent streams.

Ops with a single member move nothing and are left out.
"""

from __future__ import annotations

import numpy as np

from testbed.collectives import CollectiveOp
from testbed.scenario import Scenario
from testbed.topology import Layout

COUNT_BYTES = 4  # routed counts travel as int32
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
        self.strategy = scenario.comm.token_strategy
        self.grids = ([self.layout.node_grid(g) for g in range(self.layout.replicas)]
                      if self.strategy == "hierarchical" else None)

    # ---- route --------------------------------------------------------------------------
    def route_ops(self, layer: int) -> list[CollectiveOp]:
        """Every rank shares its routed counts (E x int32); the same exchange is the
        discovery of active groups (M10) and gives dispatch split sizes and heat."""
        if len(self.world) < 2:
            return []
        return [CollectiveOp("all_gather", self.world, "route", layer,
                             size=self.s.model.num_experts * COUNT_BYTES, label="routed counts")]

    # ---- token exchange ---------------------------------------------------------------------
    def dispatch_matrix(self, kept: np.ndarray, group: int) -> np.ndarray:
        """D[i, j]: bytes EP member i sends member j (kept: ranks x experts slot counts)."""
        lay = self.layout
        members = lay.rank_of[group]
        per_expert = kept[members]  # P x E
        p = lay.ep_size
        return per_expert.reshape(p, p, lay.experts_per_rank).sum(-1).astype(np.int64) * self.token_bytes

    def token_ops(self, stage: str, layer: int, kept: np.ndarray) -> list[CollectiveOp]:
        """Ops of one token stage (dispatch, combine or their backward) for all groups."""
        ops: list[CollectiveOp] = []
        if self.layout.ep_size < 2:
            return ops
        for g in range(self.layout.replicas):
            members = self.layout.ep_group(g)
            if self.strategy == "allgather":
                ops += self._allgather_ops(stage, layer, tuple(sorted(members)))
                continue
            d = self.dispatch_matrix(kept, g)
            if self.strategy == "alltoall":
                mat = d if stage in ("dispatch", "combine_backward") else d.T
                order = np.argsort(members)  # ops list members by ascending rank
                ops.append(CollectiveOp("all_to_all_v", tuple(int(members[i]) for i in order), stage, layer,
                                        matrix=mat[np.ix_(order, order)], label="tokens"))
            else:
                ops += self._hierarchical_ops(stage, layer, g, d)
        return ops

    def _allgather_ops(self, stage, layer, members):
        p = len(members)
        t, tb = self.tokens, self.token_bytes
        slots = t * self.s.model.top_k
        if stage == "dispatch":  # tokens, then each slot's expert index (int32) and probability (fp32)
            return [CollectiveOp("all_gather", members, stage, layer, size=t * tb, label="tokens"),
                    CollectiveOp("all_gather", members, stage, layer, size=slots * INDEX_BYTES, label="expert indices"),
                    CollectiveOp("all_gather", members, stage, layer, size=slots * PROB_BYTES, label="probabilities")]
        if stage == "combine":
            return [CollectiveOp("reduce_scatter", members, stage, layer, size=p * t * tb, label="partial outputs")]
        if stage == "combine_backward":
            return [CollectiveOp("all_gather", members, stage, layer, size=t * tb, label="output gradients")]
        return [CollectiveOp("reduce_scatter", members, stage, layer, size=p * t * tb, label="token gradients"),
                CollectiveOp("reduce_scatter", members, stage, layer, size=p * slots * PROB_GRAD_BYTES, label="probability gradients")]

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
                              label="tokens intra-node")
                 for a in range(a_nodes) if b > 1]
        inter = [CollectiveOp("all_to_all_v", tuple(int(r) for r in grid[:, c]), stage, layer,
                              matrix=s2[c] if forward else s2[c].T, batch=inter_batch,
                              label="tokens inter-node")
                 for c in range(b) if a_nodes > 1]
        return intra + inter if forward else inter + intra

    # ---- gradient sync ------------------------------------------------------------------------
    def dense_sync_ops(self, layer: int) -> list[CollectiveOp]:
        """All-reduce of the router's gradient (H x E weight + E bias, fp32) over all ranks.
        Expert weights never go through it (M8's pitfall)."""
        if len(self.world) < 2:
            return []
        m = self.s.model
        size = (m.hidden_size * m.num_experts + m.num_experts) * ROUTER_PARAM_BYTES
        return [CollectiveOp("all_reduce", self.world, "dense_sync", layer, size=size, label="router gradients")]

    def dense_sync_bucket(self) -> list[CollectiveOp]:
        """Every layer's router gradient in one all-reduce (layer -1), as a data-parallel
        bucket: one call instead of one per layer when the sync waits for the whole
        backward anyway (no ``overlap.sync_with_backward``)."""
        ops = [op for layer in range(self.s.model.num_layers) for op in self.dense_sync_ops(layer)]
        if not ops:
            return []
        return [CollectiveOp("all_reduce", self.world, "dense_sync", -1, size=sum(op.size for op in ops),
                             label="router gradients, all layers")]

    def heat_ops(self) -> list[CollectiveOp]:
        """With measured compute heat (M18), every rank adds up the expert kernel seconds
        of all ranks (L*E float64) each step, so that every controller is told the same."""
        if self.s.heat.compute_source != "measured" or len(self.world) < 2:
            return []
        m = self.s.model
        return [CollectiveOp("all_reduce", self.world, "heat", size=m.num_layers * m.num_experts * 8,
                             label="measured compute heat")]

    def expert_sync_ops(self, layer: int, active_groups: list[tuple[int, ...]]) -> list[CollectiveOp]:
        """Expert-gradient sync of one layer.

        ``active_groups[e]``: the ranks of e's replicas that hold a gradient (two_stage),
        ignored by allreduce.
        """
        lay, m = self.layout, self.s.model
        if lay.replicas < 2:
            return []
        if self.s.comm.expert_sync == "allreduce":
            size = lay.experts_per_rank * m.expert_bytes
            return [CollectiveOp("all_reduce", tuple(sorted(lay.replica_group(j))), "expert_sync", layer, size=size,
                                 stream=j, label=f"shard {j}") for j in range(lay.ep_size)]
        ops = []
        synced = [e for e, grp in enumerate(active_groups) if len(grp) >= 2]
        per_batch = self.s.comm.sync_batch_experts
        for i, e in enumerate(synced):
            grp = active_groups[e]
            padded = padded_elements(m.expert_params, len(grp))
            batch, stream = divmod(i, per_batch)
            ops.append(CollectiveOp("reduce_scatter", grp, "expert_sync", layer, size=padded * m.dtype_bytes,
                                    batch=2 * batch, stream=stream, cached=True, label=f"expert {e}"))
            ops.append(CollectiveOp("all_gather", grp, "expert_sync", layer, size=padded // len(grp) * m.dtype_bytes,
                                    batch=2 * batch + 1, stream=stream, cached=True, label=f"expert {e}"))
        return ops


def padded_elements(elements: int, group_size: int) -> int:
    """Elements of a tensor padded so ``group_size`` members get equal shards (M9)."""
    return -(-elements // group_size) * group_size
