"""Collective operations as the planner emits them, and the bytes they move.

One ``CollectiveOp`` is one call of a collective on a group of ranks. Both backends read
the same op: the simulator times it on its network, the real backend executes it with
torch.distributed and counts the bytes from the tensors it really passed, with the
functions below (``docs/bytes.md``: what is counted, and what only an emulated
cluster's kernel counters measure). Bytes are *payload bytes* that leave a rank for
another, by the algorithm the library runs, without headers or retransmissions: for
the ring and direct algorithms the quantity nccl-tests calls bus bytes:

- ``all_to_all_v`` (direct): every off-diagonal entry of the send matrix;
- ``all_gather`` (ring), ``size`` = bytes each member contributes: ``p (p-1) size``;
- ``reduce_scatter`` (ring), ``size`` = input bytes per member: ``(p-1) size``;
- ``all_reduce`` (ring), ``size`` = tensor bytes: ``2 (p-1) size``;
- ``p2p``: ``size`` when source and destination differ.

gloo runs a reduce-scatter as an all-reduce of the whole input, each member then
keeping its shard (torch's ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``: a
clone, ``allreduce``, ``chunk``): with ``reduce_scatter_as_all_reduce`` a reduce-scatter
is counted as the ring all-reduce of its input, ``2 (p-1) size``. The real backend sets
it from the library it runs (``real.comm.collectives``), the simulator from the machine profile
(``reduce_scatter_runs_as_all_reduce``: ``collectives.algorithm.reduce_scatter =
"all_reduce"``), so both count the same bytes for the same library. The other
algorithms a profile may name (tree, hierarchical, NVLS, collnet) are modelled in
*time* only (``sim.network.collective_model``); their bytes are counted as the ring's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from testbed.scenario.topology import LEVELS, Layout

KINDS = ("all_to_all_v", "all_gather", "reduce_scatter", "all_reduce", "p2p")


@functools.lru_cache(maxsize=4096)
def _increasing(members: tuple[int, ...]) -> bool:
    """Whether ranks are strictly increasing; cached: a step's ops reuse a few member
    sets, of up to the whole world each."""
    return all(a < b for a, b in zip(members, members[1:]))


@dataclass(frozen=True, eq=False)
class CollectiveOp:
    """One collective call.

    kind     one of ``KINDS``
    members  global ranks, ascending (= ring order); p2p: (src, dst)
    stage    a stage name from ``testbed.core.stages``
    layer    MoE layer index, -1 for ops that belong to no layer
    size     bytes: per-member contribution (all_gather), per-member input
             (reduce_scatter, all_reduce) or the message (p2p); 0 for all_to_all_v
    matrix   all_to_all_v only: matrix[i, j] = bytes member i sends member j
    batch    ops of one stage and layer with the same batch may run concurrently
    stream   concurrent stream within the batch (M9's batches of experts)
    cached   the group comes from the expert group cache (M10), not a fixed group
    label    free text for traces ("expert 5", "tokens")
    forward_sms  DeepEP's internode kernels: the token rows of one node's forward (the rows
             its forwarding GPUs pass on over NVLink, after the inter-node hop), moved by
             kernels on that many SMs a GPU; 0 for every other op (``testbed.policy.deepep``)
    """

    kind: str
    members: tuple[int, ...]
    stage: str
    layer: int = -1
    size: int = 0
    matrix: np.ndarray | None = field(default=None, repr=False)
    batch: int = 0
    stream: int = 0
    cached: bool = False
    label: str = ""
    row_bytes: int = 0  # all_to_all_v of token rows: bytes per row (micro-batches split whole rows); 0: not rows
    forward_sms: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r}")
        # rings follow group rank order, which NCCL and gloo take from the global ranks
        if self.kind != "p2p" and not _increasing(tuple(self.members)):
            raise ValueError(f"members of a {self.kind} must be strictly increasing ranks: {self.members}")
        if self.kind == "all_to_all_v":
            p = len(self.members)
            if self.matrix is None or self.matrix.shape != (p, p):
                raise ValueError("all_to_all_v needs a members x members byte matrix")

    @property
    def group_size(self) -> int:
        return len(self.members)

    @property
    def wire_bytes(self) -> int:
        return wire_bytes(self.kind, len(self.members), self.size, self.matrix, self.members)

    def transfers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return transfers(self.kind, self.members, self.size, self.matrix)


def wire_bytes(kind: str, group_size: int, size: int, matrix: np.ndarray | None = None,
               members: tuple[int, ...] | None = None) -> int:
    """Bytes the standard algorithm sends between distinct ranks (see module doc)."""
    p = group_size
    if kind == "all_to_all_v":
        m = np.asarray(matrix, dtype=np.int64)
        return int(m.sum() - np.trace(m))
    if kind == "p2p":
        return 0 if members is not None and members[0] == members[1] else int(size)
    if p <= 1:
        return 0
    if kind == "all_gather":
        return p * (p - 1) * int(size)
    if kind == "reduce_scatter":
        return (p - 1) * int(size)
    if kind == "all_reduce":
        return 2 * (p - 1) * int(size)
    raise ValueError(f"unknown collective kind {kind!r}")


def counted_kind(kind: str, reduce_scatter_as_all_reduce: bool = False) -> str:
    """The kind whose transfers an op of ``kind`` makes: a reduce-scatter that the library
    runs as an all-reduce (gloo, module doc) makes an all-reduce's."""
    return "all_reduce" if kind == "reduce_scatter" and reduce_scatter_as_all_reduce else kind


def reduce_scatter_runs_as_all_reduce(profile) -> bool:
    """Whether the machine profile's library runs a reduce-scatter as an all-reduce
    (``collectives.algorithm.reduce_scatter = "all_reduce"``: gloo)."""
    return profile.collectives.algorithm.reduce_scatter == "all_reduce"


def transfers(kind: str, members: tuple[int, ...], size: int, matrix: np.ndarray | None = None,
              reduce_scatter_as_all_reduce: bool = False):
    """The (src, dst, bytes) rank-to-rank transfers of the algorithm the library runs
    (module doc).

    Direct all-to-all: one transfer per off-diagonal pair. Ring collectives: member i
    sends to member i+1 the per-member share of the wire bytes. Returns three int64
    arrays whose byte total equals ``wire_bytes`` of ``counted_kind``.
    """
    kind = counted_kind(kind, reduce_scatter_as_all_reduce)
    m = np.asarray(members, dtype=np.int64)
    p = len(m)
    if kind == "all_to_all_v":
        mat = np.asarray(matrix, dtype=np.int64)
        i, j = np.nonzero(mat)
        keep = i != j
        return m[i[keep]], m[j[keep]], mat[i[keep], j[keep]]
    if kind == "p2p":
        if m[0] == m[1] or size == 0:
            return m[:0], m[:0], m[:0]
        return m[:1], m[1:2], np.array([size], dtype=np.int64)
    if p <= 1:
        return m[:0], m[:0], m[:0]
    per_member = wire_bytes(kind, p, size) // p
    return m, np.roll(m, -1), np.full(p, per_member, dtype=np.int64)


def algorithm_steps(kind: str, p: int, reduce_scatter_as_all_reduce: bool = False) -> int:
    """Sequential steps of one call of ``kind`` on ``p`` members, each paying the library's
    per-step software cost: a ring all-reduce 2(p-1), a ring all-gather or reduce-scatter
    p-1 (a reduce-scatter run as an all-reduce, as gloo does: 2(p-1)), an all-to-all one
    message to each of the p-1 others (posted one after another), a p2p one. The
    simulator's collective model and the calibration that fits the per-step cost count
    them alike."""
    if p < 2:
        return 0
    if kind == "p2p":
        return 1
    if kind == "all_to_all_v":
        return p - 1
    if kind == "reduce_scatter" and reduce_scatter_as_all_reduce:
        kind = "all_reduce"
    return 2 * (p - 1) if kind == "all_reduce" else p - 1


def algorithm_messages(kind: str, p: int, reduce_scatter_as_all_reduce: bool = False) -> int:
    """Messages each flow of one call of ``kind`` on ``p`` members carries (a flow: one
    member to its ring successor, or one pair of an all-to-all): every message costs the
    library a rendezvous and the transport its headers, whatever its size. gloo's ring
    all-reduce passes 2 segments per member through a reduce-scatter and an all-gather
    (4(p-1) messages a hop), its all-gather half a member's block at a time (2(p-1)); a
    plain ring reduce-scatter p-1; an all-to-all and a p2p one message per pair."""
    if p < 2:
        return 0
    if kind in ("all_to_all_v", "p2p"):
        return 1
    if kind == "reduce_scatter" and reduce_scatter_as_all_reduce:
        kind = "all_reduce"
    return {"all_reduce": 4 * (p - 1), "all_gather": 2 * (p - 1), "reduce_scatter": p - 1}[kind]


def bytes_by_level(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, layout: Layout) -> np.ndarray:
    """Sum of ``nbytes`` per fabric level (nvlink, leaf, spine), as an int64 array of 3."""
    if len(src) == 0:
        return np.zeros(3, dtype=np.int64)
    levels = layout.level_matrix[src, dst]
    return np.bincount(levels, weights=nbytes, minlength=3)[:3].astype(np.int64)


class ByteLedger:
    """Running totals of bytes per stage and per level (nvlink, leaf, spine, pcie).

    ``hops``: a dict the ledgers of one layout may share (the simulator keeps one per
    run). Per member set it keeps the link level of every transfer of the set's ring or
    all-to-all, so that counting an op is a lookup and a sum, not building its
    transfers: a paper-scale step has 15,000 ops on a few hundred member sets.
    ``op_bytes`` remembers the ops it has counted (the simulator's trace asks again
    for the same ops of the step). ``reduce_scatter_as_all_reduce``: count the ops'
    reduce-scatters as the all-reduces the library runs (gloo; module doc).
    """

    def __init__(self, layout: Layout, hops: dict | None = None, reduce_scatter_as_all_reduce: bool = False):
        self.layout = layout
        self.hops = {} if hops is None else hops
        self.reduce_scatter_as_all_reduce = reduce_scatter_as_all_reduce
        self._counted: dict[CollectiveOp, tuple[int, np.ndarray]] = {}  # ops hash by identity
        self.by_stage: dict[str, int] = {}
        self.by_level = np.zeros(len(LEVELS), dtype=np.int64)

    def add_transfers(self, stage: str, src, dst, nbytes) -> None:
        nbytes = np.asarray(nbytes, dtype=np.int64)
        self.by_stage[stage] = self.by_stage.get(stage, 0) + int(nbytes.sum())
        self.by_level[:3] += bytes_by_level(np.asarray(src), np.asarray(dst), nbytes, self.layout)

    def add_op(self, op: CollectiveOp) -> None:
        total, per_level = self.op_bytes(op)
        self.by_stage[op.stage] = self.by_stage.get(op.stage, 0) + total
        self.by_level[:3] += per_level

    def op_bytes(self, op: CollectiveOp) -> tuple[int, np.ndarray]:
        """(wire bytes, int64 [3] of them per level nvlink/leaf/spine) of one op: the
        totals of its ``transfers`` as the library runs it, without building them (do
        not modify the array)."""
        out = self._counted.get(op)
        if out is None:
            out = self._counted[op] = self._op_bytes(op)
        return out

    def _op_bytes(self, op: CollectiveOp) -> tuple[int, np.ndarray]:
        kind, members = op.kind, op.members
        if kind == "all_to_all_v":
            levels = self._hops("a2a", members)  # [p * p] level of each pair, 3 on the diagonal
            mat = np.asarray(op.matrix, dtype=np.int64)
            # float sums of whole bytes, exact below 2**53, as bytes_by_level's
            per_level = np.bincount(levels, weights=mat.ravel(), minlength=4)[:3].astype(np.int64)
            return int(mat.sum() - np.trace(mat)), per_level
        if kind == "p2p":
            src, dst = members
            per_level = np.zeros(3, dtype=np.int64)
            if src == dst or op.size == 0:
                return 0, per_level
            per_level[self.layout.level_matrix[src, dst]] = op.size
            return int(op.size), per_level
        p = len(members)
        if p <= 1:
            return 0, np.zeros(3, dtype=np.int64)
        kind = counted_kind(kind, self.reduce_scatter_as_all_reduce)
        per_member = wire_bytes(kind, p, op.size) // p  # each member to its ring successor
        return per_member * p, per_member * self._hops("ring", members)

    def _hops(self, shape: str, members: tuple[int, ...]) -> np.ndarray:
        key = (shape, members)
        out = self.hops.get(key)
        if out is None:
            m = np.asarray(members, dtype=np.int64)
            if shape == "ring":  # hops per level of member i -> i+1
                out = np.bincount(self.layout.level_matrix[m, np.roll(m, -1)], minlength=3)[:3].astype(np.int64)
            else:
                lv = self.layout.level_matrix[np.ix_(m, m)].astype(np.int64)
                np.fill_diagonal(lv, 3)  # a rank's bytes to itself stay off the fabric
                out = lv.ravel()
            self.hops[key] = out
        return out

    def add_pcie(self, stage: str, nbytes: int) -> None:
        self.by_stage[stage] = self.by_stage.get(stage, 0) + int(nbytes)
        self.by_level[3] += int(nbytes)

    def level_dict(self) -> dict[str, int]:
        return {name: int(v) for name, v in zip(LEVELS, self.by_level)}
