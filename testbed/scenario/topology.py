"""Where every rank sits (node, micro-cluster) and how EP groups map onto ranks (M11, M21).

Rank ``r`` sits on node ``r // gpus_per_node`` and micro-cluster
``node // nodes_per_microcluster``; the real backend uses the same mapping so that CPU
ranks can stand for a small cluster. Placement decides which ranks form EP group ``g``:
``topology`` takes contiguous ranks (a group stays inside a node or a leaf, M11),
``strided`` spreads a group across the whole cluster (the topology-ignorant mapping of
C11), ``random`` shuffles ranks with a seeded generator.

Megatron-Core's layouts (issue 25, item 3): contiguous EP groups are Megatron-Core's MoE
parallel folding with expert TP 1 (``parallelism.moe_layout = "folded"``, ``etp_size`` 1),
and that is the placement code above, unchanged. With ``moe_layout = "nested"`` (EP carved
out of DP: its members TP x CP apart) or ``etp_size`` > 1, the EP groups, the expert-TP
(ETP) groups and the expert-DP groups are those of ``testbed.layout.process_groups``
(Megatron-Core's ``initialize_model_parallel``), and placement must be ``topology``. Under
expert TP each rank of an EP group holds 1/ETP of each of its shard's experts; its ETP
group (ETP ranks of the same EP index, one from each of ETP EP groups) holds them whole, and
its expert-DP group (the ranks of the same EP index and ETP slice in the other ETP groups)
the slice's replicas, over which its gradient is summed. The ranks are the layout's own (a pipeline
stage is laid out alone, as a cluster without pipelining).

Level codes (index into ``LEVELS``) name the link class a transfer crosses.
"""

from __future__ import annotations

from functools import cached_property
from typing import Protocol

import numpy as np

from testbed.core.errors import ScenarioError
from testbed.layout.process_groups import build_process_groups, groups_of_kind
from testbed.scenario.sections import ClusterConfig, ModelConfig, ParallelismConfig


class Geometry(Protocol):
    """What a layout is built from: the cluster, the parallelism and the expert count of
    a scenario (a ``Scenario`` is one; the scenario checks its fields with a layout, so
    the layout needs its sections, not the scenario)."""

    cluster: ClusterConfig
    parallelism: ParallelismConfig
    model: ModelConfig

LEVELS = ("nvlink", "leaf", "spine", "pcie")
NVLINK, LEAF, SPINE, PCIE = range(4)


