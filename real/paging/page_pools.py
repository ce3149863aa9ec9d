"""The pools of one rank's expert pages and the copies between them (M12-M16): what
executes the shared pager's decisions for real.

The shared pager (``testbed.policy.pager.RankPager``) decides; ``PagePools`` executes its
``PageMoves`` as tensor copies between a *host pool* (every page's home; pinned memory
on CUDA) and a *device pool* of page-sized slots, allocated once for the pager's budget
(slots beyond it, which the pager takes only when every resident page is pinned, are
allocated while in use). It keeps its own mirror of where each
page's current data is, updated only as moves are executed, so a read is always
consistent with the data even while the pager's table already shows moves that are
still to run. Reading and updating an expert's weights in the pools:
``real.paging.paged_store.PagedExpertStore``.

An expert's weights are one flat vector of ``2 * H * F`` elements (w1 then w2); page p
holds elements ``[p * page_elems, (p + 1) * page_elems)`` (the last page less).
``execute`` returns the bytes copied host<->device; ``device_bytes`` is the bytes of the
device slots in use.

On CUDA the copies run on a side stream (``copy_stream``) and are not waited for when
they are issued: after the last copy of each expert an event is recorded (with
``page_events``, after every page: M14), and whoever reads or updates that expert's pages
makes its own stream wait for that event only (``wait_for``). A dirty page's write-back
to the host records its page event too. Every wait is timed: an event on compute's
stream where it starts waiting, paired with the copy's event (``settle`` sums the stall,
in seconds). On CPU copies are synchronous.

The *logical* value of a page is its data wherever the current copy is (the slot of a
GPU page, the host pool otherwise; a stale page has none). ``modified`` marks pages
whose logical value changed since the last optimizer checkpoint (M23): optimizer
updates and refreshes from a peer; loads and evictions move data without changing it.
``snapshot`` and ``restore`` are the checkpoint's side of the pools.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from testbed.policy.page_moves import DEFRAG, GPU, HOST, NONE, PEER, UPDATE, PageMoves
from testbed.policy.pager import RankPager


class PagePools:
    """Host pool + device slots for the expert replicas of one rank, the mirror of where
    each page's data is, and the copies that execute the pager's moves."""

    def __init__(self, pager: RankPager, expert_elems: int, dtype: torch.dtype,
                 device: torch.device, init_flat):
        """``init_flat(instance) -> 1-D tensor`` gives each expert's initial weights."""
        self.pager = pager
        self.expert_elems = expert_elems
        self.dtype, self.device = dtype, device
        self.cuda = device.type == "cuda"
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.page_elems = pager.page_size // self.elem
        self.slot_elems = min(self.page_elems, expert_elems)
        self.host = {}
        for i in pager.experts:
            t = init_flat(int(i)).to(dtype).contiguous()
            self.host[int(i)] = t.pin_memory() if self.cuda else t
        self.pool = torch.empty((pager.capacity_slots, self.slot_elems), dtype=dtype, device=device)
        self.overflow: dict[int, torch.Tensor] = {}  # slots >= capacity, while in use
        # mirror of the data's whereabouts, per page (pager page numbering)
        self.loc = np.full(len(pager.location), HOST, dtype=np.int8)
        self.slot_of = np.full(len(pager.location), -1, dtype=np.int64)
        self.modified = np.zeros(len(pager.location), dtype=bool)
        #: reads of each page by a computation (C9's page-access record, testbed.policy.page_access)
        self.page_reads = np.zeros(len(pager.location), dtype=np.int64)
        self._pages = {int(inst): range(k * pager.pages_per_expert, (k + 1) * pager.pages_per_expert)
                       for k, inst in enumerate(pager.experts)}  # instance -> its page numbers
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._ready: dict[int, torch.cuda.Event] = {}  # instance -> event after its last copy
        self.page_events = False  # M14 page pipelining: record an event after every page loaded
        self._page_ready: dict[int, torch.cuda.Event] = {}  # page -> event after its copy
        self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (compute, copy)
        self._mirror_pager()

    def _mirror_pager(self) -> None:
        """Put every page the pager has on the GPU into its slot, from the host pool."""
        self.overflow.clear()
        self.loc[:] = HOST
        self.slot_of[:] = -1
        self.loc[self.pager.location == NONE] = NONE
        with self._on_copy_stream():
            for p in np.flatnonzero(self.pager.location == GPU):
                self._to_slot(int(p), int(self.pager.slot[p]), self._host_view(int(p)))
        if self.cuda:
            self.copy_stream.synchronize()

    # ---- page geometry ------------------------------------------------------------------
    def _page_range(self, page: int) -> tuple[int, int, int]:
        """(instance, start element, length) of a page (pager page numbering)."""
        local, index = divmod(page, self.pager.pages_per_expert)
        start = index * self.page_elems
        return int(self.pager.experts[local]), start, min(self.page_elems, self.expert_elems - start)

    def _host_view(self, page: int) -> torch.Tensor:
        inst, start, n = self._page_range(page)
        return self.host[inst][start:start + n]

    def _slot_tensor(self, slot: int) -> torch.Tensor:
        if slot < len(self.pool):
            return self.pool[slot]
        if slot not in self.overflow:
            self.overflow[slot] = torch.empty(self.slot_elems, dtype=self.dtype, device=self.device)
            self._keep_alive(self.overflow[slot])
        return self.overflow[slot]

    def _to_slot(self, page: int, slot: int, data: torch.Tensor) -> None:
        """Copy ``data`` into ``slot`` (on the copy stream: callers enter it)."""
        self._slot_tensor(slot)[:data.numel()].copy_(data, non_blocking=True)
        self._keep_alive(data)
        self.loc[page], self.slot_of[page] = GPU, slot

    # ---- CUDA streams and events ----------------------------------------------------------
    def _on_copy_stream(self):
        return torch.cuda.stream(self.copy_stream) if self.cuda else nullcontext()

    def _keep_alive(self, *tensors) -> None:
        """Device tensors used on the copy stream are not reused by the allocator before
        the copy stream is done with them."""
        if self.cuda:
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(self.copy_stream)

    def _copied(self, instance: int) -> None:
        """The copies issued so far cover ``instance``: record its ready event."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.copy_stream)
            self._ready[instance] = ev

    def _page_copied(self, page: int) -> None:
        """With ``page_events``: the copies issued so far cover ``page`` (M14): its load,
        or its write-back to the host. Timed, as the stall is measured from it."""
        if self.cuda and self.page_events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.copy_stream)
            self._page_ready[page] = ev

    def wait_for(self, instance: int) -> None:
        """Make the current stream wait for the pending copies of ``instance`` (no-op on CPU)."""
        ev = self._ready.get(instance) if self.cuda else None
        if ev is not None:
            self._wait_timed(ev)

    def _wait_timed(self, ev) -> None:
        """Make the current stream wait for the copy event ``ev``, timed: an event recorded
        on it where the wait starts, paired with ``ev`` (``settle`` sums the gaps)."""
        here = torch.cuda.Event(enable_timing=True)
        here.record()
        torch.cuda.current_stream(self.device).wait_event(ev)
        self._waits.append((here, ev))

    def _host_ready(self, instance: int) -> None:
        """The CPU is about to touch ``instance``'s host pool: its copies must be done."""
        ev = self._ready.get(instance) if self.cuda else None
        if ev is not None:
            ev.synchronize()

    def settle(self) -> float:
        """Wait for every copy; returns the seconds compute waited for pages since the
        last ``settle`` (CUDA: from events; CPU: 0, the caller times synchronous copies)."""
        if not self.cuda:
            return 0.0
        self.copy_stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()
        stall = sum(max(0.0, here.elapsed_time(ev)) for here, ev in self._waits) * 1e-3
        self._waits.clear()
        self._ready.clear()
        self._page_ready.clear()
        return stall

    # ---- executing the pager's decisions ------------------------------------------------------
    def execute(self, moves: PageMoves, incoming: dict[int, torch.Tensor] | None = None) -> int:
        """Carry out ``moves`` in order; returns bytes copied host<->device.

        ``incoming[instance]`` holds the flat weights received from a peer for the
        ``refresh`` rows (M9/M16). On CUDA the copies are only issued (see the module doc).
        """
        host_device = 0
        if self.cuda:  # copies come after every queued read or update of the slots
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_copy_stream():
            host_device = self._execute(moves, incoming)
        self._free_unused_slots()
        return host_device

    def _execute(self, moves: PageMoves, incoming) -> int:
        host_device = 0
        experts = moves.expert.tolist()  # plain ints: this loop runs once per page (or run of pages)
        rows = list(zip(experts, moves.page.tolist(), moves.slot.tolist(), moves.src.tolist(), moves.dst.tolist(),
                        moves.reason.tolist(), moves.nbytes.tolist()))
        k = 0
        while k < len(rows):
            inst, index, slot, src, dst, reason, nbytes = rows[k]
            page = self._pages[inst][index]
            done = 1  # rows this move carried out
            if reason == UPDATE:  # the gradient is shipped by ``update``
                k += 1
                continue
            if reason == DEFRAG:
                done = self._compact(rows, k)
            elif dst == GPU and src == HOST:
                done, copied = self._load_run(rows, k)
                host_device += copied
            elif dst == GPU and src == PEER:
                _, start, n = self._page_range(page)
                self._to_slot(page, slot, incoming[inst][start:start + n].to(self.device))
                self.modified[page] = True  # new weights arrived (M23 tracks them)
                self._page_copied(page)
            elif src == GPU and dst == HOST:
                old = int(self.slot_of[page])
                if nbytes > 0:  # dirty: write back before the slot is reused (M15)
                    view = self._host_view(page)
                    view.copy_(self._slot_tensor(old)[:view.numel()], non_blocking=True)
                    host_device += view.numel() * self.elem
                    self._page_copied(page)  # a page-granular read from the host waits for it
                self.loc[page], self.slot_of[page] = HOST, -1
            elif dst == NONE:
                self.loc[page], self.slot_of[page] = NONE, -1
            for j in range(k, k + done):  # an expert's last row: its copies are all issued
                if j + 1 == len(experts) or experts[j + 1] != experts[j]:
                    self._copied(experts[j])
            k += done
        return host_device

    def _compact(self, rows, k: int) -> int:
        """M17: the defrag rows from row ``k`` on, (page, new slot) each, done together:
        every page's data is read from its old slot before any is written (the moves may
        form cycles). Device to device, on the copy stream: loads issued after it queue
        behind it. Returns how many rows it carried out."""
        end = k
        while end < len(rows) and rows[end][5] == DEFRAG:
            end += 1
        moves = [(self._pages[inst][index], slot) for inst, index, slot, *_ in rows[k:end]]
        staged = torch.stack([self._slot_tensor(int(self.slot_of[p])) for p, _ in moves])  # every moving page first
        for (page, slot), data in zip(moves, staged):
            self._slot_tensor(slot).copy_(data)
            self.slot_of[page] = slot
            self._page_copied(page)
        self._keep_alive(staged)
        return end - k

    def _load_run(self, rows, k: int) -> tuple[int, int]:
        """Host -> device loads from row ``k`` on, as one copy where they are whole pages
        of one expert, in page order, into consecutive slots of the pool (the pager's
        usual pattern; an expert's short last page and slots past the pool are copies of
        their own). With ``page_events`` every page is its own copy: compute waits for
        each (M14). Returns (rows carried out, at least 1; bytes copied)."""
        inst, index, slot = rows[k][:3]
        n = 1
        if not self.page_events:
            while k + n < len(rows):
                i2, p2, s2, src2, dst2, reason2, _ = rows[k + n]
                if (i2, p2, s2, src2, dst2) != (inst, index + n, slot + n, HOST, GPU) or reason2 == UPDATE:
                    break
                n += 1
        whole = 0  # the run's leading whole pages (an expert's last page may be shorter)
        while whole < n and self._page_range(self._pages[inst][index + whole])[2] == self.slot_elems:
            whole += 1
        n = max(1, min(whole, len(self.pool) - slot))  # overflow slots are tensors of their own
        pages = [self._pages[inst][index + j] for j in range(n)]
        if n > 1:
            start = self._page_range(pages[0])[1]
            self.pool[slot:slot + n].view(-1).copy_(self.host[inst][start:start + n * self.slot_elems],
                                                    non_blocking=True)
            self.loc[pages], self.slot_of[pages] = GPU, np.arange(slot, slot + n)
        else:
            self._to_slot(pages[0], slot, self._host_view(pages[0]))
        for page in pages:
            self._page_copied(page)
        return n, sum(self._host_view(page).numel() for page in pages) * self.elem

    def _free_unused_slots(self) -> None:
        live = set(self.slot_of[self.loc == GPU].tolist())
        for s in [s for s in self.overflow if s not in live]:
            del self.overflow[s]

    @property
    def device_bytes(self) -> int:
        """Bytes of the device slots in use (the pool's occupied slots and any overflow)."""
        return int(np.count_nonzero(self.loc == GPU)) * self.slot_elems * self.elem

    # ---- checkpoints (M23) ------------------------------------------------------------------------
    def snapshot(self, only_modified: bool) -> dict[int, torch.Tensor]:
        """Logical values (CPU copies) of every page, or of the pages modified since the
        last ``clear_modified``; stale pages have none and are left out."""
        self.settle()
        wanted = self.modified if only_modified else np.ones(len(self.loc), dtype=bool)
        out = {}
        for page in np.flatnonzero(wanted & (self.loc != NONE)):
            page = int(page)
            _, _, n = self._page_range(page)
            if self.loc[page] == GPU:
                out[page] = self._slot_tensor(int(self.slot_of[page]))[:n].to("cpu", copy=True)
            else:
                out[page] = self._host_view(page).clone()
        return out

    def clear_modified(self) -> None:
        self.modified[:] = False

    def restore(self, pager: RankPager, pages: dict[int, torch.Tensor]) -> None:
        """Take over ``pager`` (a restored page table) and the pages' logical values:
        host pool first, then every page the pager has on the GPU into its slot."""
        self.settle()
        self.pager = pager
        for page, data in pages.items():
            self._host_view(int(page)).copy_(data)
        self._mirror_pager()
        self.modified[:] = False
