"""Where every rank sits (node, micro-cluster) and how EP groups map onto ranks (M11, M21).

Rank ``r`` sits on node ``r // gpus_per_node`` and micro-cluster
``node // nodes_per_microcluster``; the real backend uses the same mapping so that CPU
ranks can stand for a small cluster. Placement decides which ranks form EP group ``g``:
``topology`` takes contiguous ranks (a group stays inside a node or a leaf, M11),
``strided`` spreads a group across the whole cluster (the topology-ignorant mapping of
C11), ``random`` shuffles ranks with a seeded generator.

Level codes (index into ``LEVELS``) name the link class a transfer crosses.
"""

from __future__ import annotations

from functools import cached_property
from typing import Protocol

import numpy as np

from testbed.core.errors import ScenarioError
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
        self.replicas = c.gpus // p.ep_size
        self.num_experts = scenario.model.num_experts
        self.experts_per_rank = self.num_experts // p.ep_size
        ranks = np.arange(self.world)
        if p.placement == "topology":
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
        """Ranks that hold shard ``j`` (EP index j of every group), in group order."""
        return tuple(int(r) for r in self.rank_of[:, j])

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
