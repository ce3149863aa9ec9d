"""Expert weights of one rank in fixed-size pages, moved for real (M12-M16): reading and
updating an expert's weights wherever its pages are. The pools, the mirror of where each
page's data is and the copies that execute the pager's ``PageMoves`` are
``real.paging.page_pools.PagePools``, which ``PagedExpertStore`` extends.

An expert's weights are one flat vector of ``2 * H * F`` elements (w1 then w2); page p
holds elements ``[p * page_elems, (p + 1) * page_elems)`` (the last page less). ``read``
copies them out, ``view`` and ``stacked`` hand out the pool in place where the pages lie in
consecutive slots (M17), ``segments`` yields them page by page (M14); ``update`` (SGD) and
``write`` (new weights) change every page where it lives and return the bytes that crossed
PCIe to reach the pages on the host.

On CUDA the copies are not waited for when they are issued: whoever reads or updates an
expert's pages makes its own stream wait for that expert's event only.
So the copies overlap the dispatch all-to-all that follows them, and an expert computes
as soon as *its* pages arrived while the next expert's pages are still on the way
(expert-granular pipelining; with ``page_events``, page-granular: M14). A dirty
page's write-back to the host records its page event too, so a page-granular read of a
page at home on the host (its copy over from the host pool) waits for the write-back
that put its data there. Every wait, expert- or page-granular, is timed (``settle`` sums
the stall, in seconds). On CPU copies are synchronous.
"""

from __future__ import annotations

import numpy as np
import torch

from real.kernels.stacked_weights import StackedWeights, grouped_members, staged, strided_rows
from real.paging.page_pools import PagePools
from testbed.policy.page_moves import GPU, HOST


