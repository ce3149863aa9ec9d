"""The cluster fabric (M21): a directed graph of GPUs, switches and host memory, with dense
per-edge arrays and vectorised routing for the network model.

Nodes: ``("gpu", r)`` per rank, ``("nvswitch", n)`` and ``("host", n)`` per node,
``("leaf", m)`` per micro-cluster and one logical ``("spine", 0)``. Every link is two
directed edges, each with ``bandwidth`` (bytes/s), ``latency`` (s), ``level`` (a
``testbed.topology`` level code: NVLINK, LEAF for the GPU NICs, SPINE for the leaf
uplinks, PCIE) and ``index`` (its position in the dense arrays).

The links and their figures come from ``testbed.links`` (the emulated cluster of the
real backend is wired from the same description); the spine is one aggregated switch
whose uplinks are a fluid model of ECMP. Routing is fixed (no
alternatives): same node -> gpu, nvswitch, gpu; same micro-cluster -> gpu, leaf, gpu
over the NICs; else gpu, leaf, spine, leaf, gpu. PCIe copies use the GPU's own link to
its node's host memory; the host side (memory, PCIe switches shared by two GPUs) is not
a bottleneck in this model.

Faults: ``set_capacity(selector, factor)`` scales links to ``factor`` times their nominal
bandwidth. A factor of 0 marks a link down; there is no rerouting, so the network model
raises ``RunError`` naming the link when a flow needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from testbed.errors import RunError
from testbed.links import BLOCKS, fabric_blocks
from testbed.profile import MachineProfile
from testbed.topology import LEVELS

KINDS = ("fabric", "h2d", "d2h")


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
    level[e]     level code (testbed.topology: NVLINK, LEAF, SPINE, PCIE)
    edges[e]     (u, v) node keys of edge e
    """

    def __init__(self, cluster, profile: MachineProfile):
        self.world = W = cluster.gpus
        self.gpus_per_node = cluster.gpus_per_node
        self.gpus_per_microcluster = cluster.gpus_per_microcluster
        self.nodes = W // cluster.gpus_per_node
        self.microclusters = M = cluster.microclusters
        self.profile_name = profile.name
        ranks = np.arange(W)
        node, mc = ranks // self.gpus_per_node, ranks // self.gpus_per_microcluster
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
        leaf_of_gpu = [("leaf", int(m)) for m in mc]
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
        self._mc = mc
        #: nic_relay[r]: the GPU whose NIC carries r's inter-node traffic (itself unless rerouted)
        self.nic_relay = np.arange(W)

    # ---- routing -----------------------------------------------------------------------
    def paths(self, src, dst, kind: str = "fabric") -> Paths:
        """Routes of flows ``src[i] -> dst[i]`` (rank arrays).

        kind ``fabric``: GPU to GPU (a flow to itself crosses no edge); ``h2d``: host
        memory of dst's node to GPU ``dst``; ``d2h``: GPU ``src`` to its host memory.
        """
        src = np.atleast_1d(np.asarray(src, dtype=np.int64))
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
        cross = self._mc[src] != self._mc[dst]
        inter = ~same_node & (src != dst)
        # a GPU whose NIC is down reaches the leaf through a node peer's NIC (NVLink hop)
        rs, rd = self.nic_relay[src], self.nic_relay[dst]
        table = np.empty((n, 8), dtype=np.int64)
        table[:, 0] = o["nvlink_up"] + src
        table[:, 1] = o["nvlink_down"] + rs
        table[:, 2] = o["nic_up"] + rs
        table[:, 3] = o["spine_up"] + self._mc[src]
        table[:, 4] = o["spine_down"] + self._mc[dst]
        table[:, 5] = o["nic_down"] + rd
        table[:, 6] = o["nvlink_up"] + rd
        table[:, 7] = o["nvlink_down"] + dst
        mask = np.zeros((n, 8), dtype=bool)
        intra = same_node & (src != dst)
        mask[:, 0] = intra | (inter & (rs != src))
        mask[:, 1] = inter & (rs != src)
        mask[:, 2] = inter
        mask[:, 3] = mask[:, 4] = cross
        mask[:, 5] = inter
        mask[:, 6] = inter & (rd != dst)
        mask[:, 7] = intra | (inter & (rd != dst))
        hops = mask.sum(axis=1)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(hops, out=indptr[1:])
        latency = (self.latency[table] * mask).sum(axis=1)
        return Paths(indptr, table[mask], latency)

    def reroute_nic(self, rank: int) -> int:
        """Send ``rank``'s inter-node traffic through the NIC of a node peer whose NIC is
        up (GPU -> NVLink -> peer -> NIC). Returns the peer; RunError if there is none."""
        node = self._node[rank]
        for peer in np.flatnonzero(self._node == node):
            nic = [self.offset["nic_up"] + peer, self.offset["nic_down"] + peer]
            if peer != rank and self.nic_relay[peer] == peer and (self.capacity[nic] > 0).all():
                self.nic_relay[rank] = peer
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
