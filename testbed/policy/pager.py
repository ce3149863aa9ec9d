"""Expert weights in pages between one GPU and host memory (M12-M16): a pure state machine.

A ``RankPager`` holds the page table of the experts one GPU serves. It is told what
happens (experts compute, the optimizer updates weights, a sync leaves replicas stale,
heat states change) and answers with ``PageMoves``: the copies a backend must execute,
in order, to mirror its page table. It never moves data itself, so the simulator can
put the moves on links and the real backend can copy tensors, both from the same rows.

Pages: each expert's ``expert_bytes`` are cut into ``ceil(expert_bytes / page_size)``
pages; the last holds the remainder. A resident page occupies one GPU slot of
``page_size`` bytes; slots ``0 .. capacity-1`` are the budget, ids ``>= capacity`` are
overflow (taken only when every resident page is pinned, so no page is ever lost).

Eviction order (M15), a deterministic total order over evictable pages (on the GPU,
refcount 0), by ``pager.eviction_order``:

- ``clean_first`` (the default): clean before dirty (a clean drop costs no bytes), then
  least recent ``last_access``;
- ``scored`` (the seed's rule): highest score first, score = dirtiness - references,
  dirtiness = u / (1 + u) for the u optimizer updates since the page was last clean (0
  for a clean page), references = a / (1 + a) for the a accesses since the page came to
  the GPU; so a page often modified and seldom read goes first. Then least recent;

then, in both, highest page index first (the first pages of an expert are the ones M14
predicts are needed first, so they stay longest), then highest expert index.

The emergency (M15) keeps ``reserve_slots`` budget slots free. With ``pager.free_memory
= budget`` that is ``emergency_free_fraction`` of the budget; with ``device`` the backend
tells the pager, each step, the device's free memory outside the pool
(``set_free_memory``: the allocator's on a GPU, modelled in the simulator) and the
reserve is what keeps the whole device that fraction free.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from testbed.policy import heat
from testbed.policy.page_moves import (  # noqa: F401  (re-exported: the pager's vocabulary)
    _MOVE_FIELDS,
    COLD_MIGRATION,
    DEFRAG,
    DEMAND,
    EMERGENCY,
    GPU,
    HOST,
    LOCATION_NAMES,
    NONE,
    PEER,
    PREFETCH,
    REASONS,
    REFRESH,
    STALE,
    UPDATE,
    WAKE,
    PageMoves,
)
from testbed.scenario.sections import PagerConfig

# Page states (M12).
ACTIVE, COLD, EVICTED = 0, 1, 2
PAGE_STATE_NAMES = ("active", "cold", "evicted")


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


class RankPager:
    """The page table of one GPU's experts and its migration policies (M12-M16).

    ``experts`` are the expert-instance ids this GPU holds (any distinct ints); arrays
    passed per local expert (``heat_update``) follow this order.
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

    # ---- events --------------------------------------------------------------------------
    def refresh(self, experts: Sequence[int], step: int) -> PageMoves:
        """The stale replicas named arrive from a peer GPU (M9, M16): every NONE page gets
        a slot (evicting if needed) and becomes a dirty GPU page; valid pages are untouched."""
        local = self._local(experts)
        pages = self._pages(local)
        stale = pages[self._location[pages] == NONE]
        # Pages back on the GPU: the expert is no longer cold-migrated.
        self._frozen[np.unique(self._page_expert[stale])] = False
        return self._load(stale, PEER, REFRESH, step)

    def access(self, experts: Sequence[int], step: int) -> PageMoves:
        """These experts compute now: load every missing page from host (on demand: what
        ``prefetch`` brought ahead is already there), pin all their pages for this step,
        then keep the M15 reserve free. A NONE page raises ValueError (the caller must
        ``refresh`` first)."""
        local = self._local(experts)
        pages = self._pages(local)
        if np.any(self._location[pages] == NONE):
            stale = np.unique(self.experts[self._page_expert[pages[self._location[pages] == NONE]]])
            raise ValueError(f"rank {self.rank}: experts {stale.tolist()} are stale; refresh them first")
        # Pin first, so loading one expert never evicts another one of this step.
        self._refcount[pages] += 1
        self._last_access[pages] = step
        self._accesses[local] += self.pages_per_expert
        self._references[pages] += 1
        missing = pages[self._location[pages] != GPU]
        if not len(missing):  # all resident: nothing loads, the reserve only shrinks by loads
            self._frozen[local] = False
            return PageMoves.concat([self._emergency()]) if self._reserve_short() else PageMoves.empty()
        reason = DEMAND  # pages M14 loaded ahead (``prefetch``) are hits now; the rest come on demand
        self._frozen[local] = False
        loads = self._load(missing, HOST, reason, step)
        return PageMoves.concat([loads, self._emergency()])

    def prefetch(self, experts: Sequence[int], step: int) -> PageMoves:
        """M14: load ahead the predicted-first pages of experts about to be needed - the
        first ``config.prefetch_pages`` pages of each (page order) that are off the GPU
        (HOST: a stale page waits for its refresh), into free slots above the M15
        reserve: it never evicts (what would go first, the least recent pages, are the
        later layers' pages of the last step, needed next) and what does not fit is not
        prefetched. Rows of reason
        ``prefetch``; the expert's remaining pages load on demand when it is accessed."""
        local = self._local(experts)
        if not len(local) or not self.config.prefetch_pages:
            return PageMoves.empty()
        pages = self._pages(local).reshape(len(local), self.pages_per_expert)[:, :self.config.prefetch_pages].ravel()
        wanted = pages[self._location[pages] == HOST]
        # Free slots above the M15 reserve only, never an eviction: the least recent pages
        # are the later layers' of the last step, which this step needs next.
        wanted = wanted[:max(0, self.free_slots - self.reserve_slots)]
        if not len(wanted):
            return PageMoves.empty()
        self._frozen[np.unique(self._page_expert[wanted])] = False  # pages are coming back
        return self._load(wanted, HOST, PREFETCH, step)

    def apply_update(self, experts: Sequence[int]) -> PageMoves:
        """The optimizer updated these experts: GPU pages become dirty; host-only pages
        are updated on the host, which needs the gradient shipped there ("update" rows).
        Stale (NONE) pages are skipped."""
        pages = self._pages(self._local(experts))
        loc = self._location[pages]
        on_gpu = pages[loc == GPU]
        self._dirty[on_gpu] = True
        self._updates[on_gpu] += 1
        self._host_valid[on_gpu] = False
        on_host = pages[loc == HOST]
        return self._rows(on_host, GPU, HOST, self._page_nbytes[on_host], UPDATE, -1)

    def invalidate(self, experts: Sequence[int]) -> PageMoves:
        """These replicas are stale now (two-stage sync left them out, M9): every copy is
        dropped and the pages become NONE. A pinned page raises ValueError."""
        pages = self._pages(self._local(experts))
        if np.any(self._refcount[pages] > 0):
            raise ValueError(f"rank {self.rank}: cannot invalidate pinned pages")
        live = pages[self._location[pages] != NONE]
        rows = self._rows(live, self._location[live], NONE, 0, STALE, self._slot[live])
        self._release(live[self._location[live] == GPU])
        self._location[live] = NONE
        self._state[live] = EVICTED
        self._host_valid[live] = False
        self._dirty[live] = False
        return rows

    def end_step(self) -> None:
        """The step is over: every page is unpinned."""
        self._refcount[:] = 0

    def heat_update(self, below_cold: np.ndarray, states: np.ndarray, woken: np.ndarray,
                    step: int) -> PageMoves:
        """Apply a heat update: cold migration (M13), wake-up loads (M20), prefetch of hot
        experts (M19). Arrays are per local expert: ``below_cold`` = score below the
        pager's cold percentile (``config.cold_percentile``, computed by the caller over all
        experts), ``states`` = heat HOT/WARM/COLD, ``woken`` = probes that responded.
        Wake and hot loads only take free slots above the reserve; they never evict."""
        n_experts = len(self.experts)
        below_cold = np.asarray(below_cold, dtype=bool)
        states = np.asarray(states)
        woken = np.asarray(woken, dtype=bool)
        for name, a in (("below_cold", below_cold), ("states", states), ("woken", woken)):
            if a.shape != (n_experts,):
                raise ValueError(f"{name} has shape {a.shape}, expected ({n_experts},)")
        self._streak = np.where(below_cold, self._streak + 1, 0)

        # M13: cold for long enough and no pending work -> pages go to host.
        pinned = self._refcount.reshape(n_experts, self.pages_per_expert).any(axis=1)
        migrate = np.flatnonzero((states == heat.COLD) & ~pinned & ~self._frozen
                                 & (self._streak >= self.config.cold_consecutive_updates))
        pages = self._pages(migrate)
        cold = self._evict(pages[self._location[pages] == GPU], COLD_MIGRATION)
        self._state[pages[self._location[pages] == HOST]] = COLD
        self._frozen[migrate] = True

        # M20: woken frozen experts get their first pages back.
        wake = np.flatnonzero(woken & self._frozen)
        self._frozen[wake] = False
        self._streak[wake] = 0
        pages = self._pages(wake).reshape(len(wake), self.pages_per_expert)
        on_host = self._location[pages] == HOST
        first = on_host & (np.cumsum(on_host, axis=1) <= self.config.prefetch_pages)
        wake_loads = self._load_spare(pages[first], WAKE, step)

        # M19: hot experts are kept fully resident, in expert order.
        hot = self._pages(np.flatnonzero(states == heat.HOT))
        hot_loads = self._load_spare(hot[self._location[hot] == HOST], PREFETCH, step)
        self._frozen[np.unique(self._page_expert[hot[self._location[hot] == GPU]])] = False
        return PageMoves.concat([cold, wake_loads, hot_loads])

    # ---- M17 defragmentation ------------------------------------------------------------
    @property
    def fragmentation(self) -> float:
        """Share of the experts with two or more pages on the GPU whose resident pages do
        not sit in consecutive slots in page order (0: none)."""
        on_gpu = (self._location == GPU).reshape(len(self.experts), self.pages_per_expert)
        many = np.flatnonzero(on_gpu.sum(axis=1) >= 2)
        if not len(many):
            return 0.0
        slots = self._slot.reshape(len(self.experts), self.pages_per_expert)[many]
        scattered = [not np.all(np.diff(row[row >= 0]) == 1) for row in slots]
        return float(np.mean(scattered))

    def defragment(self) -> PageMoves:
        """M17: compact the pool. Every page on the GPU moves to a new slot so that each
        expert's resident pages are consecutive, in page order, experts one after
        another from slot 0 (overflow pages come back into the budget where there is
        room). One GPU -> GPU row per page that changes slot (``slot`` is the new one; no
        bytes cross a link): a backend moves them all at once, as one permutation of the
        pool. Pins, dirty bits and host copies are unchanged: no page is lost."""
        pages = np.flatnonzero(self._location == GPU)  # expert-major, page order
        if not len(pages):
            return PageMoves.empty()
        new = np.arange(len(pages))
        moving = self._slot[pages] != new
        rows = self._rows(pages[moving], GPU, GPU, 0, DEFRAG, new[moving])
        self._owner = np.full(max(self.capacity_slots, len(pages)), -1, dtype=np.int64)
        self._owner[new] = pages
        self._slot[pages] = new
        return rows

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

    def _evict(self, victims: np.ndarray, reason: int) -> PageMoves:
        """GPU -> host: dirty pages are written back, clean ones dropped (0 bytes)."""
        rows = self._rows(victims, GPU, HOST, np.where(self._dirty[victims], self._page_nbytes[victims], 0),
                          reason, self._slot[victims])
        self._release(victims)
        self._location[victims] = HOST
        self._state[victims] = COLD if reason == COLD_MIGRATION else EVICTED
        self._host_valid[victims] = True
        self._dirty[victims] = False
        self._updates[victims] = 0
        self._references[victims] = 0
        return rows

    def eviction_scores(self, pages: np.ndarray) -> np.ndarray:
        """M15's score of ``pages`` (``scored`` order: highest evicted first):
        dirtiness u / (1 + u) minus references a / (1 + a)."""
        u, a = self._updates[pages], self._references[pages]
        return u / (1.0 + u) - a / (1.0 + a)

    def _candidates(self) -> np.ndarray:
        """Evictable pages (on the GPU, unpinned) in eviction order (module docstring)."""
        cand = np.flatnonzero((self._location == GPU) & (self._refcount == 0))
        first = (self._dirty[cand] if self.config.eviction_order == "clean_first"
                 else -self.eviction_scores(cand))
        order = np.lexsort((-self._page_expert[cand], -self._page_index[cand], self._last_access[cand], first))
        return cand[order]

    def set_free_memory(self, outside_free_bytes: float, device_bytes: float) -> None:
        """``pager.free_memory = device`` (M15): the device has ``device_bytes`` and
        ``outside_free_bytes`` of them are free outside the page pool. The reserve becomes
        the pool slots that must stay free for the device to keep
        ``emergency_free_fraction`` of its memory free (none when outside memory covers
        it; at most the whole budget); the next ``access`` evicts down to it."""
        if device_bytes <= 0:
            raise ValueError(f"device_bytes = {device_bytes}: must be > 0")
        short = self.config.emergency_free_fraction * device_bytes - max(0.0, outside_free_bytes)
        self.reserve_slots = int(min(self.capacity_slots, max(0, math.ceil(short / self.page_size - 1e-9))))

    def _load(self, pages: np.ndarray, src: int, reason, step: int) -> PageMoves:
        """Give ``pages`` slots (lowest free first; evict, then overflow, when short) and
        put them on the GPU. From HOST they stay clean; from a PEER the host copy is old."""
        need = len(pages)
        if need == 0:
            return PageMoves.empty()
        evicted = PageMoves.empty()
        short = need - self.free_slots
        if short > 0:
            evicted = self._evict(self._candidates()[:short], EMERGENCY)
        free = np.flatnonzero(self._owner < 0)
        if free.size < need:
            # Everything left is pinned: overflow past the budget rather than fail (M15).
            start = len(self._owner)
            self._owner = np.concatenate([self._owner, np.full(need - free.size, -1, dtype=np.int64)])
            free = np.concatenate([free, np.arange(start, len(self._owner))])
        slots = free[:need]
        self._place(pages, slots)
        self._last_access[pages] = step
        self._references[pages] = 0
        self._updates[pages] = 0
        if src == PEER:
            self._host_valid[pages] = False
            self._dirty[pages] = True
            self._updates[pages] = 1
        self._used += need
        self._peak_used = max(self._peak_used, self._used)
        self._overflow_peak = max(self._overflow_peak, len(self._owner) - self.capacity_slots)
        loads = self._rows(pages, src, GPU, self._page_nbytes[pages], reason, slots)
        return PageMoves.concat([evicted, loads])

    def _load_spare(self, pages: np.ndarray, reason: int, step: int) -> PageMoves:
        """Load host pages, in order, into free slots above the reserve only."""
        spare = max(0, self.free_slots - self.reserve_slots)
        return self._load(pages[:spare], HOST, reason, step)

    def _reserve_short(self) -> bool:
        return self.reserve_slots > 0 and self.free_slots < self.reserve_slots

    def _emergency(self) -> PageMoves:
        """M15: while fewer than ``reserve`` budget slots are free, evict in order."""
        deficit = self.reserve_slots - self.free_slots
        if deficit <= 0:
            return PageMoves.empty()
        cand = self._candidates()
        # Victims in overflow slots free no budget slot; count only the ones that do.
        freed = np.cumsum(self._slot[cand] < self.capacity_slots)
        k = int(np.searchsorted(freed, deficit)) + 1 if freed.size and freed[-1] >= deficit else len(cand)
        return self._evict(cand[:k], EMERGENCY)


def _check(ok, message: str) -> None:
    if not ok:
        raise AssertionError(message)
