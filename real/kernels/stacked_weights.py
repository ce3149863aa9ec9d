"""The weights of G experts as one [G, expert elements] tensor for a grouped GEMM (M22),
read in place where their layout allows it, and filled or waited for page by page when
the GEMM is pipelined with the page copies (M14).

A grouped GEMM takes one weight tensor whose G rows are at one stride. Experts whose
flat weights start at evenly spaced elements of one buffer - the unpaged weights, held
as rows of one tensor, or pages in consecutive pool slots, experts one after another
(the layout M17's compaction makes) - are such a tensor already: ``strided_rows`` views
it without a copy. Elsewhere the weights are staged: copied into a fresh [G, elements]
tensor, and the bytes are counted (``StackedWeights.copied_bytes``).

``ready(end)`` is the pipelining contract: after it returns, elements ``[0, end)`` of
every row hold the experts' weights for the current stream (CUDA: it waits for the page
copies that cover them and nothing else; a staged tensor is filled that far first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def strided_rows(base: torch.Tensor, starts: list[int], elems: int) -> torch.Tensor | None:
    """[G, elems] view of contiguous ``base`` whose row g begins at its element
    ``starts[g]``, when the starts are evenly spaced and at least ``elems`` apart (rows
    do not overlap) and every row lies inside ``base``; None otherwise."""
    if not starts or not base.is_contiguous():
        return None
    step = starts[1] - starts[0] if len(starts) > 1 else elems
    if step < elems or any(b - a != step for a, b in zip(starts, starts[1:])):
        return None
    if starts[0] < 0 or starts[-1] + elems > base.numel():
        return None
    return base.as_strided((len(starts), elems), (step, 1), base.storage_offset() + starts[0])


def _no_wait(end: int) -> None:
    return None


@dataclass
class StackedWeights:
    """G experts' weights for one grouped GEMM.

    ``members``: (instance, rows) of each of the G rows, in order (a member may have 0
    rows: it keeps the stride of an in-place view and costs no compute). ``w_GX``: [G,
    expert elements]. ``pipelined``: the GEMM should go block by block, calling
    ``ready`` before each (M14); otherwise ``ready`` has nothing left to do.
    ``copied_bytes``: device bytes of weights copied to build ``w_GX`` (0 in place).
    """

    members: list[tuple[int, int]]
    w_GX: torch.Tensor
    ready: Callable[[int], None] = _no_wait
    pipelined: bool = False
    copied_bytes: int = 0

    @property
    def counts(self) -> list[int]:
        return [n for _, n in self.members]


def grouped_members(instances: list[int], counts: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(span, used): the members of a grouped GEMM over ``instances`` with ``counts``
    rows each. ``span`` runs from the first instance with rows to the last, zero-row ones
    included (so experts laid out one after another view as one tensor); ``used`` has
    only the instances with rows (for when the span cannot be viewed)."""
    used = [(i, n) for i, n in zip(instances, counts) if n > 0]
    if not used:
        return [], []
    first = next(k for k, n in enumerate(counts) if n > 0)
    last = len(counts) - next(k for k, n in enumerate(reversed(counts)) if n > 0)
    return list(zip(instances[first:last], counts[first:last])), used


def staged(members: list[tuple[int, int]], elems: int, read: Callable, dtype: torch.dtype,
           device: torch.device) -> StackedWeights:
    """Members' weights copied, each by ``read(instance, out)``, into a fresh tensor."""
    w = torch.empty((len(members), elems), dtype=dtype, device=device)
    for k, (inst, _) in enumerate(members):
        read(inst, w[k])
    return StackedWeights(members, w, copied_bytes=w.numel() * w.element_size())
