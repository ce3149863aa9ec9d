"""Max-min fair rates of flows over links, by water-filling (progressive filling, the
model SimGrid uses): rates and capacities in bytes/s.

A flow crosses a route of links; the rates are the max-min fair share: no flow's rate
can grow without lowering that of a flow whose rate is no larger. ``max_min_rates`` takes
routes as CSR over fabric edges, ``water_fill`` over links numbered from 0, and ``fill``,
which both end in, routes padded to one length, with a warm start for re-sharing after
flows end (what ``sim.network.network.Network`` does at each flow event).
"""

from __future__ import annotations

import numpy as np


def max_min_rates(indptr: np.ndarray, edges: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates (bytes/s) of flows over links.

    Flow i crosses links ``edges[indptr[i]:indptr[i+1]]`` (at least one); ``capacity`` is
    bytes/s per link. Water-filling, several bottlenecks per round: a link whose fair
    share (capacity left / unfrozen flows on it) is no larger than the share of any other
    link its flows cross is saturated at that share by progressive filling (the level at
    which any link fills is at least its current share, so nothing freezes those flows
    earlier). Each round freezes the flows of all such links at their share and takes
    their rates off the other links; rounds = depth of the bottleneck chain.
    """
    if len(indptr) < 2:
        return np.zeros(0)
    used, e = np.unique(edges, return_inverse=True)  # links in use, renumbered 0..U-1
    return water_fill(np.diff(indptr), e, np.asarray(capacity, dtype=np.float64)[used])


def water_fill(hops: np.ndarray, e: np.ndarray, capacity: np.ndarray, rate: np.ndarray | None = None,
               free: np.ndarray | None = None) -> np.ndarray:
    """``max_min_rates`` on links numbered ``0..len(capacity)-1``: flow i crosses the
    ``hops[i]`` (>= 1) links ``e[sum(hops[:i]):sum(hops[:i+1])]``. A link no flow crosses
    is ignored. ``rate`` and ``free``: a warm start (``fill``)."""
    hops = np.asarray(hops, dtype=np.int64)
    H = int(hops.max()) if len(hops) else 1
    U = len(capacity)
    return fill(pad_routes(hops, e, H, U), H, np.append(np.asarray(capacity, dtype=np.float64), np.inf), rate, free)


def pad_routes(hops: np.ndarray, e: np.ndarray, H: int, pad: int) -> np.ndarray:
    """CSR routes as ``H`` links per flow (row-major), the missing hops on link ``pad``."""
    n = len(hops)
    if len(e) == n * H:
        return np.asarray(e, dtype=np.int64)
    out = np.full((n, H), pad, dtype=np.int64)
    out[np.arange(H) < hops[:, None]] = e
    return out.reshape(-1)


def fill(e: np.ndarray, H: int, capacity: np.ndarray, rate: np.ndarray | None = None,
         free: np.ndarray | None = None) -> np.ndarray:
    """Max-min rates (bytes/s) by the water-filling of ``max_min_rates``; flow i crosses
    links ``e[i*H:(i+1)*H]``. The last link (``capacity[-1]`` = inf) pads routes of fewer
    than ``H`` hops. Every route has the same length so that the per-flow minimum and
    "any" are ``H`` strided operations (numpy's ``reduceat`` costs ten times more here).

    Warm start: with ``free`` (bool per flow), only those flows are filled; the others
    keep ``rate`` and their load is taken off their links first. Exact when the kept flows
    are those of an earlier max-min solution whose rates lie below the lowest rate of the
    flows removed since (``Network``): progressive filling up to that level did not
    depend on the removed flows, whose links had not filled yet.
    """
    n = len(e) // H
    U = len(capacity) - 1  # the padding link
    left = np.array(capacity, dtype=np.float64)
    if free is None:
        rate = np.empty(n)
        ids = np.arange(n)
    else:
        rate = np.array(rate, dtype=np.float64)
        fixed = np.repeat(~free, H)
        left -= np.bincount(e[fixed], weights=np.repeat(rate[~free], H), minlength=U + 1)
        np.maximum(left, 0.0, out=left)
        left[U] = np.inf
        ids, e = np.flatnonzero(free), e[~fixed]
    if len(ids) == 0:
        return rate
    count = np.bincount(e, minlength=U + 1).astype(np.float64)  # unfrozen flows per link
    with np.errstate(divide="ignore", invalid="ignore"):  # links left with no flow: 0/0
        while True:
            se = (left / count)[e]  # fair share of each entry's link
            fmin = se[0::H].copy()  # tightest share on each flow's path
            for j in range(1, H):
                np.minimum(fmin, se[j::H], out=fmin)
            fr = np.repeat(fmin, H)
            # a link is a bottleneck when none of its flows sees a tighter link elsewhere
            # (the padding link never is: every flow on it sees a finite share elsewhere)
            tighter = np.bincount(e, weights=fr < se * (1 - 1e-12), minlength=U + 1)
            bottleneck = tighter[e] == 0
            hit = bottleneck[0::H].copy()
            for j in range(1, H):
                hit |= bottleneck[j::H]
            if hit.all():
                rate[ids] = fmin
                return rate
            rate[ids[hit]] = fmin[hit]
            hr = np.repeat(hit, H)
            eh = e[hr]
            left -= np.bincount(eh, weights=fr[hr], minlength=U + 1)
            np.maximum(left, 0.0, out=left)
            left[U] = np.inf
            count -= np.bincount(eh, minlength=U + 1)
            e, ids = e[~hr], ids[~hit]
