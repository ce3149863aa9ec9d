"""Expert weights of one rank in fixed-size pages, moved for real (M12-M16).

The shared pager (``testbed.pager.RankPager``) decides; this store executes its
``PageMoves`` as tensor copies between a *host pool* (every page's home; pinned memory
on CUDA) and a *device pool* of page-sized slots. It keeps its own mirror of where each
page's current data is, updated only as moves are executed, so a read is always
consistent with the data even while the pager's table already shows moves that are
still to run.

An expert's weights are one flat vector of ``2 * H * F`` elements (w1 then w2); page p
holds elements ``[p * page_elems, (p + 1) * page_elems)`` (the last page less).
"""

from __future__ import annotations

import numpy as np
import torch

from testbed.page_moves import GPU, HOST, NONE, PEER, UPDATE, PageMoves
from testbed.pager import RankPager


class PagedExpertStore:
    """Host pool + device slots for the expert replicas of one rank."""

    def __init__(self, pager: RankPager, expert_elems: int, dtype: torch.dtype,
                 device: torch.device, init_flat):
        """``init_flat(instance) -> 1-D tensor`` gives each expert's initial weights."""
        self.pager = pager
        self.expert_elems = expert_elems
        self.dtype, self.device = dtype, device
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.page_elems = pager.page_size // self.elem
        self.slot_elems = min(self.page_elems, expert_elems)
        pin = device.type == "cuda"
        self.host = {}
        for i in pager.experts:
            t = init_flat(int(i)).to(dtype).contiguous()
            self.host[int(i)] = t.pin_memory() if pin else t
        self.slots: dict[int, torch.Tensor] = {}
        # mirror of the data's whereabouts, per page (pager page numbering)
        self.loc = np.full(len(pager.location), HOST, dtype=np.int8)
        self.slot_of = np.full(len(pager.location), -1, dtype=np.int64)
        self.copied_bytes = 0
        on_gpu = np.flatnonzero(pager.location == GPU)
        for p in on_gpu:  # initial residency as the pager placed it
            self._to_slot(int(p), int(pager.slot[p]), self._host_view(int(p)))
        self.copied_bytes = 0  # the initial load is not a step's traffic

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
        if slot not in self.slots:
            self.slots[slot] = torch.empty(self.slot_elems, dtype=self.dtype, device=self.device)
        return self.slots[slot]

    def _to_slot(self, page: int, slot: int, data: torch.Tensor) -> None:
        self._slot_tensor(slot)[:data.numel()].copy_(data, non_blocking=True)
        self.loc[page], self.slot_of[page] = GPU, slot
        self.copied_bytes += data.numel() * self.elem

    # ---- executing the pager's decisions ------------------------------------------------------
    def execute(self, moves: PageMoves, incoming: dict[int, torch.Tensor] | None = None) -> int:
        """Carry out ``moves`` in order; returns bytes copied host<->device.

        ``incoming[instance]`` holds the flat weights received from a peer for the
        ``refresh`` rows (M9/M16).
        """
        host_device = 0
        for k in range(len(moves)):
            page = self.pager.pages_of(int(moves.expert[k])).start + int(moves.page[k])
            slot = int(moves.slot[k])
            src, dst, reason = int(moves.src[k]), int(moves.dst[k]), int(moves.reason[k])
            if reason == UPDATE:
                continue  # the gradient is shipped by ``update``
            if dst == GPU and src == HOST:
                self._to_slot(page, slot, self._host_view(page))
                host_device += self._host_view(page).numel() * self.elem
            elif dst == GPU and src == PEER:
                inst, start, n = self._page_range(page)
                self._to_slot(page, slot, incoming[inst][start:start + n].to(self.device))
            elif src == GPU and dst == HOST:
                old = int(self.slot_of[page])
                if moves.nbytes[k] > 0:  # dirty: write back before the slot is reused (M15)
                    view = self._host_view(page)
                    view.copy_(self.slots[old][:view.numel()])
                    self.copied_bytes += view.numel() * self.elem
                    host_device += view.numel() * self.elem
                self.loc[page], self.slot_of[page] = HOST, -1
            elif dst == NONE:
                self.loc[page], self.slot_of[page] = NONE, -1
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self._free_unused_slots()
        return host_device

    def _free_unused_slots(self) -> None:
        live = set(self.slot_of[self.loc == GPU].tolist())
        for s in [s for s in self.slots if s not in live]:
            del self.slots[s]

    # ---- reading and writing weights ------------------------------------------------------------
    def read(self, instance: int) -> torch.Tensor:
        """The current flat weights of ``instance`` (a copy), from wherever each page is."""
        out = torch.empty(self.expert_elems, dtype=self.dtype, device=self.device)
        for page in range(self.pager.pages_of(instance).start, self.pager.pages_of(instance).stop):
            _, start, n = self._page_range(page)
            if self.loc[page] == GPU:
                out[start:start + n] = self.slots[int(self.slot_of[page])][:n]
            elif self.loc[page] == HOST:
                out[start:start + n] = self._host_view(page).to(self.device)
            else:
                raise RuntimeError(f"expert instance {instance}: page {page} has no valid copy (stale replica)")
        return out

    def update(self, instance: int, grad_flat: torch.Tensor, lr: float) -> int:
        """SGD on ``instance``: every page becomes ``w - lr * g`` where it lives.

        Pages in a device slot are updated there. Pages at home on the host are updated
        on the host, which needs their gradient there: that copy is real and its bytes
        (the pager's ``update`` rows) are returned.
        """
        shipped = 0
        for page in range(self.pager.pages_of(instance).start, self.pager.pages_of(instance).stop):
            _, start, n = self._page_range(page)
            g = grad_flat[start:start + n]
            if self.loc[page] == GPU:
                w = self.slots[int(self.slot_of[page])][:n]
                w.copy_(w - lr * g)
            elif self.loc[page] == HOST:
                staged = g.to("cpu", copy=True)  # the gradient crosses PCIe to the host
                shipped += staged.numel() * self.elem
                w = self._host_view(page)
                w.copy_(w - lr * staged)
        self.copied_bytes += shipped
        return shipped

    @property
    def device_bytes(self) -> int:
        """Bytes of the device slots in use."""
        return len(self.slots) * self.slot_elems * self.elem
