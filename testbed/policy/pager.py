"""Expert weights in pages between one GPU and host memory (M12-M16): a pure state machine.

A ``RankPager`` holds the page table of the experts one GPU serves. It is told what
happens (experts compute, the optimizer updates weights, a sync leaves replicas stale,
heat states change) and answers with ``PageMoves``: the copies a backend must execute,
in order, to mirror its page table. It never moves data itself, so the simulator can
put the moves on links and the real backend can copy tensors, both from the same rows.

The page table itself (pages, slots, the budget, the invariants) is
``testbed.policy.page_table.PageTable``, which ``RankPager`` extends with the decisions.

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
from testbed.policy.page_table import COLD, EVICTED, PageTable


class RankPager(PageTable):
    """The page table of one GPU's experts and its migration policies (M12-M16).

    ``experts`` are the expert-instance ids this GPU holds (any distinct ints); arrays
    passed per local expert (``heat_update``) follow this order.
    """

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

    # ---- eviction, loads and the M15 reserve ---------------------------------------------
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

