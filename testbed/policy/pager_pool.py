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

from testbed.policy.page_moves import PageMoves
from testbed.policy.pager import RankPager
from testbed.scenario.sections import PagerConfig

#: methods whose first argument is a list of expert instances (translated per GPU)
EXPERT_LIST_METHODS = ("refresh", "access", "prefetch", "apply_update", "invalidate")


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

    @property
    def empty(self) -> bool:
        """No GPU moved anything."""
        return not self.parts

    @classmethod
    def concat(cls, items: list["MovesByRank"]) -> "MovesByRank":
        """Per GPU: the rows of ``items`` one after the other (concatenations are
        flattened, so nothing nested is lost)."""
        flat = []
        for m in items:
            flat.extend(m.items if isinstance(m, _Concatenated) else [m])
        flat = [m for m in flat if not m.empty]
        if len(flat) == 1:
            return flat[0]
        return _Concatenated(flat)

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

    @property
    def empty(self) -> bool:
        return all(m.empty for m in self.items)

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
        #: every row ascending, as documented: the vectorised id -> position translation needs it
        self._sorted_rows = self.local.ndim == 2 and bool(np.all(np.diff(self.local, axis=1) > 0))
        self._table: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.ranks)

    def pager_of(self, rank: int) -> RankPager:
        """The pager whose state is ``rank``'s (in the instance ids of its class's id row;
        the rank's own ids when it is alone or the id row)."""
        return self.pagers[self.class_of[self.row_of[rank]]]

    def pages_of(self, rank: int, instance: int) -> tuple[RankPager, slice]:
        """The pager ``rank`` shares and the page-table slice of its replica of
        ``instance`` (translated by position into the class's id row)."""
        row = self.row_of[rank]
        cls = self.class_of[row]
        position = int(np.searchsorted(self.local[row], instance))
        pager = self.pagers[cls]
        return pager, pager.pages_of(int(self.local[self.id_row[cls]][position]))

    def ranks_where(self, test, ranks) -> list[int]:
        """The ``ranks`` whose pager passes ``test(pager)``, asked once per pager class."""
        ranks = [int(r) for r in ranks]
        classes = self.class_of[[self.row_of[r] for r in ranks]]
        passed = {int(c): bool(test(self.pagers[int(c)])) for c in np.unique(classes)}
        return [r for r, c in zip(ranks, classes.tolist()) if passed[c]]

    def call(self, method: str, per_rank: dict[int, tuple], *common) -> MovesByRank:
        """Call ``method`` on the pager of every GPU in ``per_rank`` (rank -> its own
        arguments; for expert-list methods the first one is instance ids of that rank),
        followed by ``common``. GPUs not named are not told anything."""
        rows = [self.row_of[rank] for rank in per_rank]
        keys, local_args = self._local_keys(method, rows, list(per_rank.values()))
        # (class, arguments in local terms) -> the GPUs told that, in first-told order
        told_alike: dict[tuple[int, bytes], list[int]] = {}
        for i, class_key in enumerate(zip(self.class_of[rows].tolist(), keys)):
            told = told_alike.get(class_key)
            if told is None:
                told_alike[class_key] = [i]
            else:
                told.append(i)
        by_class: dict[int, list[list[int]]] = {}
        for (c, _), told in told_alike.items():
            by_class.setdefault(c, []).append(told)
        # sizes before any split: a split moves GPUs of the class being handled to new classes
        sizes = np.bincount(self.class_of, minlength=len(self.pagers))
        parts = []
        for c, groups in by_class.items():
            untold = sizes[c] - sum(len(told) for told in groups)
            # copy before any call: the group that keeps class c (the first, when every
            # member is told something) is called last, after the others left with copies
            plan = [(self._split(c, [rows[i] for i in told]) if j > 0 or untold else c, told)
                    for j, told in enumerate(groups)]
            for cls, told in reversed(plan):
                args = self._to_ids(method, cls, local_args(told[0]))
                moves = getattr(self.pagers[cls], method)(*args, *common)
                if moves is not None and len(moves):
                    parts.append((self.ranks[[rows[i] for i in told]], self.id_row[cls], moves))
        return MovesByRank(parts, self.local, self.row_of)

    def _local_keys(self, method: str, rows: list[int], args: list[tuple]):
        """(key per GPU: its arguments in local terms as bytes, i -> those arguments)."""
        if method in EXPERT_LIST_METHODS and self._sorted_rows and rows:
            fast = self._expert_list_keys(rows, args)
            if fast is not None:
                return fast
        local = [self._to_local(method, row, a) for row, a in zip(rows, args)]
        keys = [b"|".join(np.ascontiguousarray(a).tobytes() for a in la) for la in local]
        return keys, local.__getitem__

    def _expert_list_keys(self, rows: list[int], args: list[tuple]):
        """``_local_keys`` when every GPU is told one list of expert ids (what ``access``
        gets from 1,440 GPUs 64 times a step), for all GPUs with one ``searchsorted``:
        row r's ids shifted by r x M (M above every id) into the rows of ``local`` laid
        end to end, each shifted alike. None when the arguments are not such lists."""
        ids = []
        for a in args:
            if len(a) != 1:
                return None
            x = np.asarray(a[0], dtype=np.int64)
            if x.ndim != 1:
                return None
            ids.append(x)
        lens = np.array([len(x) for x in ids], dtype=np.int64)
        flat = np.concatenate(ids)
        if len(flat) and flat.min() < 0:
            return None
        shift, table = self._shifted_rows(int(flat.max()) if len(flat) else 0)
        row_of_id = np.repeat(np.asarray(rows, dtype=np.int64), lens)
        pos = np.searchsorted(table, flat + row_of_id * shift) - row_of_id * self.local.shape[1]
        ends = np.cumsum(lens)
        bounds = list(zip((ends - lens).tolist(), ends.tolist()))
        blob, size = pos.tobytes(), pos.itemsize
        keys = [blob[s * size:e * size] for s, e in bounds]  # the bytes of each GPU's positions
        return keys, lambda i: (pos[bounds[i][0]:bounds[i][1]],)

    def call_all(self, method: str, *args) -> None:
        """A call every GPU gets alike (``end_step``): once per pager."""
        for pager in self.pagers:
            getattr(pager, method)(*args)

    def _split(self, c: int, rows: list[int]) -> int:
        self.pagers.append(copy.deepcopy(self.pagers[c]))
        self.id_row.append(self.id_row[c])
        self.class_of[rows] = len(self.pagers) - 1
        return len(self.pagers) - 1

    def _shifted_rows(self, largest_id: int) -> tuple[int, np.ndarray]:
        """(M, the rows of ``local`` end to end, row r shifted by r x M), M > every id."""
        if self._table is None or largest_id >= self._table[0]:
            shift = max(int(self.local.max()), largest_id) + 1
            self._table = shift, (self.local.astype(np.int64) + np.arange(len(self.local))[:, None] * shift).ravel()
        return self._table

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
