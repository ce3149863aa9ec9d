"""The cluster fabric (M21): a directed graph of GPUs, switches and host memory, with dense
per-edge arrays and vectorised routing for the network model.

Nodes: ``("gpu", r)`` per rank, ``("nvswitch", n)`` and ``("host", n)`` per node,
``("leaf", l)`` per leaf (one per micro-cluster, or per (micro-cluster, rail) with
``cluster.rail_optimized``: ``testbed.scenario.links.leaf_of``) and one logical ``("spine", 0)``.
Every link is two directed edges, each with ``bandwidth`` (bytes/s), ``latency`` (s),
``level`` (a ``testbed.scenario.topology`` level code: NVLINK, LEAF for the GPU NICs, SPINE for the
leaf uplinks, PCIE) and ``index`` (its position in the dense arrays).

The links and their figures come from ``testbed.scenario.links`` (the emulated cluster of the
real backend is wired from the same description); the spine is one aggregated switch
whose uplinks are a fluid model of ECMP. Routing is fixed (no alternatives): same node ->
gpu, nvswitch, gpu; else out of the source node through one GPU's NIC (the source's own,
or per flow ``nic_of_src``: another GPU of its node reached over NVLink first, as NCCL's
PXN and its rail-aligned rings do), to that NIC's leaf, over the spine when the
destination's NIC hangs off another leaf, and down the destination's NIC. PCIe copies use
the GPU's own link to its node's host memory; the host side (memory, PCIe switches shared
by two GPUs) is not a bottleneck in this model. Kind ``edge`` routes a flow over one given
edge: the traffic of in-switch reductions (NVLink SHARP, in-network reduction), which
ends at a switch, not at a GPU.

Faults: ``set_capacity(selector, factor)`` scales links to ``factor`` times their nominal
bandwidth. A factor of 0 marks a link down; there is no rerouting, so the network model
raises ``RunError`` naming the link when a flow needs it. ``reroute_nic`` sends a GPU's
inter-node traffic through a node peer's NIC (``routing_version`` counts such changes, for
callers that cache routes).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from testbed.core.errors import RunError
from testbed.scenario.links import BLOCKS, fabric_blocks, leaf_count, leaf_of, rails
from testbed.scenario.profile import MachineProfile
from testbed.scenario.topology import LEVELS

KINDS = ("fabric", "h2d", "d2h", "edge")


@dataclass(frozen=True)
class Paths:
    """Routes of many flows as a CSR incidence: flow i crosses ``edges[indptr[i]:indptr[i+1]]``.

    latency[i] is the sum of the latencies of flow i's edges, seconds.
    """

    indptr: np.ndarray
    edges: np.ndarray
    latency: np.ndarray

    @property
    def hops(self) -> np.ndarray:
        return np.diff(self.indptr)

    @property
    def flow_of_entry(self) -> np.ndarray:
        """flow index of each entry of ``edges`` (the COO row)."""
        return np.repeat(np.arange(len(self.indptr) - 1), self.hops)


class Fabric:
    """Graph plus dense arrays of one cluster. Build with ``build_fabric``.

    capacity[e]  current bandwidth of edge e, bytes/s (after faults)
    nominal[e]   payload bandwidth from the profile, bytes/s: the link figure times the
                 profile's ``protocol.payload_fraction`` (1 unless the figures are wire rates)
    latency[e]   seconds
    level[e]     level code (testbed.scenario.topology: NVLINK, LEAF, SPINE, PCIE)
    edges[e]     (u, v) node keys of edge e
    """

    def __init__(self, cluster, profile: MachineProfile):
        self.world = W = cluster.gpus
        self.gpus_per_node = cluster.gpus_per_node
        self.gpus_per_microcluster = cluster.gpus_per_microcluster
        self.nodes = W // cluster.gpus_per_node
        self.microclusters = cluster.microclusters
        self.rails = rails(cluster)  # leaves per micro-cluster (M21)
        self.leaves = M = leaf_count(cluster)
        self.profile_name = profile.name
        ranks = np.arange(W)
        node, leaf = ranks // self.gpus_per_node, leaf_of(cluster, ranks)
        spec = fabric_blocks(cluster, profile)  # block -> (count, bandwidth bytes/s, latency s, level)
        sizes = {b: spec[b].count for b in BLOCKS}
        self.offset = dict(zip(BLOCKS, np.cumsum([0] + [sizes[b] for b in BLOCKS[:-1]]).tolist()))
        self.num_edges = E = sum(sizes.values())
        self.nominal = np.empty(E)
        self.latency = np.empty(E)
        self.level = np.empty(E, dtype=np.int8)
        payload = profile.protocol.payload_fraction  # links shaped at wire rates carry less payload
        for b in BLOCKS:
            sl = slice(self.offset[b], self.offset[b] + sizes[b])
            share = 1.0 if b in ("h2d", "d2h") else payload
            self.nominal[sl], self.latency[sl], self.level[sl] = spec[b].bandwidth * share, spec[b].latency, spec[b].level
        self.capacity = self.nominal.copy()

        gpu = [("gpu", int(r)) for r in ranks]
        sw = [("nvswitch", int(n)) for n in node]
        host = [("host", int(n)) for n in node]
        leaf_of_gpu = [("leaf", int(m)) for m in leaf]
        leaves = [("leaf", m) for m in range(M)]
        spine = [("spine", 0)] * M
        ends = {
            "nvlink_up": (gpu, sw), "nvlink_down": (sw, gpu),
            "nic_up": (gpu, leaf_of_gpu), "nic_down": (leaf_of_gpu, gpu),
            "h2d": (host, gpu), "d2h": (gpu, host),
            "spine_up": (leaves, spine), "spine_down": (spine, leaves),
        }
        self.edges: list[tuple[tuple, tuple]] = [e for b in BLOCKS for e in zip(*ends[b])]
        self.graph = nx.DiGraph(name=f"fabric {W} GPUs ({profile.name})")
        self.graph.add_edges_from(
            (u, v, {"bandwidth": float(self.nominal[i]), "latency": float(self.latency[i]),
                    "level": int(self.level[i]), "index": i})
            for i, (u, v) in enumerate(self.edges))
        self._node = node
        self._leaf = leaf
        #: nic_relay[r]: the GPU whose NIC carries r's inter-node traffic (itself unless rerouted)
        self.nic_relay = np.arange(W)
        #: changes whenever routes change (``reroute_nic``): a key for cached routes
        self.routing_version = 0

    # ---- routing -----------------------------------------------------------------------
    def paths(self, src, dst, kind: str = "fabric", nic_of_src=None) -> Paths:
        """Routes of flows ``src[i] -> dst[i]`` (rank arrays).

        kind ``fabric``: GPU to GPU (a flow to itself crosses no edge); ``nic_of_src``
        (optional, per flow): the GPU of ``src[i]``'s node whose NIC an inter-node flow
        leaves through (module doc; ignored within a node); ``h2d``: host memory of dst's
        node to GPU ``dst``; ``d2h``: GPU ``src`` to its host memory; ``edge``: ``src[i]``
        is an edge index and the flow crosses that one edge (``dst`` is ignored).
        """
        src = np.atleast_1d(np.asarray(src, dtype=np.int64))
        if kind == "edge":
            if len(src) and (src.min() < 0 or src.max() >= self.num_edges):
                raise ValueError(f"edge index out of range [0, {self.num_edges})")
            return Paths(np.arange(len(src) + 1), src, self.latency[src])
        dst = np.atleast_1d(np.asarray(dst, dtype=np.int64))
        src, dst = np.broadcast_arrays(src, dst)
        for name, r in (("src", src), ("dst", dst)):
            if len(r) and (r.min() < 0 or r.max() >= self.world):
                raise ValueError(f"{name} rank out of range [0, {self.world})")
        n = len(src)
        if kind in ("h2d", "d2h"):
            edges = self.offset[kind] + (dst if kind == "h2d" else src)
            return Paths(np.arange(n + 1), edges, self.latency[edges])
        if kind != "fabric":
            raise ValueError(f"unknown transfer kind {kind!r} (one of {', '.join(KINDS)})")
        o = self.offset
        same_node = self._node[src] == self._node[dst]
        inter = ~same_node & (src != dst)
        nic = src
        if nic_of_src is not None:
            nic = np.broadcast_to(np.asarray(nic_of_src, dtype=np.int64), src.shape)
            if len(nic) and (nic.min() < 0 or nic.max() >= self.world):
                raise ValueError(f"nic_of_src rank out of range [0, {self.world})")
            wrong = inter & (self._node[nic] != self._node[src])
            if wrong.any():
                i = int(np.flatnonzero(wrong)[0])
                raise ValueError(f"nic_of_src {int(nic[i])} is not on the node of rank {int(src[i])}")
        # a GPU whose NIC is down reaches the leaf through a node peer's NIC (NVLink hop)
        rs, rd = self.nic_relay[nic], self.nic_relay[dst]
        cross = self._leaf[rs] != self._leaf[rd]
        table = np.empty((n, 8), dtype=np.int64)
        table[:, 0] = o["nvlink_up"] + src
        table[:, 1] = o["nvlink_down"] + rs
        table[:, 2] = o["nic_up"] + rs
        table[:, 3] = o["spine_up"] + self._leaf[rs]
        table[:, 4] = o["spine_down"] + self._leaf[rd]
        table[:, 5] = o["nic_down"] + rd
        table[:, 6] = o["nvlink_up"] + rd
        table[:, 7] = o["nvlink_down"] + dst
        mask = np.zeros((n, 8), dtype=bool)
        intra = same_node & (src != dst)
        mask[:, 0] = intra | (inter & (rs != src))
        mask[:, 1] = inter & (rs != src)
        mask[:, 2] = inter
        mask[:, 3] = mask[:, 4] = inter & cross
        mask[:, 5] = inter
        mask[:, 6] = inter & (rd != dst)
        mask[:, 7] = intra | (inter & (rd != dst))
        hops = mask.sum(axis=1)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(hops, out=indptr[1:])
        latency = (self.latency[table] * mask).sum(axis=1)
        return Paths(indptr, table[mask], latency)

    def rail_peer(self, src, dst):
        """The GPU of ``src``'s node on ``dst``'s rail (the same local index as ``dst``):
        whose NIC a rail-aligned inter-node message leaves through (PXN, M21)."""
        src, dst = np.asarray(src), np.asarray(dst)
        g = self.gpus_per_node
        return (src // g) * g + dst % g

    def nic_edges(self, ranks, up: bool) -> Paths:
        """Per rank, the edges between the GPU and its leaf (up: GPU -> leaf; down: leaf ->
        GPU): its NIC, or a node peer's NIC and the NVLink hop to it when rerouted."""
        r = np.atleast_1d(np.asarray(ranks, dtype=np.int64))
        relay = self.nic_relay[r]
        o = self.offset
        if up:
            table = np.stack([o["nvlink_up"] + r, o["nvlink_down"] + relay, o["nic_up"] + relay], axis=1)
        else:
            table = np.stack([o["nic_down"] + relay, o["nvlink_up"] + relay, o["nvlink_down"] + r], axis=1)
        mask = np.ones(table.shape, dtype=bool)
        moved = relay != r
        mask[:, 0 if up else 1] = moved
        mask[:, 1 if up else 2] = moved
        indptr = np.zeros(len(r) + 1, dtype=np.int64)
        np.cumsum(mask.sum(axis=1), out=indptr[1:])
        return Paths(indptr, table[mask], (self.latency[table] * mask).sum(axis=1))

    def leaf_of_nic(self, ranks) -> np.ndarray:
        """Per rank, the leaf its inter-node traffic enters (that of the NIC it uses)."""
        return self._leaf[self.nic_relay[np.asarray(ranks, dtype=np.int64)]]

    def reroute_nic(self, rank: int) -> int:
        """Send ``rank``'s inter-node traffic through the NIC of a node peer whose NIC is
        up (GPU -> NVLink -> peer -> NIC). Returns the peer; RunError if there is none."""
        node = self._node[rank]
        for peer in np.flatnonzero(self._node == node):
            nic = [self.offset["nic_up"] + peer, self.offset["nic_down"] + peer]
            if peer != rank and self.nic_relay[peer] == peer and (self.capacity[nic] > 0).all():
                self.nic_relay[rank] = peer
                self.routing_version += 1
                return int(peer)
        raise RunError(f"GPU {rank}: no GPU of its node has a working NIC to reroute through")

    def path(self, src_rank: int, dst_rank: int) -> np.ndarray:
        """Edge indices of the route from ``src_rank`` to ``dst_rank``."""
        return self.paths([src_rank], [dst_rank]).edges

    def pcie_path(self, rank: int, to_gpu: bool) -> np.ndarray:
        """The PCIe edge of ``rank``: host -> GPU when ``to_gpu``, else GPU -> host."""
        return self.paths([rank], [rank], "h2d" if to_gpu else "d2h").edges

    # ---- names and faults ----------------------------------------------------------------
    def edge_index(self, u: tuple, v: tuple) -> int:
        return self.graph.edges[u, v]["index"]

    def edge_name(self, e: int) -> str:
        (a, i), (b, j) = self.edges[e]
        return f"{a}{i}->{b}{j}"

    def select(self, selector) -> np.ndarray:
        """Edge indices a selector names: a level name ("nvlink", "leaf", "spine",
        "pcie"), a node key ``("gpu", 3)`` (every edge at that node), a pair of node keys
        (both directions of that link), or edge indices."""
        if isinstance(selector, str):
            if selector not in LEVELS:
                raise ValueError(f"unknown level {selector!r} (one of {', '.join(LEVELS)})")
            return np.flatnonzero(self.level == LEVELS.index(selector))
        if isinstance(selector, tuple) and len(selector) == 2 and isinstance(selector[0], str):
            g = self.graph
            return np.array(sorted({g.edges[e]["index"] for e in
                                    list(g.in_edges(selector)) + list(g.out_edges(selector))}))
        if isinstance(selector, tuple) and len(selector) == 2 and isinstance(selector[0], tuple):
            u, v = selector
            return np.array([self.edge_index(u, v), self.edge_index(v, u)])
        idx = np.atleast_1d(np.asarray(selector, dtype=np.int64))
        if len(idx) and (idx.min() < 0 or idx.max() >= self.num_edges):
            raise ValueError(f"edge index out of range [0, {self.num_edges})")
        return idx

    def set_capacity(self, selector, factor: float) -> np.ndarray:
        """Set the selected edges to ``factor`` x nominal bandwidth (0 = down, 1 = healthy).

        Returns the edge indices changed. A running ``Network`` must be told with
        ``Network.refresh()`` so that its flows are re-shared.
        """
        if not (factor >= 0 and np.isfinite(factor)):
            raise ValueError(f"capacity factor must be a finite number >= 0, got {factor!r}")
        idx = self.select(selector)
        self.capacity[idx] = self.nominal[idx] * factor
        for e in idx:
            u, v = self.edges[e]
            self.graph.edges[u, v]["bandwidth"] = float(self.capacity[e])
        return idx


def build_fabric(scenario, profile: MachineProfile) -> Fabric:
    """The fabric of ``scenario.cluster`` (a Scenario, or a ClusterConfig itself)."""
    return Fabric(getattr(scenario, "cluster", scenario), profile)