class PagedExpertStore(PagePools):
    """Host pool + device slots for the expert replicas of one rank."""

    # ---- reading and writing weights ------------------------------------------------------------
    def _page_data(self, page: int) -> torch.Tensor:
        """A page's current data on the device: its slot, or a copy from its host home
        (blocking: the CPU may update that host page right after)."""
        if self.loc[page] == GPU:
            return self._slot_tensor(int(self.slot_of[page]))[:self._page_range(page)[2]]
        if self.loc[page] == HOST:
            return self._host_view(page).to(self.device)
        inst = self._page_range(page)[0]
        raise RuntimeError(f"expert instance {inst}: page {page} has no valid copy (stale replica)")

    def _wait_page(self, page: int) -> None:
        """Make the current stream wait for ``page``'s last copy, load or write-back (with
        ``page_events``, CUDA), timed as ``wait_for`` is."""
        ev = self._page_ready.get(page)
        if ev is not None:
            self._wait_timed(ev)

    def read(self, instance: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The current flat weights of ``instance`` (a copy, into ``out`` if given), from
        wherever each page is."""
        self.wait_for(instance)
        if out is None:
            out = torch.empty(self.expert_elems, dtype=self.dtype, device=self.device)
        self.page_reads[self._pages[instance].start:self._pages[instance].stop] += 1
        for page in self._pages[instance]:
            _, start, n = self._page_range(page)
            out[start:start + n] = self._page_data(page)
        return out

    def _rows_in_place(self, instances: list[int]) -> torch.Tensor | None:
        """[G, expert elements] view of the pool holding ``instances``' weights, when
        every page of each is on the GPU in consecutive slots of the pool in page order
        and the experts lie at one stride (``real.kernels.stacked_weights.strided_rows``)."""
        starts = []
        for inst in instances:
            pages = self._pages[inst]
            if not np.all(self.loc[pages.start:pages.stop] == GPU):
                return None
            slots = self.slot_of[pages.start:pages.stop]
            if not (np.all(np.diff(slots) == 1) and slots[-1] < len(self.pool)):
                return None
            starts.append(int(slots[0]) * self.slot_elems)
        return strided_rows(self.pool, starts, self.expert_elems)

    def view(self, instance: int) -> torch.Tensor | None:
        """``instance``'s flat weights as a view of the device pool, without a copy, when
        every page is on the GPU in consecutive slots of the pool in page order (what
        M17's compaction makes); None otherwise (``read`` copies). For reading: compute
        waits for the instance's copies first (CUDA)."""
        rows = self._rows_in_place([instance])
        if rows is None:
            return None
        self.wait_for(instance)
        pages = self._pages[instance]
        self.page_reads[pages.start:pages.stop] += 1
        return rows[0]

    def stacked(self, instances: list[int], counts: list[int], pipelined: bool) -> StackedWeights:
        """The weights of a grouped GEMM over ``instances`` (``counts`` rows each): a view
        of the pool where the experts lie in place (the span from the first expert with
        rows to the last, else those with rows), else a staged copy. ``pipelined`` (M14):
        ``ready(end)`` waits for, and where staged copies, each page index's pages of all
        members as the GEMM reaches them; otherwise every read is done on return."""
        span, used = grouped_members(instances, counts)
        members, rows = used, None
        for option in (span, used):
            rows = self._rows_in_place([i for i, _ in option])
            if rows is not None:
                members = option
                break
        if rows is not None:
            if not pipelined:
                for inst, n in members:
                    if n:
                        self.wait_for(inst)
                        self.page_reads[self._pages[inst].start:self._pages[inst].stop] += 1
                return StackedWeights(members, rows)
            return StackedWeights(members, rows, self._page_by_page(members, None), pipelined=True)
        if not pipelined:
            return staged(members, self.expert_elems, self.read, self.dtype, self.device)
        w = torch.empty((len(members), self.expert_elems), dtype=self.dtype, device=self.device)
        return StackedWeights(members, w, self._page_by_page(members, w), pipelined=True,
                              copied_bytes=w.numel() * self.elem)

    def _page_by_page(self, members: list[tuple[int, int]], fill: torch.Tensor | None):
        """``ready(end)`` for a pipelined grouped GEMM: page index by page index up to
        element ``end``, the current stream waits for every member's page (those with
        rows: an empty group reads nothing) and, with ``fill``, copies it into its row."""
        reading = [(k, self._pages[inst]) for k, (inst, n) in enumerate(members) if n]
        done = [0]  # page indices handled so far

        def ready(end: int) -> None:
            j = done[0]
            while j < self.pager.pages_per_expert and j * self.page_elems < end:
                for k, pages in reading:
                    page = pages[j]
                    self.page_reads[page] += 1
                    self._wait_page(page)
                    if fill is not None:
                        _, start, n = self._page_range(page)
                        fill[k, start:start + n] = self._page_data(page)
                j += 1
            done[0] = j
        return ready

    def pending(self, instance: int) -> bool:
        """Whether some page of ``instance`` is still being copied in (CUDA, with
        ``page_events``; never on CPU, where copies are synchronous)."""
        return any(not self._page_ready[p].query() for p in self._pages[instance] if p in self._page_ready)

    def segments(self, instance: int):
        """(start element, weights) of each page of ``instance`` in order, without copying
        the pages on the device (M14): before it yields a page the current stream waits
        for that page's copy only (CUDA), so compute on the first pages overlaps the
        copies of the next (every page copied in since the last ``settle`` has its event;
        the others were complete by then). A page at home on the host is copied over as
        it is reached."""
        for page in self._pages[instance]:
            self.page_reads[page] += 1
            self._wait_page(page)
            yield self._page_range(page)[1], self._page_data(page)

    def update(self, instance: int, grad_flat: torch.Tensor, lr: float) -> int:
        """SGD on ``instance``: every page becomes ``w - lr * g`` where it lives.

        Pages in a device slot are updated there. Pages at home on the host are updated
        on the host, which needs their gradient there: that copy is real and its bytes
        (the pager's ``update`` rows) are returned.
        """
        return self._rewrite(instance, grad_flat, lambda w, g: w - lr * g)

    def write(self, instance: int, flat: torch.Tensor) -> int:
        """New weights of ``instance`` (Adam's, ``real.kernels.adam``), written where each page
        lives; pages on the host receive theirs over PCIe, as ``update``'s gradients do
        (the same bytes, returned)."""
        return self._rewrite(instance, flat, lambda w, x: x)

    def _rewrite(self, instance: int, source: torch.Tensor, new) -> int:
        """Every page of ``instance`` becomes ``new(its values, its part of source)`` where
        it lives; a page on the host gets its part of ``source`` over PCIe first. Returns
        the bytes that crossed."""
        self.wait_for(instance)
        self._host_ready(instance)
        shipped = 0
        for page in self._pages[instance]:
            _, start, n = self._page_range(page)
            part = source[start:start + n]
            if self.loc[page] == GPU:
                w = self._slot_tensor(int(self.slot_of[page]))[:n]
            elif self.loc[page] == HOST:
                part = part.to("cpu", copy=True)
                shipped += part.numel() * self.elem
                w = self._host_view(page)
            else:
                continue
            w.copy_(new(w, part))
            self.modified[page] = True
        return shipped
