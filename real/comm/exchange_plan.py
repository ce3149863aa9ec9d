"""Row layouts of the all-to-all token exchange (flat and hierarchical), in numpy.

A rank's kept slots start in *source order*: sorted by (expert, token, slot). A *block*
``(src, e)`` is the rows EP member ``src`` sends to expert ``e`` (``K[src, e]`` rows,
K = kept counts of the EP group). Each all-to-all stage moves whole blocks: the holder
sends every block to the member the stage's routing names, ordered by (destination,
expert, source); a member's new buffer is what it received, concatenated in group
order of the senders. After the last stage the expert owner sorts its blocks by
(expert, source) - the *expert layout*, identical for every token strategy, so that the
grouped expert GEMM sees the same rows whatever travelled how.

Flat all-to-all is one stage over the EP group (destination = owner of e); the
hierarchical one (M7, Tutel 2DH) is a stage inside each node (destination = the node
peer in the owner's column) then one across nodes (destination = the owner).

Everything is computed from K alone, which every rank knows after the route stage, so
each rank derives its own send/receive splits and permutations without talking.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StagePlan:
    """One all-to-all stage as seen by one rank (row units)."""

    group: tuple[int, ...]  # global ranks of the stage's group, in group order
    send_rows: np.ndarray  # indices into the current buffer, in send order
    send_splits: list[int]  # rows sent to each group member
    recv_splits: list[int]  # rows received from each group member


@dataclass
class ExchangePlan:
    """How one rank's slots travel to the experts and back."""

    stages: list[StagePlan]
    expert_rows: np.ndarray  # indices into the final buffer that give the expert layout
    expert_counts: np.ndarray  # rows per local expert in the expert layout


def _rows_of(blocks: list[tuple[int, int]], sizes: dict) -> tuple[np.ndarray, np.ndarray]:
    """Start offset and length of each block in a buffer that holds ``blocks`` in order."""
    lengths = np.array([sizes[b] for b in blocks], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    return starts, lengths


def _gather_rows(starts, lengths, order) -> np.ndarray:
    if len(order) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in order])


def ranges(starts, lengths) -> np.ndarray:
    """Concatenated ``arange(start, start + length)`` for each pair (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths) + np.arange(total)


def plan_flat(kept: np.ndarray, members: list[int], owner_of_expert, me: int) -> ExchangePlan:
    """``plan_exchange`` of the flat all-to-all (``flat_stages``) in numpy: the same plan,
    without a Python loop over the group's blocks (the hot path's)."""
    kept = np.asarray(kept, dtype=np.int64)
    p, num_experts = kept.shape
    owner = np.array([owner_of_expert(e) for e in range(num_experts)], dtype=np.int64)
    my = members.index(me)
    group = np.array(sorted(range(p), key=lambda m: members[m]))  # EP indices in process-group order
    place = np.empty(p, dtype=np.int64)
    place[group] = np.arange(p)
    # send: my blocks (my, e), held in expert order, go by (destination's place, expert)
    mine = kept[my]
    held_at = np.concatenate([[0], np.cumsum(mine)[:-1]])
    sent = np.flatnonzero(mine > 0)
    sent = sent[np.lexsort((sent, place[owner[sent]]))]
    send_rows = ranges(held_at[sent], mine[sent])
    send_splits = np.bincount(place[owner], weights=mine, minlength=p).astype(np.int64)
    # receive: every member's blocks of my experts, senders in group order, experts in order
    my_experts = np.flatnonzero(owner == my)
    got = kept[group][:, my_experts]  # [senders in group order, my experts]
    recv_splits = got.sum(axis=1)
    sizes = got.reshape(-1)
    at = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    src = np.repeat(group, len(my_experts))
    expert = np.tile(my_experts, p)
    nz = np.flatnonzero(sizes > 0)
    layout = nz[np.lexsort((src[nz], expert[nz]))]  # expert layout: by (expert, source)
    stage = StagePlan(tuple(members[m] for m in group), send_rows, send_splits.tolist(), recv_splits.tolist())
    return ExchangePlan([stage], ranges(at[layout], sizes[layout]), kept[:, my_experts].sum(axis=0))


def plan_exchange(kept: np.ndarray, members: list[int], owner_of_expert, stages, me: int) -> ExchangePlan:
    """The exchange plan of rank ``me``.

    kept            [P, E] kept slots per EP member (EP-index order) and expert
    members         global ranks of the EP group, EP-index order
    owner_of_expert e -> EP index of the member that computes expert e
    stages          list of (groups, route): ``groups`` a list of tuples of EP indices
                    (a partition of the group for this stage), ``route(holder, e)`` the EP
                    index the block goes to in this stage
    """
    p, num_experts = kept.shape
    sizes = {(s, e): int(kept[s, e]) for s in range(p) for e in range(num_experts) if kept[s, e] > 0}
    # buffers[m] = list of blocks member m holds, in buffer order
    buffers = {m: [(m, e) for e in range(num_experts) if (m, e) in sizes] for m in range(p)}
    my = members.index(me)
    plans = []
    for groups, route in stages:
        # a group's members in ascending global rank: the order of the process group
        groups = [tuple(sorted(g, key=lambda m: members[m])) for g in groups]
        new_buffers = {m: [] for m in range(p)}
        for group in groups:
            for holder in group:  # senders in group order: receivers concatenate in this order
                blocks = buffers[holder]
                dest = [route(holder, e) for (_, e) in blocks]
                order = sorted(range(len(blocks)), key=lambda i: (group.index(dest[i]), blocks[i][1], blocks[i][0]))
                for i in order:
                    new_buffers[dest[i]].append(blocks[i])
                if holder == my:
                    starts, lengths = _rows_of(blocks, sizes)
                    send_rows = _gather_rows(starts, lengths, order)
                    send_splits = [sum(sizes[b] for b, d in zip(blocks, dest) if d == m) for m in group]
            if my in group:
                recv_splits = [sum(sizes[b] for b in buffers[src] if route(src, b[1]) == my) for src in group]
                plans.append(StagePlan(tuple(members[m] for m in group), send_rows, send_splits, recv_splits))
        buffers = new_buffers
    final = buffers[my]
    starts, lengths = _rows_of(final, sizes)
    order = sorted(range(len(final)), key=lambda i: (final[i][1], final[i][0]))
    mine = [e for e in range(num_experts) if owner_of_expert(e) == my]
    counts = np.array([kept[:, e].sum() for e in mine], dtype=np.int64)
    return ExchangePlan(plans, _gather_rows(starts, lengths, order), counts)


def flat_stages(p: int, owner_of_expert):
    """One all-to-all over the whole EP group."""
    return [([tuple(range(p))], lambda holder, e: owner_of_expert(e))]


def hierarchical_stages(grid_ep: np.ndarray, owner_of_expert):
    """Intra-node then inter-node stage; ``grid_ep[a, b]`` = EP index at node a, column b."""
    a_nodes, b_cols = grid_ep.shape
    where = {int(grid_ep[a, b]): (a, b) for a in range(a_nodes) for b in range(b_cols)}

    def to_column(holder, e):  # stage 1: to my node's peer in the owner's column
        a, _ = where[holder]
        return int(grid_ep[a, where[owner_of_expert(e)][1]])

    def to_owner(holder, e):  # stage 2: along the column to the owner's node
        return owner_of_expert(e)

    intra = [tuple(int(x) for x in grid_ep[a]) for a in range(a_nodes)]
    inter = [tuple(int(x) for x in grid_ep[:, b]) for b in range(b_cols)]
    return [(intra, to_column), (inter, to_owner)]
