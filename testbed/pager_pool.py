"""The page tables of many GPUs, kept once per group of GPUs that are in the same state.

A ``RankPager`` is deterministic. GPUs that start alike and are told the same things
(in *local* terms: "the k-th expert replica I hold computes now") stay alike, so the pool
keeps one pager per *class* of such GPUs and splits a class as soon as its GPUs are told
different things. With dense routing thousands of GPUs share a few pagers; with sparse
routing the pool degrades gracefully to one pager per GPU. The answers are exactly what
one pager per GPU would give.

Every GPU holds the same number of expert replicas (``local[row]``: instance ids, sorted,
of the GPU on that row). A class's pager works in the instance ids of one row of the
class (its *id row*); arguments and answers are translated by position.
"""

from __future__ import annotations

import copy
from typing import Iterator

import numpy as np

from testbed.page_moves import PageMoves
from testbed.pager import RankPager
from testbed.scenario import PagerConfig

#: methods whose first argument is a list of expert instances (translated per GPU)
EXPERT_LIST_METHODS = ("refresh", "access", "apply_update", "invalidate")


class MovesByRank:
    """Page moves of many GPUs, stored once per group of GPUs that moved alike.

    ``get(rank)`` gives one GPU's moves in its own instance ids; ``groups()`` yields
    (ranks, moves in the group's id row) for totals without building per-GPU copies.
    """

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray, PageMoves]] | None = None,
                 local: np.ndarray | None = None, row_of: dict[int, int] | None = None):
        # parts: (ranks, id row per part, moves in that id row's instance ids)
        self.parts = parts or []
        self.local, self.row_of = local, row_of or {}
        self._where = {int(r): k for k, (ranks, _, _) in enumerate(self.parts) for r in ranks}

    @classmethod
    def concat(cls, items: list["MovesByRank"]) -> "MovesByRank":
        """Per GPU: the rows of ``items`` one after the other."""
        items = [m for m in items if m.parts]
        if len(items) == 1:
            return items[0]
        return _Concatenated(items)

    def get(self, rank: int, default=None) -> PageMoves | None:
        k = self._where.get(rank)
        if k is None:
            return default
        ranks, id_row, moves = self.parts[k]
        return _translate(moves, self.local[id_row], self.local[self.row_of[rank]], rank)

    def __getitem__(self, rank: int) -> PageMoves:
        """``rank``'s moves; none (empty) when it moved nothing."""
        moves = self.get(rank)
        return PageMoves.empty() if moves is None else moves

    def __contains__(self, rank) -> bool:
        return rank in self._where

    def keys(self):
        return sorted(self._where)

    def values(self):
        return [self.get(r) for r in self.keys()]

    def items(self):
        return [(r, self.get(r)) for r in self.keys()]

    def groups(self) -> Iterator[tuple[np.ndarray, PageMoves]]:
        for ranks, _, moves in self.parts:
            yield ranks, moves


class _Concatenated(MovesByRank):
    def __init__(self, items: list[MovesByRank]):
        super().__init__()
        self.items = items
        self._where = {r: 0 for m in items for r in m._where}

    def get(self, rank: int, default=None):
        pieces = [m.get(rank) for m in self.items if rank in m]
        return PageMoves.concat(pieces) if pieces else default

    def groups(self):
        for m in self.items:
            yield from m.groups()


def _translate(moves: PageMoves, from_ids: np.ndarray, to_ids: np.ndarray, rank: int) -> PageMoves:
    if from_ids is to_ids and len(moves) and moves.rank[0] == rank:
        return moves
    out = copy.copy(moves)
    out.expert = to_ids[np.searchsorted(from_ids, moves.expert)].astype(moves.expert.dtype)
    out.rank = np.full(len(moves), rank, dtype=moves.rank.dtype)
    return out


class PagerPool:
    """RankPagers of ``ranks`` (``local[i]``: sorted instance ids of ``ranks[i]``)."""

    def __init__(self, ranks, local: np.ndarray, expert_bytes: int, config: PagerConfig):
        self.ranks = np.asarray(ranks, dtype=np.int64)
        self.local = np.asarray(local)
        self.row_of = {int(r): i for i, r in enumerate(self.ranks)}
        self.class_of = np.zeros(len(self.ranks), dtype=np.int64)
        self.pagers = [RankPager(int(self.ranks[0]), self.local[0], expert_bytes, config)]
        self.id_row = [0]

    def __len__(self) -> int:
        return len(self.ranks)

    def pager_of(self, rank: int) -> RankPager:
        """The pager whose state is ``rank``'s (in the instance ids of its class's id row;
        the rank's own ids when it is alone or the id row)."""
        return self.pagers[self.class_of[self.row_of[rank]]]

    def call(self, method: str, per_rank: dict[int, tuple], *common) -> MovesByRank:
        """Call ``method`` on the pager of every GPU in ``per_rank`` (rank -> its own
        arguments; for expert-list methods the first one is instance ids of that rank),
        followed by ``common``. GPUs not named are not told anything."""
        by_class: dict[int, dict[bytes, list[int]]] = {}
        args_of: dict[int, tuple] = {}
        for rank, args in per_rank.items():
            row = self.row_of[rank]
            local_args = self._to_local(method, row, args)
            args_of[row] = local_args
            key = b"|".join(np.ascontiguousarray(a).tobytes() for a in local_args)
            by_class.setdefault(int(self.class_of[row]), {}).setdefault(key, []).append(row)
        parts = []
        for c, groups in by_class.items():
            untold = len(np.flatnonzero(self.class_of == c)) - sum(len(rows) for rows in groups.values())
            # copy before any call: the group that keeps class c (the first, when every
            # member is told something) is called last, after the others left with copies
            plan = [(self._split(c, rows) if i > 0 or untold else c, rows) for i, rows in enumerate(groups.values())]
            for cls, rows in reversed(plan):
                args = self._to_ids(method, cls, args_of[rows[0]])
                moves = getattr(self.pagers[cls], method)(*args, *common)
                if moves is not None and len(moves):
                    parts.append((self.ranks[rows], self.id_row[cls], moves))
        return MovesByRank(parts, self.local, self.row_of)

    def call_all(self, method: str, *args) -> None:
        """A call every GPU gets alike (``end_step``): once per pager."""
        for pager in self.pagers:
            getattr(pager, method)(*args)

    def _split(self, c: int, rows: list[int]) -> int:
        self.pagers.append(copy.deepcopy(self.pagers[c]))
        self.id_row.append(self.id_row[c])
        self.class_of[rows] = len(self.pagers) - 1
        return len(self.pagers) - 1

    def _to_local(self, method: str, row: int, args: tuple) -> tuple:
        """Expert instance ids -> positions in the GPU's replica list (the class key)."""
        if method in EXPERT_LIST_METHODS:
            ids = np.asarray(args[0], dtype=np.int64)
            return (np.searchsorted(self.local[row], ids),) + tuple(args[1:])
        return tuple(np.asarray(a) for a in args)

    def _to_ids(self, method: str, cls: int, local_args: tuple) -> tuple:
        if method in EXPERT_LIST_METHODS:
            return (self.local[self.id_row[cls]][local_args[0]],) + tuple(local_args[1:])
        return local_args

    @property
    def classes(self) -> int:
        return len(self.pagers)
