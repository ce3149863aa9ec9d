"""Flow-level network model on simpy: transfers as fluid flows over the fabric.

Two modes (``SimConfig.network_model``):

- ``flow``: every flow takes a share of each link it crosses; shares follow max-min
  fairness (progressive filling, the model SimGrid uses) and are recomputed whenever a
  flow starts or ends. Between those events the remaining bytes of each flow drop at its
  rate; the next event is the earliest finish, and every flow whose own finish lies
  within ``REL_EPS`` of it (float rounding) finishes there too. Flows of different sizes
  otherwise cost one max-min recomputation each (4,032 for a skewed 64-GPU
  all-to-all), so ``coalesce`` (default 0.01) lets the next event wait for the flows
  that finish soon after the earliest, up to ``coalesce`` times their own duration:
  a flow done early keeps its share idle until that event. Finishes are thus never
  early (the bottleneck bound of analytic mode still holds) and at most about 1% late;
  bytes are exact. ``coalesce=0`` gives exact event times.
- ``analytic``: a group of flows started together finishes after
  ``max over links(bytes of the group on that link / capacity)`` plus the largest path
  latency of its flows. Concurrent groups do not interact: each behaves as if alone on
  the fabric. Much cheaper for very large runs; exact for one group of equal-rate flows.

Latency: a flow first waits its path latency (sum over its links, seconds), then takes
bandwidth. ``path_latency=False`` skips that wait for callers (the collective model)
that account for latency themselves.

A group of flows is one ``start_flows`` call; its event fires when all its flows are
done. Flows of zero bytes, and fabric flows from a rank to itself, move nothing and are
dropped; a group with nothing left fires at once.

Statistics: bytes carried and busy seconds per edge, bytes per tag; busy = at least one
flow transmitting on the edge (analytic mode: the group's bytes / capacity).
"""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import simpy

from sim.fabric import Fabric
from testbed.errors import RunError
from testbed.topology import LEVELS

REL_EPS = 1e-9  # flows finishing within this relative time of each other finish together
COALESCE = 1e-2  # default: a finish may wait this fraction of the flow's duration
MODES = ("flow", "analytic")


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
    n = len(indptr) - 1
    rate = np.zeros(n)
    if n == 0:
        return rate
    used, e = np.unique(edges, return_inverse=True)  # links in use, renumbered 0..U-1
    U = len(used)
    left = np.asarray(capacity, dtype=np.float64)[used]
    count = np.bincount(e, minlength=U).astype(np.float64)  # unfrozen flows per link
    ids = np.arange(n)  # unfrozen flows; their entries are compacted every round
    hops = np.diff(indptr)
    starts = np.asarray(indptr[:-1])
    row = np.repeat(ids, hops)
    with np.errstate(divide="ignore", invalid="ignore"):  # links left with no flow: 0/0
        while True:
            se = (left / count)[e]  # fair share of each entry's link
            fmin = np.minimum.reduceat(se, starts)  # tightest share on each flow's path
            fr = fmin[row]
            # a link is a bottleneck when none of its flows sees a tighter link elsewhere
            tighter = np.bincount(e, weights=fr < se * (1 - 1e-12), minlength=U)
            hit = np.logical_or.reduceat(tighter[e] == 0, starts)
            rate[ids[hit]] = fmin[hit]
            if hit.all():
                return rate
            hr = hit[row]
            left = np.maximum(left - np.bincount(e, weights=fr * hr, minlength=U), 0.0)
            count -= np.bincount(e, weights=hr, minlength=U)
            keep = ~hit
            ids, hops, e = ids[keep], hops[keep], e[~hr]
            starts = np.zeros(len(ids), dtype=np.int64)
            np.cumsum(hops[:-1], out=starts[1:])
            row = np.repeat(np.arange(len(ids)), hops)


