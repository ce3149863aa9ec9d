"""The page table of one GPU's experts (M12): where each page is, its slot, its flags.

A ``PageTable`` is the state a ``RankPager`` (``testbed.policy.pager``) decides on: one
entry per page (location GPU/HOST/NONE, state ACTIVE/COLD/EVICTED, dirty, host copy valid,
pin count, last access, GPU slot, the M15 scoring counters), the slot owner table, the
per-expert frozen flags and access counts, and the invariants that tie them together. It
takes no decision: it reads, checks, places and releases pages, and writes the rows of
``PageMoves`` that the pager's decisions produce.

Pages: each expert's ``expert_bytes`` are cut into ``ceil(expert_bytes / page_size)``
pages; the last holds the remainder. A resident page occupies one GPU slot of
``page_size`` bytes; slots ``0 .. capacity-1`` are the budget, ids ``>= capacity`` are
overflow (taken only when every resident page is pinned, so no page is ever lost).
The budget (``pager.gpu_budget_bytes``, bytes) is ``capacity_slots`` slots; 0 means
room for every page.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from testbed.policy.page_moves import GPU, HOST, NONE, PageMoves
from testbed.scenario.sections import PagerConfig

# Page states (M12).
ACTIVE, COLD, EVICTED = 0, 1, 2
PAGE_STATE_NAMES = ("active", "cold", "evicted")


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


class PageTable:
    """The page table of one GPU's experts (M12), its inspection and its invariants.

    ``experts`` are the expert-instance ids this GPU holds (any distinct ints); pages of
    local expert i are entries i*p .. i*p+p-1 (p = ``pages_per_expert``). Sizes are bytes.
    """

    def __init__(self, rank: int, experts: Sequence[int], expert_bytes: int, config: PagerConfig):
        if expert_bytes <= 0:
            raise ValueError(f"expert_bytes = {expert_bytes}: must be > 0")
        self.rank = rank
        self.config = config
        self.experts = np.array(experts, dtype=np.int64).ravel()
        self.experts.flags.writeable = False
        order = np.argsort(self.experts, kind="stable")
        self._sorted_ids = self.experts[order]
        self._sorted_local = order
        if np.any(self._sorted_ids[1:] == self._sorted_ids[:-1]):
            raise ValueError(f"experts of rank {rank} are not distinct")
        self.expert_bytes = expert_bytes
        self.page_size = config.page_size_bytes
        p = self.pages_per_expert = -(-expert_bytes // self.page_size)
        #: device bytes of one slot: a page, or a whole expert smaller than a page
        self.slot_bytes = min(self.page_size, expert_bytes)
        n_experts = len(self.experts)
        n = n_experts * p

        self._page_nbytes = np.full(n, self.page_size, dtype=np.int64)
        self._page_nbytes[p - 1::p] = expert_bytes - (p - 1) * self.page_size
        self._page_index = np.tile(np.arange(p, dtype=np.int64), n_experts)
        self._page_expert = np.repeat(np.arange(n_experts, dtype=np.int64), p)

        if config.gpu_budget_bytes:
            self.capacity_slots = config.gpu_budget_bytes // self.page_size
            # M15 reserve; the epsilon keeps 0.07 * 100 from rounding up to 8.
            self.reserve_slots = math.ceil(config.emergency_free_fraction * self.capacity_slots - 1e-9)
        else:
            # Unlimited: room for every page, so there is nothing to keep free.
            self.capacity_slots = n
            self.reserve_slots = 0

        # Page table (M12), one entry per page, pages of local expert i at i*p .. i*p+p-1.
        self._location = np.full(n, HOST, dtype=np.int8)
        self._state = np.full(n, EVICTED, dtype=np.int8)
        self._host_valid = np.ones(n, dtype=bool)
        self._dirty = np.zeros(n, dtype=bool)
        self._refcount = np.zeros(n, dtype=np.int32)
        self._last_access = np.full(n, -1, dtype=np.int64)
        self._slot = np.full(n, -1, dtype=np.int64)
        self._updates = np.zeros(n, dtype=np.int64)  # optimizer updates since last clean (M15 dirtiness)
        self._references = np.zeros(n, dtype=np.int64)  # accesses since it came to the GPU (M15)
        # slot -> page (-1 free); longer than capacity only while overflow slots are used.
        self._owner = np.full(self.capacity_slots, -1, dtype=np.int64)
        # Per expert.
        self._frozen = np.zeros(n_experts, dtype=bool)
        self._streak = np.zeros(n_experts, dtype=np.int64)
        self._accesses = np.zeros(n_experts, dtype=np.int64)

        initial = np.arange(min(n, self.capacity_slots - self.reserve_slots))
        self._place(initial, initial)
        self._used = len(initial)
        self._peak_used = self._used
        self._overflow_peak = 0

    # ---- inspection ----------------------------------------------------------------------
    @property
    def used_slots(self) -> int:
        """GPU slots holding a page (overflow included)."""
        return self._used

    @property
    def free_slots(self) -> int:
        """Free slots inside the budget (ids < capacity)."""
        return int(np.count_nonzero(self._owner[:self.capacity_slots] < 0))

    @property
    def resident_bytes(self) -> int:
        """GPU bytes the pages occupy (used slots * page size)."""
        return self._used * self.page_size

    @property
    def peak_resident_bytes(self) -> int:
        return self._peak_used * self.page_size

    @property
    def overflow_peak_slots(self) -> int:
        """Most overflow slots (ids >= capacity) in use at once."""
        return self._overflow_peak

    @property
    def location(self) -> np.ndarray:
        """Per page GPU/HOST/NONE (read-only)."""
        return _readonly(self._location)

    @property
    def state(self) -> np.ndarray:
        """Per page ACTIVE/COLD/EVICTED (read-only)."""
        return _readonly(self._state)

    @property
    def dirty(self) -> np.ndarray:
        """Per page: on the GPU and the host copy is not current (read-only)."""
        return _readonly(self._dirty)

    @property
    def host_valid(self) -> np.ndarray:
        return _readonly(self._host_valid)

    @property
    def refcount(self) -> np.ndarray:
        return _readonly(self._refcount)

    @property
    def slot(self) -> np.ndarray:
        """Per page its GPU slot, -1 when not on the GPU (read-only)."""
        return _readonly(self._slot)

    @property
    def page_nbytes(self) -> np.ndarray:
        """Per page its bytes (the last page of an expert holds the remainder)."""
        return _readonly(self._page_nbytes)

    @property
    def accesses(self) -> np.ndarray:
        """Per local expert, page accesses so far (memory heat, M18)."""
        return self._accesses.copy()

    def pages_of(self, expert: int) -> slice:
        """Page-table indices of expert id ``expert``."""
        i = int(self._local([expert])[0])
        return slice(i * self.pages_per_expert, (i + 1) * self.pages_per_expert)

    def frozen_experts(self) -> np.ndarray:
        """Ids of experts cold-migrated (M13) and not brought back since."""
        return self.experts[self._frozen]

    def check_invariants(self) -> None:
        """Raise AssertionError when the page table is inconsistent."""
        on_gpu = self._location == GPU
        slots = self._slot[on_gpu]
        _check(np.all(slots >= 0), "a GPU page has no slot")
        _check(np.unique(slots).size == slots.size, "two GPU pages share a slot")
        _check(np.array_equal(self._owner[slots], np.flatnonzero(on_gpu)), "slot owner table disagrees")
        _check(np.all(self._slot[~on_gpu] == -1), "a page off the GPU holds a slot")
        _check(np.count_nonzero(self._owner >= 0) == slots.size == self._used, "used slot count is off")
        _check(len(self._owner) == self.capacity_slots or self._owner[-1] >= 0, "overflow tail not trimmed")
        _check(not np.any((self._location == HOST) & ~self._host_valid), "a host-only page has no valid copy")
        _check(not np.any((self._location == NONE) & self._host_valid), "a stale page claims a host copy")
        _check(np.array_equal(self._dirty, on_gpu & ~self._host_valid), "dirty bit disagrees")
        _check(np.all((self._state == ACTIVE) == on_gpu), "page state disagrees with location")
        _check(np.all(self._refcount >= 0), "negative refcount")
        _check(not np.any(on_gpu.reshape(len(self.experts), self.pages_per_expert).any(axis=1) & self._frozen),
               "a frozen expert has pages on the GPU")

    # ---- internals -----------------------------------------------------------------------
    def _local(self, experts: Sequence[int]) -> np.ndarray:
        """Local indices of expert ids, first occurrence order, duplicates dropped."""
        q = np.asarray(experts, dtype=np.int64).ravel()
        if q.size == 0:
            return q
        if len(self._sorted_ids) == 0:
            raise ValueError(f"rank {self.rank} holds no experts {q.tolist()}")
        pos = np.minimum(np.searchsorted(self._sorted_ids, q), len(self._sorted_ids) - 1)
        if not np.array_equal(self._sorted_ids[pos], q):
            unknown = np.setdiff1d(q, self.experts)
            raise ValueError(f"rank {self.rank} holds no experts {unknown.tolist()}")
        local = self._sorted_local[pos]
        if local.size > 1:
            _, first = np.unique(local, return_index=True)
            if first.size < local.size:
                local = local[np.sort(first)]
        return local

    def _pages(self, local: np.ndarray) -> np.ndarray:
        """Page-table indices of local experts, expert-major, page order."""
        p = self.pages_per_expert
        return (np.asarray(local, dtype=np.int64)[:, None] * p + np.arange(p)).ravel()

    def _rows(self, pages, src, dst, nbytes, reason, slot) -> PageMoves:
        n = len(pages)
        if n == 0:
            return PageMoves.empty()

        def column(value, dtype):
            if isinstance(value, np.ndarray):
                return value.astype(dtype, copy=False)
            return np.full(n, value, dtype=dtype)

        return PageMoves(rank=np.full(n, self.rank, dtype=np.int32),
                         expert=self.experts[self._page_expert[pages]].astype(np.int32),
                         page=self._page_index[pages].astype(np.int32),
                         slot=column(slot, np.int32), src=column(src, np.int8), dst=column(dst, np.int8),
                         nbytes=column(nbytes, np.int64), reason=column(reason, np.int8))

    def _place(self, pages: np.ndarray, slots: np.ndarray) -> None:
        self._owner[slots] = pages
        self._slot[pages] = slots
        self._location[pages] = GPU
        self._state[pages] = ACTIVE

    def _release(self, pages: np.ndarray) -> None:
        """Free the slots of GPU pages (the caller sets their new location)."""
        if not len(pages):
            return
        self._owner[self._slot[pages]] = -1
        self._slot[pages] = -1
        self._used -= len(pages)
        if len(self._owner) > self.capacity_slots:
            used = np.flatnonzero(self._owner[self.capacity_slots:] >= 0)
            self._owner = self._owner[:self.capacity_slots + (used[-1] + 1 if used.size else 0)]


def _check(ok, message: str) -> None:
    if not ok:
        raise AssertionError(message)