class Layout:
    """Rank geometry and expert placement of one scenario. Pure and cheap to build."""

    def __init__(self, scenario: Geometry):
        c, p = scenario.cluster, scenario.parallelism
        self.world = c.gpus
        self.gpus_per_node = c.gpus_per_node
        self.gpus_per_microcluster = c.gpus_per_microcluster
        #: leaves per micro-cluster: one per rail with rail-optimised leaves (M21), else 1
        self.rails = c.gpus_per_node if getattr(c, "rail_optimized", False) else 1
        self.ep_size = p.ep_size
        #: EP groups (each with its own tokens and token exchange); with expert TP 1 also the
        #: replicas of each shard
        self.replicas = c.gpus // p.ep_size
        self.num_experts = scenario.model.num_experts
        self.experts_per_rank = self.num_experts // p.ep_size
        #: expert tensor parallelism: each rank holds 1/etp_size of each of its local experts
        self.etp_size = p.etp_size
        #: whether the expert groups are Megatron-Core's (nested, or expert TP > 1: module doc)
        self.megatron_groups = p.moe_layout != "folded" or p.etp_size > 1
        ranks = np.arange(self.world)
        if self.megatron_groups:
            order = self._megatron_ep_order(p)
        elif p.placement == "topology":
            order = ranks
        elif p.placement == "strided":
            # group g takes ranks g, g + R, g + 2R, ...: every member on a different node
            order = ranks.reshape(self.ep_size, self.replicas).T.reshape(-1)
        else:
            order = np.random.default_rng(p.placement_seed).permutation(self.world)
        #: rank_of[g, j] = global rank of EP index j in EP group g
        self.rank_of = order.reshape(self.replicas, self.ep_size)
        self.group_of = np.empty(self.world, dtype=np.int64)
        self.index_of = np.empty(self.world, dtype=np.int64)
        self.group_of[self.rank_of] = np.arange(self.replicas)[:, None]
        self.index_of[self.rank_of] = np.arange(self.ep_size)[None, :]
        if not self.megatron_groups:  # expert TP 1: each rank its own ETP group
            self.etp_members = ranks[:, None]
            self.etp_index = np.zeros(self.world, dtype=np.int64)

    def _megatron_ep_order(self, p: ParallelismConfig) -> np.ndarray:
        """The EP groups of Megatron-Core's layout (``build_process_groups`` on this
        layout's ranks, one pipeline stage), flattened in Megatron's order; sets
        ``etp_members`` and ``etp_index``. A ScenarioError names a layout Megatron-Core does
        not form, or a placement other than topology."""
        if p.placement != "topology":
            raise ScenarioError("parallelism.placement", p.placement,
                                f"with parallelism.moe_layout = {p.moe_layout!r} and etp_size = {p.etp_size} the "
                                "expert groups are Megatron-Core's: placement must be topology")
        groups = build_process_groups(self.world, p.tp_size, p.cp_size, 1, p.ep_size, p.etp_size, p.moe_layout)
        #: [W, etp_size] the ranks of each rank's ETP group, in ETP-index order
        self.etp_members = np.array([groups.of(r).etp for r in range(self.world)], dtype=np.int64)
        #: [W] each rank's ETP index: which 1/etp_size slice of its experts it holds
        self.etp_index = np.argmax(self.etp_members == np.arange(self.world)[:, None], axis=1)
        return np.array(groups_of_kind(groups, "ep"), dtype=np.int64).reshape(-1)

    # ---- geometry ----------------------------------------------------------------------
    def node(self, rank):
        return np.asarray(rank) // self.gpus_per_node

    def microcluster(self, rank):
        return np.asarray(rank) // self.gpus_per_microcluster

    def leaf(self, rank):
        """The leaf switch ``rank``'s NIC hangs off (``testbed.scenario.links.leaf_of``): its
        micro-cluster's, or with rail-optimised leaves its micro-cluster's leaf of its rail."""
        rank = np.asarray(rank)
        if self.rails == 1:
            return self.microcluster(rank)
        return self.microcluster(rank) * self.rails + rank % self.gpus_per_node

    def level(self, src, dst):
        """Link level a transfer from ``src`` to ``dst`` crosses on its direct route
        (arrays broadcast): NVLink inside a node, the leaf when both NICs hang off one
        leaf, else the spine (a PXN relay, which changes the route, is not counted here)."""
        src, dst = np.asarray(src), np.asarray(dst)
        same_node = self.node(src) == self.node(dst)
        same_leaf = self.leaf(src) == self.leaf(dst)
        return np.where(same_node, NVLINK, np.where(same_leaf, LEAF, SPINE))

    @cached_property
    def level_matrix(self) -> np.ndarray:
        """level_matrix[src, dst] for every pair of ranks (world x world, int8)."""
        r = np.arange(self.world)
        return self.level(r[:, None], r[None, :]).astype(np.int8)

    # ---- expert placement --------------------------------------------------------------
    def ep_group(self, g: int) -> tuple[int, ...]:
        """Global ranks of EP group ``g`` in EP-index order."""
        return tuple(int(r) for r in self.rank_of[g])

    def replica_group(self, j: int) -> tuple[int, ...]:
        """Ranks that hold shard ``j`` (EP index j of every group), in group order; with
        expert TP each holds one slice of it (``expert_dp_groups``: the slices' replicas)."""
        return tuple(int(r) for r in self.rank_of[:, j])

    def etp_groups(self) -> list[tuple[int, ...]]:
        """The expert-TP groups (ranks in ETP-index order), each once, by first rank; one
        rank each with expert TP 1."""
        return list(dict.fromkeys(tuple(int(r) for r in row) for row in self.etp_members))

    def expert_dp_groups(self) -> list[tuple[int, ...]]:
        """The expert-DP groups: the ranks holding the same slice of the same shard (EP index
        and ETP index), over which its gradients are summed, ranks ascending, by first rank.
        With expert TP 1 they are the replica groups, ``replica_group(j)``'s ranks."""
        groups: dict[tuple[int, int], list[int]] = {}
        for r in range(self.world):
            groups.setdefault((int(self.index_of[r]), int(self.etp_index[r])), []).append(r)
        return sorted(tuple(g) for g in groups.values())

    def tp_ep_groups(self) -> list[tuple[int, ...]]:
        """The expert TP x EP groups (Megatron's ``tp_ep``: the EP groups of one ETP group's
        ranks together, which hold every expert once), sorted ranks, by first rank."""
        seen = {tuple(sorted(int(x) for x in self.rank_of[self.group_of[list(row)]].reshape(-1)))
                for row in self.etp_members}
        return sorted(seen)

    def shard_of_expert(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def local_experts(self, rank: int) -> range:
        """Global expert ids whose replica lives on ``rank``."""
        j = int(self.index_of[rank])
        return range(j * self.experts_per_rank, (j + 1) * self.experts_per_rank)

    def expert_rank(self, group: int, expert: int) -> int:
        """Rank that serves ``expert`` for the tokens of EP group ``group``."""
        return int(self.rank_of[group, self.shard_of_expert(expert)])

    def local_expert_mask(self, scope: str = "node") -> np.ndarray:
        """[W, E] bool: expert e's replica for rank r's EP group sits in r's node (or
        micro-cluster): its tokens reach it without crossing a NIC (or the spine). M22's
        local-first routing bias favours these."""
        where = self.node if scope == "node" else self.microcluster
        holder = self.rank_of[self.group_of][:, np.arange(self.num_experts) // self.experts_per_rank]  # [W, E]
        return where(holder) == where(np.arange(self.world))[:, None]

    # ---- hierarchical all-to-all (M7, Tutel 2DH) -----------------------------------------
    def node_grid(self, g: int, strategy: str = "hierarchical") -> np.ndarray:
        """EP group ``g`` as a (nodes, members per node) grid of ranks, rows by node.

        Raises ScenarioError (naming ``strategy``, the token exchange that needs the grid)
        when nodes hold different numbers of members.
        """
        members = np.array(self.ep_group(g))
        nodes = self.node(members)
        order = np.lexsort((members, nodes))
        members, nodes = members[order], nodes[order]
        _, counts = np.unique(nodes, return_counts=True)
        if len(set(counts.tolist())) != 1:
            raise ScenarioError(
                "comm.token_strategy", strategy,
                f"EP group {g} has {counts.tolist()} members on its nodes; {strategy} needs the same "
                "number on every node (use placement = topology)")
        return members.reshape(len(counts), counts[0])

    def check_node_grid(self, strategy: str) -> None:
        """Raise ScenarioError unless every EP group is a grid of nodes x members, as the
        token exchange ``strategy`` (hierarchical, deepep) needs."""
        for g in range(self.replicas):
            self.node_grid(g, strategy)
