"""Which pages of an expert a computation reads: the access model behind claim C9.

The seed says that in 92% of forwards an expert's first 3 pages cover 87% of its weight
accesses (C9), so prefetching 3 pages (M14) mostly suffices. An expert here is a dense
FFN: w1 (H x F) then w2 (F x H), paged in order. A token's forward multiplies by all of
w1 and all of w2, so every forward reads every page once: the share of accesses page k
gets is ``page_elements / expert_elements`` (the last page less), and the first 3 pages
cover ``min(1, 3 page / expert)`` of them, whatever the tokens (``dense_shares``). The
real backend counts the reads (``PagedExpertStore.page_reads``) and finds this.

For the claim to hold, accesses within an expert would have to be skewed towards its
first pages - as with activation sparsity that skips most of the FFN's hidden units
and a layout that puts the often-used ones first. ``zipf_exponent_for`` gives how
skewed: the exponent s of page-access shares proportional to 1 / (k + 1)^s that makes
the first pages cover a target share.
"""

from __future__ import annotations

import numpy as np


def dense_shares(expert_bytes: int, page_bytes: int) -> np.ndarray:
    """[pages] share of a dense FFN expert's weight accesses on each of its pages."""
    pages = -(-expert_bytes // page_bytes)
    sizes = np.full(pages, float(page_bytes))
    sizes[-1] = expert_bytes - page_bytes * (pages - 1)
    return sizes / expert_bytes


def first_pages_cover(shares: np.ndarray, first: int = 3) -> float:
    """Share of accesses that the ``first`` pages take."""
    return float(np.sum(shares[:first]))


def zipf_shares(pages: int, exponent: float) -> np.ndarray:
    """[pages] access shares proportional to 1 / (k + 1)^exponent (k = page index)."""
    w = 1.0 / np.arange(1, pages + 1, dtype=np.float64) ** exponent
    return w / w.sum()


def zipf_exponent_for(pages: int, target: float, first: int = 3) -> float | None:
    """The Zipf exponent at which the ``first`` of ``pages`` pages cover ``target`` of
    the accesses (bisection; 0 is uniform), or None when even uniform access covers it
    (``first >= pages``, or a target at most first / pages)."""
    if first >= pages or target <= first / pages:
        return None
    lo, hi = 0.0, 1.0
    while first_pages_cover(zipf_shares(pages, hi), first) < target:
        hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if first_pages_cover(zipf_shares(pages, mid), first) < target:
            lo = mid
        else:
            hi = mid
    return hi
