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

  Recomputation is incremental, with the same result as solving every flow anew:
  flows are kept in *components* (flows that share a link, directly or through other
  flows; the EP groups of an all-to-all phase are separate components), each with its
  own events, so a start or finish re-shares only its component; and when flows end,
  only the flows whose rate was at least the lowest rate of those that ended are filled
  again (``fill``, ``sim.network.max_min``: flows frozen below that level by progressive
  filling never depended on them).
- ``analytic``: a group of flows started together finishes after
  ``max over links(bytes of the group on that link / capacity)`` plus the largest path
  latency of its flows. Groups started on this object do not interact: each behaves as
  if alone on the fabric (what probes of one op want); exact for one group of equal-rate
  flows. The step executor's analytic mode (``sim.step.schedule.run_analytic``) does not use
  this: it shares links between the ops that run at the same time itself.

Latency: a flow first waits its path latency (sum over its links, seconds), then takes
bandwidth. ``path_latency=False`` skips that wait for callers (the collective model)
that account for latency themselves.

A group of flows is one ``start_flows`` call; its event fires when all its flows are
done. Flows of zero bytes, and fabric flows from a rank to itself, move nothing and are
dropped; a group with nothing left fires at once.

Statistics: bytes carried and busy seconds per edge, library messages per edge, bytes
per tag. Bytes are counted when a group starts (all of a flow's bytes cross every edge
of its route); busy = at least one flow transmitting on the edge (analytic mode: the
group's bytes / capacity).
"""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import simpy

from sim.hardware.fabric import Fabric
from sim.network.max_min import fill, pad_routes
from testbed.core.errors import RunError
from testbed.scenario.topology import LEVELS

REL_EPS = 1e-9  # flows finishing within this relative time of each other finish together
COALESCE = 1e-2  # default: a finish may wait this fraction of the flow's duration
MODES = ("flow", "analytic")


class _Component:
    """Active flows that share links, directly or through one another (flow mode).

    The max-min rates of one component do not depend on any other's, so each is re-shared
    alone when its own flows change and has its own next finish: the EP groups of an
    all-to-all phase, which share no link, cost one small solve per event of their own
    instead of one solve of every flow of the fabric.

    Per flow (columns of ``f``): remaining bytes, rate (bytes/s), start time (s);
    ``group``: its ``start_flows`` call. Routes: ``used`` are the fabric edges the
    component holds, ``route`` the ``H`` indices into ``used`` of each flow's links
    (``len(used)`` pads shorter routes; ``fill``). ``last``: the time (s) up to which
    ``f`` is advanced; ``gen`` numbers its re-sharings (a finish event of an older one is
    stale).
    """

    __slots__ = ("H", "alive", "cid", "edge_on", "edge_rate", "f", "gen", "group", "groups", "last", "route",
                 "settled", "used")

    def __init__(self, cid: int, f: np.ndarray, group: np.ndarray, hops: np.ndarray, edges: np.ndarray,
                 last: float):
        self.cid, self.f, self.group = cid, f, group
        self.used, loc = np.unique(edges, return_inverse=True)
        self.H = int(hops.max())
        self.route = pad_routes(hops, loc.reshape(-1), self.H, len(self.used))
        self.edge_rate = np.zeros(len(self.used))  # bytes/s over each used edge
        self.edge_on = np.zeros(len(self.used), dtype=bool)
        self.groups = len(np.unique(group))  # distinct groups (1: an op's flows alone, the common case)
        self.last, self.gen, self.alive = last, 0, True
        #: flows whose rates lie below this (bytes/s) keep them at the next re-sharing
        #: (``fill``'s warm start; only flows ended since the last one); 0: all anew
        self.settled = 0.0

    def routes(self) -> tuple[np.ndarray, np.ndarray]:
        """(hops, fabric edges) of the flows, as ``Fabric.paths`` gives them."""
        real = self.route < len(self.used)
        return real.reshape(-1, self.H).sum(axis=1), self.used[self.route[real]]


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
        # flow mode: components of active flows, and which component holds each edge (-1: none)
        self._comps: dict[int, _Component] = {}
        self._comp_ids = itertools.count()
        self._edge_comp = np.full(E, -1, dtype=np.int64)
        self._changed: set[int] = set()  # components to re-share at the end of this instant
        self._dirty = False

    # ---- starting transfers --------------------------------------------------------------
    def start_flows(self, src, dst, nbytes, tag=None, *, kind: str = "fabric",
                    path_latency: bool = True, messages: float = 1.0, nic_of_src=None) -> simpy.Event:
        """Start a group of flows ``src[i] -> dst[i]`` of ``nbytes[i]`` bytes (ranks).

        ``kind``: ``fabric`` (GPU to GPU), ``h2d`` (host to GPU ``dst``), ``d2h`` (GPU
        ``src`` to host), ``edge`` (``src[i]`` is the one fabric edge flow i crosses; see
        ``Fabric.paths``). ``messages``: library messages each flow carries (counted per
        edge for the wire bytes). ``nic_of_src``: per flow, the GPU whose NIC it leaves
        the source node through (PXN; passed on to ``Fabric.paths``; None: the fabric's
        own choice). Returns an event that fires when every flow has arrived.
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
        if nic_of_src is None:
            paths = self.fabric.paths(src, dst, kind)
        else:
            nic = np.broadcast_to(np.asarray(nic_of_src, dtype=np.int64), keep.shape)[keep]
            paths = self.fabric.paths(src, dst, kind, nic_of_src=nic)
        self._check_up(paths.edges)
        if kind not in ("h2d", "d2h"):  # library messages on the fabric (not PCIe copies)
            np.add.at(self.messages_by_edge, paths.edges, messages)
        self.bytes_by_tag[tag] = self.bytes_by_tag.get(tag, 0.0) + float(nbytes.sum())
        delay = paths.latency if path_latency else np.zeros(len(nbytes))
        if self.mode == "analytic":
            return self._start_analytic(paths, nbytes, float(delay.max()), done)
        # every byte of a flow crosses every edge of its route: counted now, exactly
        np.add.at(self.bytes_by_edge, paths.edges, np.repeat(nbytes, paths.hops))
        gid = next(self._ids)
        self._groups[gid] = [done, len(nbytes)]
        if not path_latency:
            self._activate((nbytes, np.full(len(nbytes), gid), paths.hops, paths.edges))
            return done
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
        if self.mode == "flow" and self._comps:
            for c in self._comps.values():
                self._check_up(c.used)
                c.settled = 0.0
            self._changed.update(self._comps)
            self._touch()

    def _check_up(self, edges: np.ndarray) -> None:
        down = edges[self.fabric.capacity[edges] <= 0]
        if len(down):
            raise RunError(f"link {self.fabric.edge_name(int(down[0]))} is down and the fabric "
                           "has no alternative route (sim.hardware.fabric routes are fixed)")

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
        """New flows join the components whose edges they cross, merged into one."""
        nbytes, group, hops, edges = batch
        now = self.env.now
        n = len(nbytes)
        f = np.stack([nbytes, np.zeros(n), np.full(n, now)])
        ids = np.unique(self._edge_comp[edges])
        parts = [self._comps.pop(int(i)) for i in ids[ids >= 0]]
        for c in parts:
            self._advance(c)
            c.alive = False  # its pending finish event is stale
            self._changed.discard(c.cid)
        if parts:
            routes = [c.routes() for c in parts]
            f = np.concatenate([c.f for c in parts] + [f], axis=1)
            group = np.concatenate([c.group for c in parts] + [group])
            hops = np.concatenate([r[0] for r in routes] + [hops])
            edges = np.concatenate([r[1] for r in routes] + [edges])
        cid = next(self._comp_ids)
        comp = self._comps[cid] = _Component(cid, f, group, hops, edges, now)
        self._edge_comp[comp.used] = cid
        self._changed.add(cid)
        self._touch()

    def _touch(self) -> None:
        """Re-share the changed components once per instant, after every flow change at this time."""
        if not self._dirty:
            self._dirty = True
            self.env.timeout(0).callbacks.append(self._update)

    def _update(self, _event) -> None:
        self._dirty = False
        changed, self._changed = sorted(self._changed), set()
        for cid in changed:
            comp = self._comps.get(cid)
            if comp is not None:
                self._share(comp)

    def _share(self, comp: _Component) -> None:
        """Max-min rates of one component, and its next finish event."""
        self._advance(comp)
        rem, rate, t0 = comp.f
        U = len(comp.used)
        cap = np.empty(U + 1)
        cap[:U] = self.fabric.capacity[comp.used]
        cap[U] = np.inf
        if comp.settled > 0:  # only flows ended since: those below the lowest of their rates stay
            free = rate >= comp.settled * (1 - 1e-9)
            if free.any():
                rate[:] = fill(comp.route, comp.H, cap, rate, free)
        else:
            rate[:] = fill(comp.route, comp.H, cap)
            if not (rate > 0).all():
                raise RunError("a flow has no bandwidth (a link on its path is down)")
        self.recomputations += 1
        comp.settled = np.inf
        comp.edge_rate = np.bincount(comp.route, weights=np.repeat(rate, comp.H), minlength=U + 1)[:U]
        comp.edge_on = comp.edge_rate > 0
        comp.gen += 1
        left = rem / rate
        dt = float(left.min())
        if self.coalesce > 0:  # wait for flows ending within coalesce x their age
            window = left - dt <= self.coalesce * (self.env.now + left - t0)
            if window.any():
                dt = float(left[window].max())
        dt = max(dt, 0.0)
        self.env.timeout(dt).callbacks.append(partial(self._on_finish, comp, comp.gen, dt))

    def _advance(self, comp: _Component) -> None:
        """Move a component's flows forward to ``env.now`` at their current rates."""
        dt = self.env.now - comp.last
        if dt > 0:
            comp.last = self.env.now
            comp.f[0] -= comp.f[1] * dt
            # a flow due at this instant can land a rounding error below 0 bytes: it is done, not owed time
            np.maximum(comp.f[0], 0.0, out=comp.f[0])
            self.busy_by_edge[comp.used] += dt * comp.edge_on

    def _on_finish(self, comp: _Component, gen: int, dt: float, _event) -> None:
        """The flows of a component due now end; the rest are re-shared at once."""
        if not comp.alive or gen != comp.gen:  # merged away, or re-shared since
            return
        self._advance(comp)
        rem, rate, _ = comp.f
        left = rem / rate
        # done (left <= 0 when coalesced), or within float rounding of done
        done = left <= REL_EPS * dt + 4 * np.spacing(self.env.now)
        if not done.any():  # float rounding left a sliver: finish the earliest flow
            done = left <= left.min()
        if comp.groups == 1:
            gids, counts = comp.group[:1].tolist(), [int(done.sum())]
        else:
            gids, counts = np.unique(comp.group[done], return_counts=True)
            gids, counts = gids.tolist(), counts.tolist()
        comp.settled = min(comp.settled, float(rate[done].min()))
        keep = ~done
        comp.f, comp.group = comp.f[:, keep], comp.group[keep]
        comp.route = route = comp.route[np.repeat(keep, comp.H)]
        # edges no flow of the component crosses any more are free for others
        U = len(comp.used)
        held = np.bincount(route, minlength=U + 1)[:U] > 0
        if not held.all():
            self._edge_comp[comp.used[~held]] = -1
            renumber = np.append(np.cumsum(held) - 1, held.sum())  # the padding link stays last
            comp.route = renumber[route]
            comp.used, comp.edge_on = comp.used[held], comp.edge_on[held]
        if keep.any():
            self._share(comp)  # now: nothing else changes this component at this instant first
        else:
            comp.alive = False
            del self._comps[comp.cid]
        for gid, count in zip(gids, counts):
            entry = self._groups[gid]
            entry[1] -= count
            if entry[1] == 0:
                del self._groups[gid]
                entry[0].succeed()

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
        return sum(c.f.shape[1] for c in self._comps.values())
