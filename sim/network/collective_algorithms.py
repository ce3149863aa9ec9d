"""The algorithms the library runs for collective ops, decomposed into flows on the fabric (M21).

An op runs as sequential *stages* of concurrent *atoms* (``stages(op)``); each atom is a
set of flows (``atom_flows``): ``(src, dst, nbytes, fixed_latency_s)``. A stage waits its
atoms' largest fixed latency, then its flows start together without their own path
latency; it ends when the last one arrives. The fixed latency is the library's software
cost, per call plus per sequential step of the algorithm (``SoftwareLatency``), and the
path latency of each step. With p members, g of them on each node, a nodes, C channels
(``collectives.channels``; 0 = one per GPU of a node, at most the fewest members on one
node) and the per-member ``size`` S of ``CollectiveOp``:

- **ring** all_reduce / all_gather / reduce_scatter: member i -> i+1 of 2(p-1)/p S,
  (p-1) S, (p-1)/p S per flow, 2(p-1), p-1, p-1 steps at the slowest hop's latency.
  Across nodes (C >= 2) it runs as C rings of S/C each, as NCCL does: channel c visits
  each node's members starting from its c-th, and its node crossings go from node k's
  last member of the channel, over NVLink, to the GPU on the rail of node k+1's first
  member and through that GPU's NIC (``Flows.nic_of_src``), so that the C channels cross
  on C different rails and every NIC and NVLink port carries one channel: busbw =
  min(NVLink, C x NIC). Its steps take the ring's hops in turn (the mean hop latency per
  step: NVLink steps at NVLink latency, crossings at the network's, as NCCL's tuner
  counts them). C = 1 (gloo): one ring in rank order, each crossing through the sender's
  own NIC, every step at the slowest hop (what the emulated and calibrated profiles were
  fitted with);
- **tree** all_reduce (NCCL's double binary tree): per channel, a chain through each
  node's members (from its c-th) and two binary trees over the nodes' chain heads
  (``double_tree``: each node a leaf in one of them), each tree carrying S/2C up
  (reduce) and down (broadcast), pipelined: 2 (g-1 + depth) steps at the chain's and the
  network's hop latency, depth ~ log2 a; per NIC each way at most 2 S/C (ring: 2(p-1)/p
  S/C; on 2 nodes the tree's S/C), per NVLink port 2(g-1)/g S (ring: 2(p-1)/p S);
- **hierarchical**: with g >= 2 members on every node, stages one after the other:
  all-reduce = reduce-scatter in each node (S), ring all-reduce across nodes among
  members of the same position (S/g), all-gather in each node (S/g); all-gather = across
  nodes (S), then in each node (S x a); reduce-scatter = in each node (S), then across
  nodes (S/g). Elsewhere the ring;
- **nvls** (``collectives.nvls``, NVLink SHARP): in one node the switch reduces and
  multicasts, on single links (``Flows.kind = "edge"``): all-reduce S (1 + 1/g) up and
  down each member's NVLink port (2 steps), reduce-scatter S up and S/g down (1 step),
  all-gather (n per member) n up and g n down (1 step); an all-reduce across nodes is NVLS
  reduce-scatter in each node, the S/g shards across nodes by tree (NCCL's NVLSTree) or
  collnet when the profile has it, and NVLS all-gather, pipelined (one stage, the parts'
  latencies added). Elsewhere the ring;
- **collnet** all_reduce (``collectives.collnet``, in-network reduction, IB SHARP): ring
  reduce-scatter in each node, each member's S/g shard up its NIC and the reduced shard
  back down (the switches reduce: one S/g per shard on each spine uplink of a leaf the
  shard's members hang off, when they hang off several leaves), ring all-gather in each
  node, pipelined; 2 steps across, at the latency of one route over the top switch;
- direct **all_to_all_v**: one flow per non-zero off-diagonal matrix entry, all at once:
  p-1 software steps, the largest path latency among them, and
  ``collectives.all_to_all_peer_us`` for each peer message of the member with the most
  (sent plus received: a uniform all-to-all 2(p-1)); with ``collectives.pxn`` an
  inter-node message leaves through the NIC of its node's GPU on the destination's rail;
- **p2p**: one flow, one step at its path latency (PXN as for all-to-all).

On one link class of bandwidth B the ring gives the nccl-tests closed forms: all-reduce
time = 2(p-1)/p * S / B (bus bandwidth = algbw * 2(p-1)/p = B), all-gather and
reduce-scatter busbw = algbw * (p-1)/p = B.

``CollectiveAlgorithms`` holds these decompositions as methods of ``CollectiveModel``
(``sim.network.collective_model``: the choice of algorithm, the route cache and the timing),
which sets what they read: ``fabric``, ``call_latency`` and ``step_latency`` (s),
``peer_latency`` (s per peer message), ``channels``, ``pxn``, ``collnet``, and provides
``unit_load`` and ``software_steps``.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numpy as np

from sim.hardware.fabric import Paths
from testbed.policy.collectives import algorithm_messages

RING_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
NVLS_KINDS = ("nvls_all_reduce", "nvls_reduce_scatter", "nvls_all_gather")


class Flows(NamedTuple):
    """Flows of one atom: rank arrays, bytes per flow, the latency before they start (s), the
    library messages each flow carries, per flow the GPU of the source's node whose NIC an
    inter-node flow leaves through (None: the source's own), and the route kind: ``fabric``
    (rank to rank) or ``edge`` (``src[i]`` = ``dst[i]`` is the one fabric edge flow i
    crosses: traffic that ends at a switch that reduces or multicasts it)."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    fixed_latency_s: float
    messages: int = 1
    nic_of_src: np.ndarray | None = None
    kind: str = "fabric"


class Atom(NamedTuple):
    """One ring / tree / switch / direct collective inside an op's algorithm (bytes as in
    CollectiveOp). ``fixed_s`` and ``steps``, when set, replace the atom's own latency and
    software steps (the parts of a pipelined stage: one carries the stage's)."""

    kind: str  # a ring kind, all_to_all_v, p2p, tree, nvls_all_reduce | nvls_reduce_scatter | nvls_all_gather, collnet
    members: tuple[int, ...]
    size: float
    matrix: np.ndarray | None = None
    fixed_s: float | None = None
    steps: int | None = None


class UnitLoad(NamedTuple):
    """An atom of 1 byte alone on the fabric: its fixed latency (s), the edges it uses,
    bytes on each per byte of the atom's size, library messages on each, software steps."""

    fixed_s: float
    edges: np.ndarray
    per_byte: np.ndarray
    messages: np.ndarray
    steps: int


class _Template(NamedTuple):
    """An atom's flows at size 1, its software steps and its flows' routes."""

    flows: Flows
    steps: int
    paths: Paths | None = None


class _Channels(NamedTuple):
    """Members in channel order: ``orders[c]`` is channel c's sequence (node by node);
    per position its node group and place in the node; members per node; channels."""

    orders: np.ndarray
    group: np.ndarray
    pos: np.ndarray
    count: np.ndarray
    count_c: int


class CollectiveAlgorithms:
    """The per-algorithm decompositions of ``CollectiveModel`` (module doc): an op's stages
    by algorithm (hierarchical, NVLS, collnet, pipelined parts) and each atom's flows at size
    1 (rings over channels, trees, NVLS and collnet switch traffic, p2p, all-to-all)."""

    # ---- stages ------------------------------------------------------------------------------
    def stages_of(self, kind: str, algorithm: str, members: tuple[int, ...], size: float) -> list[list[Atom]]:
        """Stages of a ring-kind collective run by ``algorithm`` (not ``auto``); every
        atom's size is proportional to ``size``."""
        if kind == "reduce_scatter" and algorithm == "all_reduce":
            return [[Atom("all_reduce", members, size)]]  # gloo: the full tensor is all-reduced
        out = None
        if algorithm == "hierarchical":
            grid = self._node_grid(members, 2)
            out = None if grid is None else self._hierarchical(kind, grid, size)
        elif algorithm == "tree" and kind == "all_reduce" and len(members) > 1:
            out = [[Atom("tree", members, size)]]
        elif algorithm == "nvls":
            out = self._nvls(kind, members, size)
        elif algorithm == "collnet" and kind == "all_reduce":
            out = self._collnet(members, size)
        return out if out is not None else [[Atom(kind, members, size)]]

    def _node_grid(self, members, least: int) -> np.ndarray | None:
        """Members as (nodes x per node), or None unless they span two nodes or more with
        the same number, at least ``least``, on each."""
        m = np.asarray(members)
        node = m // self.fabric.gpus_per_node
        nodes, counts = np.unique(node, return_counts=True)
        if len(nodes) < 2 or counts[0] < least or (counts != counts[0]).any():
            return None
        return m[np.lexsort((m, node))].reshape(len(nodes), counts[0])

    @staticmethod
    def _hierarchical(kind: str, grid: np.ndarray, size: float) -> list[list[Atom]]:
        a, g = grid.shape
        rows, cols = _rows_cols(grid)
        if kind == "all_reduce":
            return [[Atom("reduce_scatter", r, size) for r in rows],
                    [Atom("all_reduce", c, size / g) for c in cols],
                    [Atom("all_gather", r, size / g) for r in rows]]
        if kind == "all_gather":
            return [[Atom("all_gather", c, size) for c in cols], [Atom("all_gather", r, size * a) for r in rows]]
        return [[Atom("reduce_scatter", r, size) for r in rows], [Atom("reduce_scatter", c, size / g) for c in cols]]

    def _nvls(self, kind: str, members, size: float):
        m = np.asarray(members)
        if len(m) < 2:
            return None
        if (m // self.fabric.gpus_per_node == m[0] // self.fabric.gpus_per_node).all():
            return [[Atom("nvls_" + kind, members, size)]]
        grid = self._node_grid(members, 2)
        if kind != "all_reduce" or grid is None:
            return None
        g = grid.shape[1]
        rows, cols = _rows_cols(grid)
        across = "collnet" if self.collnet else "tree"
        return self._pipelined([[Atom("nvls_reduce_scatter", r, size) for r in rows],
                                [Atom(across, c, size / g) for c in cols],
                                [Atom("nvls_all_gather", r, size / g) for r in rows]])

    def _collnet(self, members, size: float):
        grid = self._node_grid(members, 1)
        if grid is None:
            return None
        g = grid.shape[1]
        if g == 1:
            return [[Atom("collnet", members, size)]]
        rows, cols = _rows_cols(grid)
        return self._pipelined([[Atom("reduce_scatter", r, size) for r in rows],
                                [Atom("collnet", c, size / g) for c in cols],
                                [Atom("all_gather", r, size / g) for r in rows]])

    def _pipelined(self, parts: list[list[Atom]]) -> list[list[Atom]]:
        """One stage running ``parts`` pipelined: all their atoms at once, the stage's
        latency one call plus each part's latency beyond its call, its steps the parts'."""
        fixed, steps = self.call_latency, 0
        for part in parts:
            loads = [u for u in (self.unit_load(a) for a in part) if u is not None]
            fixed += max((u.fixed_s - self.call_latency for u in loads), default=0.0)
            steps += max((u.steps for u in loads), default=0)
        atoms = [a._replace(fixed_s=0.0, steps=0) for part in parts for a in part]
        atoms[0] = atoms[0]._replace(fixed_s=fixed, steps=steps)
        return [atoms]

    # ---- atoms -----------------------------------------------------------------------------
    def _all_to_all(self, atom: Atom) -> Flows:
        m = np.asarray(atom.members, dtype=np.int64)
        mat = np.asarray(atom.matrix, dtype=np.float64)
        i, j = np.nonzero(mat)
        keep = i != j
        src, dst, nbytes = m[i[keep]], m[j[keep]], mat[i[keep], j[keep]]
        if len(src) == 0:
            return Flows(src, dst, nbytes, 0.0 if len(m) < 2 else self.call_latency)
        nic = self.pxn_nics(src, dst)
        hop = float(self.fabric.paths(src, dst, nic_of_src=nic).latency.max())  # all messages in flight at once
        return Flows(src, dst, nbytes, self.all_to_all_fixed(atom, hop), 1, nic)

    def all_to_all_fixed(self, atom: Atom, hop_s: float, peers: int | None = None) -> float:
        """Seconds before an all-to-all's bytes flow: one call, its software steps, the
        largest path latency ``hop_s`` of its messages, and the per-peer cost of the member
        with the most peer messages (those it sends plus those it receives; ``peers`` when
        the caller counted them)."""
        fixed = self.call_latency + self.software_steps(atom) * self.step_latency + hop_s
        if self.peer_latency > 0:
            if peers is None:
                nz = np.asarray(atom.matrix) != 0
                np.fill_diagonal(nz, False)
                peers = int((nz.sum(axis=1) + nz.sum(axis=0)).max())
            fixed += self.peer_latency * peers
        return fixed

    def pxn_nics(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray | None:
        """Per all-to-all / p2p message, the GPU whose NIC it leaves through: with PXN the
        GPU of its node on the destination's rail; None without PXN (the source's own)."""
        return self._rail_nics(src, dst) if self.pxn else None

    def _rail_nics(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        g = self.fabric.gpus_per_node
        return np.where(src // g != dst // g, self.fabric.rail_peer(src, dst), src)

    def _empty(self, m) -> _Template:
        return _Template(Flows(m[:0], m[:0], np.zeros(0), 0.0), 0)

    def _channels(self, m: np.ndarray) -> _Channels:
        """The members' per-channel order: by node (nodes in order of first appearance),
        channel c starting each node's members at its c-th (module doc)."""
        node = m // self.fabric.gpus_per_node
        _, first, inv = np.unique(node, return_index=True, return_inverse=True)
        rank_of_node = np.empty(len(first), dtype=np.int64)
        rank_of_node[np.argsort(first)] = np.arange(len(first))
        group = rank_of_node[inv]
        order = np.argsort(group, kind="stable")
        members, group = m[order], group[order]
        count = np.bincount(group)
        start = np.concatenate([[0], np.cumsum(count)[:-1]])
        pos = np.arange(len(m)) - start[group]
        c_count = 1 if len(count) < 2 else int(min(self.channels, count.min()))
        c = np.arange(c_count)[:, None]
        orders = members[start[group] + (pos + c) % count[group]]  # [channel, position]
        return _Channels(orders, group, pos, count, c_count)

    def _ring(self, kind: str, m: np.ndarray) -> _Template:
        p = len(m)
        if p < 2:
            return self._empty(m)
        ch = self._channels(m)
        rings = ch.orders if ch.count_c >= 2 else m[None, :]  # one ring: rank order
        src, dst = rings.reshape(-1), np.roll(rings, -1, axis=1).reshape(-1)
        nic = self._rail_nics(src, dst) if ch.count_c >= 2 else None
        paths = self.fabric.paths(src, dst, nic_of_src=nic)
        # one ring: every step at its slowest hop; NCCL's channels: a step's chunk moves one
        # hop on, so the steps add up the hops of the ring in turn (their mean per step)
        hop = float(paths.latency.max()) if ch.count_c < 2 else float(paths.latency.mean())
        per_flow, steps = ring_share(kind, p, 1.0)
        return _Template(Flows(src, dst, np.full(len(src), per_flow / ch.count_c), self.fixed_latency(steps, hop),
                               algorithm_messages(kind, p), nic), steps, paths)

    def _p2p(self, m: np.ndarray) -> _Template:
        if m[0] == m[1]:
            return self._empty(m)
        src, dst = m[:1], m[1:2]
        nic = self.pxn_nics(src, dst)
        paths = self.fabric.paths(src, dst, nic_of_src=nic)
        return _Template(Flows(src, dst, np.ones(1), self.fixed_latency(1, float(paths.latency[0])), 1, nic), 1, paths)

    def _tree(self, m: np.ndarray) -> _Template:
        if len(m) < 2:
            return self._empty(m)
        ch = self._channels(m)
        c_count, orders = ch.count_c, ch.orders
        t1, t2 = double_tree(len(ch.count))
        # chains: reduce up to each node's head, broadcast back down (both trees' halves)
        link = ch.pos < ch.count[ch.group] - 1  # position -> the next of its node
        lo, hi = orders[:, :-1][:, link[:-1]].reshape(-1), orders[:, 1:][:, link[:-1]].reshape(-1)
        heads = orders[:, (np.concatenate([[0], np.cumsum(ch.count)[:-1]]))]  # [channel, node]
        tree_src, tree_dst = [], []
        for parent in (t1, t2):
            k = np.flatnonzero(parent >= 0)
            tree_src += [heads[:, k].reshape(-1), heads[:, parent[k]].reshape(-1)]
            tree_dst += [heads[:, parent[k]].reshape(-1), heads[:, k].reshape(-1)]
        tree_src, tree_dst = np.concatenate(tree_src), np.concatenate(tree_dst)
        src = np.concatenate([hi, lo, tree_src])
        dst = np.concatenate([lo, hi, tree_dst])
        nbytes = np.concatenate([np.full(2 * len(lo), 1.0 / c_count), np.full(len(tree_src), 0.5 / c_count)])
        nic = self._rail_nics(src, dst) if c_count >= 2 else None
        paths = self.fabric.paths(src, dst, nic_of_src=nic)
        lat = paths.latency
        g = self.fabric.gpus_per_node
        inter = src // g != dst // g
        intra_hop = float(lat[~inter].max()) if (~inter).any() else 0.0
        inter_hop = float(lat[inter].max()) if inter.any() else 0.0
        chain, depth = int(ch.count.max()) - 1, max(tree_depth(t1), tree_depth(t2))
        fixed = self.call_latency + 2 * (chain * (self.step_latency + intra_hop) + depth * (self.step_latency + inter_hop))
        return _Template(Flows(src, dst, nbytes, fixed, 1, nic), 2 * (chain + depth), paths)

    def _switch_nvls(self, kind: str, m: np.ndarray) -> _Template:
        """NVLink SHARP in one node: bytes on each member's NVLink port up and down."""
        g = len(m)
        if g < 2:
            return self._empty(m)
        f = self.fabric
        up, down, steps = {"nvls_all_reduce": (1 + 1 / g, 1 + 1 / g, 2), "nvls_reduce_scatter": (1.0, 1 / g, 1),
                           "nvls_all_gather": (1.0, float(g), 1)}[kind]
        e_up, e_down = f.offset["nvlink_up"] + m, f.offset["nvlink_down"] + m
        edges = np.concatenate([e_up, e_down])
        hop = float((f.latency[e_up] + f.latency[e_down]).max())  # GPU -> switch -> GPU
        nbytes = np.concatenate([np.full(g, up), np.full(g, down)])
        return _Template(Flows(edges, edges, nbytes, self.fixed_latency(steps, hop), 1, None, "edge"), steps)

    def _switch_collnet(self, m: np.ndarray) -> _Template:
        """In-network reduction of one shard per member: up each member's NIC, reduced
        at its leaf (or the spine, when the members' NICs hang off several leaves), back
        down; one copy per leaf on the spine uplinks."""
        if len(m) < 2:
            return self._empty(m)
        f = self.fabric
        up, down = f.nic_edges(m, up=True), f.nic_edges(m, up=False)
        leaves = np.unique(f.leaf_of_nic(m))
        edges = [up.edges, down.edges]
        latency = float(up.latency.max() + down.latency.max())
        if len(leaves) > 1:
            edges += [f.offset["spine_up"] + leaves, f.offset["spine_down"] + leaves]
            latency += float(f.latency[f.offset["spine_up"] + leaves].max() + f.latency[f.offset["spine_down"] + leaves].max())
        edges = np.concatenate(edges)
        fixed = self.call_latency + 2 * self.step_latency + latency  # one round trip over the top switch
        return _Template(Flows(edges, edges, np.ones(len(edges)), fixed, 1, None, "edge"), 2)

    def fixed_latency(self, steps: int, hop_s: float) -> float:
        """Seconds before an atom's bytes flow: one call, and ``steps`` sequential steps
        each paying the library's step cost and the path latency ``hop_s``."""
        return self.call_latency + steps * (self.step_latency + hop_s)


def _rows_cols(grid: np.ndarray) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Members of each node (rows) and of each position across nodes (columns)."""
    return ([tuple(int(x) for x in row) for row in grid], [tuple(int(x) for x in col) for col in grid.T])


def ring_share(kind: str, p: int, size: float) -> tuple[float, int]:
    """(bytes per ring flow, sequential hops) of a ring all-reduce / all-gather / reduce-scatter."""
    return {"all_reduce": (2 * (p - 1) / p * size, 2 * (p - 1)),
            "all_gather": ((p - 1) * size, p - 1),
            "reduce_scatter": ((p - 1) / p * size, p - 1)}[kind]


def binary_tree(n: int) -> np.ndarray:
    """NCCL's binary tree over ``n`` ranks (``ncclGetBtree``): the parent of each rank,
    -1 at the root 0; a rank's parent flips its lowest set bit and sets the next one."""
    parent = np.full(n, -1, dtype=np.int64)
    for r in range(1, n):
        bit = r & -r
        up = (r ^ bit) | (bit << 1)
        parent[r] = up if up < n else r ^ bit
    return parent


@cache
def double_tree(n: int) -> tuple[np.ndarray, np.ndarray]:
    """NCCL's double binary tree over ``n`` ranks (``ncclGetDtree``): the binary tree and
    its mirror (n even) or shift by one (n odd), so that each rank is interior in at most
    one of them."""
    t1 = binary_tree(n)
    r = np.arange(n)
    if n % 2:
        u = t1[(r - 1) % n]
        t2 = np.where(u < 0, -1, (u + 1) % n)
    else:
        u = t1[n - 1 - r]
        t2 = np.where(u < 0, -1, n - 1 - u)
    return t1, t2


def tree_depth(parent: np.ndarray) -> int:
    """Edges on the longest path from a rank to the root."""
    depth = np.zeros(len(parent), dtype=np.int64)
    q = np.arange(len(parent))
    while len(q) and (parent[q] >= 0).any():
        up = parent[q] >= 0
        depth += up
        q = np.where(up, parent[q], q)
    return int(depth.max(initial=0))