class Network:
    """The fabric's links shared by flows, in simulated time (seconds).

    mode      ``flow`` or ``analytic`` (module doc)
    coalesce  flow mode: relative delay of a finish allowed to share events (0 = exact)
    """

    def __init__(self, env: simpy.Environment, fabric: Fabric, mode: str = "flow",
                 coalesce: float = COALESCE):
        if mode not in MODES:
            raise ValueError(f"unknown network mode {mode!r} (flow or analytic)")
        self.env, self.fabric, self.mode = env, fabric, mode
        self.coalesce = coalesce
        E = fabric.num_edges
        self.bytes_by_edge = np.zeros(E)  # bytes carried
        self.messages_by_edge = np.zeros(E)  # library messages carried (for wire-byte overhead)
        self.busy_by_edge = np.zeros(E)  # seconds with traffic
        self.bytes_by_tag: dict = {}
        self.recomputations = 0  # max-min solves (flow mode), for speed measurements
        self._groups: dict[int, list] = {}  # id -> [event, flows outstanding]
        self._ids = itertools.count()
        # active flows (flow mode), struct of arrays + CSR of their edges
        self._rem = np.zeros(0)
        self._t0 = np.zeros(0)  # activation time of each flow, s
        self._group = np.zeros(0, dtype=np.int64)
        self._indptr = np.zeros(1, dtype=np.int64)
        self._edges = np.zeros(0, dtype=np.int64)
        self._rate = np.zeros(0)
        self._edge_rate = np.zeros(E)
        self._last = env.now
        self._gen = 0
        self._dirty = False

    # ---- starting transfers --------------------------------------------------------------
    def start_flows(self, src, dst, nbytes, tag=None, *, kind: str = "fabric",
                    path_latency: bool = True, messages: float = 1.0) -> simpy.Event:
        """Start a group of flows ``src[i] -> dst[i]`` of ``nbytes[i]`` bytes (ranks).

        ``kind``: ``fabric`` (GPU to GPU), ``h2d`` (host to GPU ``dst``), ``d2h`` (GPU
        ``src`` to host). ``messages``: library messages each flow carries (counted per
        edge for the wire bytes). Returns an event that fires when every flow has arrived.
        """
        src, dst, nbytes = np.broadcast_arrays(np.atleast_1d(np.asarray(src, dtype=np.int64)),
                                               np.atleast_1d(np.asarray(dst, dtype=np.int64)),
                                               np.atleast_1d(np.asarray(nbytes, dtype=np.float64)))
        if (nbytes < 0).any() or not np.isfinite(nbytes).all():
            raise ValueError("flow sizes must be finite and >= 0 bytes")
        keep = nbytes > 0
        if kind == "fabric":
            keep &= src != dst
        src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
        done = self.env.event()
        if len(nbytes) == 0:
            return done.succeed()
        paths = self.fabric.paths(src, dst, kind)
        self._check_up(paths.edges)
        if kind == "fabric":
            np.add.at(self.messages_by_edge, paths.edges, messages)
        self.bytes_by_tag[tag] = self.bytes_by_tag.get(tag, 0.0) + float(nbytes.sum())
        delay = paths.latency if path_latency else np.zeros(len(nbytes))
        if self.mode == "analytic":
            return self._start_analytic(paths, nbytes, float(delay.max()), done)
        gid = next(self._ids)
        self._groups[gid] = [done, len(nbytes)]
        # one activation per distinct latency (a few: nvlink, leaf and spine paths)
        levels, which = np.unique(np.round(delay, 15), return_inverse=True)
        for k, lat in enumerate(levels):
            sel = which == k
            batch = (nbytes[sel], np.full(int(sel.sum()), gid), paths.hops[sel],
                     paths.edges[np.repeat(sel, paths.hops)])
            if lat <= 0:
                self._activate(batch)
            else:
                self.env.timeout(lat).callbacks.append(partial(self._on_activate, batch))
        return done

    def transfer(self, src: int, dst: int, nbytes: float, tag=None, *, kind: str = "fabric",
                 path_latency: bool = True) -> simpy.Event:
        """One flow; see ``start_flows``."""
        return self.start_flows([src], [dst], [nbytes], tag, kind=kind, path_latency=path_latency)

    def refresh(self) -> None:
        """Re-share bandwidth now, after ``fabric.set_capacity`` changed links mid-run."""
        if self.mode == "flow" and len(self._rem):
            self._check_up(self._edges)
            self._touch()

    def _check_up(self, edges: np.ndarray) -> None:
        down = edges[self.fabric.capacity[edges] <= 0]
        if len(down):
            raise RunError(f"link {self.fabric.edge_name(int(down[0]))} is down and the fabric "
                           "has no alternative route (sim.fabric routes are fixed)")

    # ---- analytic mode ---------------------------------------------------------------------
    def _start_analytic(self, paths, nbytes, latency, done):
        load = np.bincount(paths.edges, weights=np.repeat(nbytes, paths.hops),
                           minlength=self.fabric.num_edges)
        busy = load / self.fabric.capacity.clip(min=1e-300)
        self.bytes_by_edge += load
        self.busy_by_edge += busy
        self.env.timeout(latency + float(busy.max())).callbacks.append(lambda _: done.succeed())
        return done

    # ---- flow mode: events -------------------------------------------------------------------
    def _on_activate(self, batch, _event) -> None:
        self._activate(batch)

    def _activate(self, batch) -> None:
        nbytes, group, hops, edges = batch
        self._advance()
        self._rem = np.concatenate([self._rem, nbytes])
        self._t0 = np.concatenate([self._t0, np.full(len(nbytes), self.env.now)])
        self._group = np.concatenate([self._group, group])
        self._rate = np.concatenate([self._rate, np.zeros(len(nbytes))])
        self._indptr = np.concatenate([self._indptr, self._indptr[-1] + np.cumsum(hops)])
        self._edges = np.concatenate([self._edges, edges])
        self._touch()

    def _touch(self) -> None:
        """Recompute rates once per instant, after every flow change at this time."""
        if not self._dirty:
            self._dirty = True
            self.env.timeout(0).callbacks.append(self._update)

    def _update(self, _event) -> None:
        self._dirty = False
        self._advance()
        n = len(self._rem)
        if n == 0:
            self._rate, self._edge_rate = np.zeros(0), np.zeros(self.fabric.num_edges)
            return
        self._rate = max_min_rates(self._indptr, self._edges, self.fabric.capacity)
        self._edge_rate = np.bincount(self._edges, weights=np.repeat(self._rate, np.diff(self._indptr)),
                                      minlength=self.fabric.num_edges)
        self.recomputations += 1
        if not (self._rate > 0).all():
            raise RunError("a flow has no bandwidth (a link on its path is down)")
        self._gen += 1
        left = self._rem / self._rate
        dt = float(left.min())
        if self.coalesce > 0:  # wait for flows ending within coalesce x their age
            window = left - dt <= self.coalesce * (self.env.now + left - self._t0)
            dt = float(left[window].max())
        dt = max(dt, 0.0)
        self.env.timeout(dt).callbacks.append(partial(self._on_finish, self._gen, dt))

    def _advance(self) -> None:
        """Move every active flow forward to ``env.now`` at its current rate."""
        dt = self.env.now - self._last
        self._last = self.env.now
        if dt > 0 and len(self._rem):
            self._rem -= self._rate * dt
            self.bytes_by_edge += self._edge_rate * dt
            self.busy_by_edge += dt * (self._edge_rate > 0)

    def _on_finish(self, gen: int, dt: float, _event) -> None:
        if gen != self._gen:  # superseded by a later recomputation
            return
        self._advance()
        with np.errstate(divide="ignore"):  # flows started this instant have no rate yet: not done
            left = self._rem / self._rate
        # done (left <= 0 when coalesced), or within float rounding of done
        done = left <= REL_EPS * dt + 4 * np.spacing(self.env.now)
        if not done.any():  # float rounding left a sliver: finish the earliest flow
            done = left <= left.min()
        # the slivers of finished flows still count as carried bytes
        sliver = np.repeat(self._rem[done], np.diff(self._indptr)[done])
        edge_done = np.repeat(done, np.diff(self._indptr))
        np.add.at(self.bytes_by_edge, self._edges[edge_done], sliver)
        gids, counts = np.unique(self._group[done], return_counts=True)
        keep = ~done
        hops = np.diff(self._indptr)[keep]
        self._edges = self._edges[~edge_done]
        self._indptr = np.concatenate([[0], np.cumsum(hops)])
        self._rem, self._group, self._rate = self._rem[keep], self._group[keep], self._rate[keep]
        self._t0 = self._t0[keep]
        for gid, count in zip(gids.tolist(), counts.tolist()):
            entry = self._groups[gid]
            entry[1] -= count
            if entry[1] == 0:
                del self._groups[gid]
                entry[0].succeed()
        self._touch()

    # ---- statistics --------------------------------------------------------------------------
    def bytes_by_level(self) -> dict[str, float]:
        """Bytes carried per level name, summed over the directed edges of the level.

        A flow crossing two edges of a level counts twice (leaf paths cross the NIC
        links at both ends).
        """
        by = np.bincount(self.fabric.level, weights=self.bytes_by_edge, minlength=len(LEVELS))
        return {name: float(by[i]) for i, name in enumerate(LEVELS)}

    def wire_bytes_by_level(self, payload_by_edge: np.ndarray, protocol, messages_by_edge=None) -> dict[str, int]:
        """What the links of each network level carried for ``payload_by_edge`` payload bytes
        and ``messages_by_edge`` library messages (per edge): summed over the level's
        directed links, with the profile's ``protocol`` overhead (headers forward,
        acknowledgements back on the same level, a fixed cost per message)."""
        per_byte = 1.0 / protocol.payload_fraction + protocol.ack_fraction
        wire = payload_by_edge * per_byte
        if messages_by_edge is not None:
            wire = wire + messages_by_edge * protocol.message_bytes
        by = np.bincount(self.fabric.level, weights=wire, minlength=len(LEVELS))
        return {LEVELS[i]: int(round(by[i])) for i in range(3)}

    def utilization_by_level(self, elapsed: float, active_only: bool = False) -> dict[str, float]:
        """Bytes carried / (nominal capacity x ``elapsed`` seconds) per level.

        Averages over every directed edge of the level, or only over edges that carried
        traffic when ``active_only``. 0 for a level with no (active) edges.
        """
        out = {}
        for i, name in enumerate(LEVELS):
            sel = self.fabric.level == i
            if active_only:
                sel &= self.bytes_by_edge > 0
            cap = self.fabric.nominal[sel].sum() * elapsed
            out[name] = float(self.bytes_by_edge[sel].sum() / cap) if cap > 0 else 0.0
        return out

    def hottest_links(self, k: int = 10, elapsed: float | None = None) -> list[dict]:
        """The ``k`` edges with the most bytes per nominal capacity (seconds of full-rate
        traffic), with name, level, bytes, busy seconds and, given ``elapsed``, utilization."""
        load = self.bytes_by_edge / self.fabric.nominal
        order = np.argsort(-load, kind="stable")[:k]
        rows = []
        for e in order:
            if self.bytes_by_edge[e] <= 0:
                break
            row = {"edge": int(e), "name": self.fabric.edge_name(int(e)),
                   "level": LEVELS[self.fabric.level[e]], "bytes": float(self.bytes_by_edge[e]),
                   "busy_s": float(self.busy_by_edge[e]), "load_s": float(load[e])}
            if elapsed:
                row["utilization"] = float(load[e] / elapsed)
            rows.append(row)
        return rows

    @property
    def active_flows(self) -> int:
        return len(self._rem)
