"""An expert's FFN computed page by page as its pages arrive (M14, ``pager.pipeline_pages``).

An expert's flat weights are w1 (H x W, row-major: W = F, or 2 F with SwiGLU's gate and
up side by side, ``real.kernels.ffn_activation``) then w2 (F x H); page k holds elements
``[k P, (k + 1) P)``. So the pages, in order, deliver w1's rows, then w2's: a row of w1 is
complete once the page holding its last element has arrived. The forward contracts block
by block over what has arrived,

    a = sum_k x[:, rows_k] @ w1[rows_k]       (the rows of w1 completed by page k)
    y = sum_k act(a)[:, rows_k] @ w2[rows_k]  (the rows of w2 completed by page k)

so on CUDA the compute stream waits for one page at a time (``PagedExpertStore.segments``)
while the copy stream brings the next. A row split between two pages is assembled from
both. The result is the unblocked FFN's up to the order of the sums.

``grouped_blocked`` does the same for a grouped GEMM over several experts: block k
contracts, for every expert at once, the rows that page k of each completes.
"""

from __future__ import annotations

import numpy as np
import torch

from real.kernels.ffn_activation import activation, input_width


def blocked_ffn(x_RH: torch.Tensor, segments, hidden: int, ffn: int,
                swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [R, H], pre-activation a [R, W]) of one expert on rows ``x_RH``, from
    ``segments``: (start element, 1-D tensor) pieces of the flat weights in order that
    cover them exactly (a page each, waited for as it is yielded)."""
    rows, cols = x_RH.shape[0], input_width(ffn, swiglu)
    a = x_RH.new_zeros((rows, cols))
    y = x_RH.new_zeros((rows, hidden))
    h = None  # act(a), once every row of w1 has arrived
    w1_end = hidden * cols
    carry: list[torch.Tensor] = []  # pieces of the row that the last segment left unfinished
    for start, data in segments:
        end = start + data.numel()
        for lo, hi in ((start, min(end, w1_end)), (max(start, w1_end), end)):  # the w1 part, then the w2 part
            if lo >= hi:
                continue
            in_w1 = lo < w1_end
            base, width = (0, cols) if in_w1 else (w1_end, hidden)
            piece = data[lo - start:hi - start]
            offset = lo - base
            first_row = -(-offset // width)  # the first row starting in this piece
            head = min(first_row * width - offset, piece.numel())
            if head:  # the end of a row begun in an earlier piece
                carry.append(piece[:head])
                if offset + head == first_row * width:  # it is complete now
                    row = first_row - 1
                    full = torch.cat(carry).view(1, width)
                    carry = []
                    if in_w1:
                        a = a + x_RH[:, row:row + 1] @ full
                    else:
                        h = activation(a, swiglu) if h is None else h
                        y = y + h[:, row:row + 1] @ full
            whole = (piece.numel() - head) // width  # rows wholly inside this piece
            if whole:
                block = piece[head:head + whole * width].view(whole, width)
                r0 = first_row
                if in_w1:
                    a = a + x_RH[:, r0:r0 + whole] @ block
                else:
                    h = activation(a, swiglu) if h is None else h
                    y = y + h[:, r0:r0 + whole] @ block
            rest = piece[head + whole * width:]
            if rest.numel():
                carry.append(rest)
    if carry:
        raise ValueError("the segments do not end at the end of the weights")
    return y, a


# ---- the grouped GEMM, block by block --------------------------------------------------------
#: contraction blocks of the grouped kernel start on multiples of this many rows, so the
#: activation columns they read begin 16-byte aligned (``torch._grouped_mm``'s rule, bf16)
BLOCK_ALIGN_ROWS = 16


def row_blocks(base: int, rows: int, width: int, page_elems: int) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of a ``rows`` x ``width`` matrix that begins at element
    ``base`` of the flat weights: each ends where the arrival of a page completes rows,
    rounded down to ``BLOCK_ALIGN_ROWS`` (the last ends at ``rows``), none empty."""
    first_page = base // page_elems
    last_page = (base + rows * width - 1) // page_elems
    ends = (np.arange(first_page, last_page + 1) + 1) * page_elems  # element after each page
    done = np.clip((ends - base) // width, 0, rows)
    done = np.where(done == rows, rows, done // BLOCK_ALIGN_ROWS * BLOCK_ALIGN_ROWS)
    bounds = [0] + sorted(set(int(d) for d in done) - {0})
    return list(zip(bounds, bounds[1:]))


def grouped_blocked(xp_PH: torch.Tensor, w1_GHW: torch.Tensor, w2_GFH: torch.Tensor, offs: torch.Tensor,
                    page_elems: int, ready, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [P, H], pre-activation a [P, W]) of a grouped FFN over padded rows ``xp_PH``
    (groups ending at ``offs``), contracted block by block as pages arrive:
    ``ready(end)`` returns once elements [0, end) of every expert's flat weights may be
    read. Blocks are the rows that whole pages complete (``row_blocks``), so the page
    index k of every expert is waited for together: experts are the same size."""
    hidden, cols, ffn = w1_GHW.shape[1], w1_GHW.shape[2], w2_GFH.shape[1]
    a = None
    for r0, r1 in row_blocks(0, hidden, cols, page_elems):
        ready(r1 * cols)
        part = torch._grouped_mm(xp_PH[:, r0:r1], w1_GHW[:, r0:r1], offs=offs)
        a = part if a is None else a.add_(part)
    h = activation(a, swiglu)
    y = None
    for r0, r1 in row_blocks(hidden * cols, ffn, hidden, page_elems):
        ready(hidden * cols + r1 * hidden)
        part = torch._grouped_mm(h[:, r0:r1], w2_GFH[:, r0:r1], offs=offs)
        y = part if y is None else y.add_(part)
    return y, a
