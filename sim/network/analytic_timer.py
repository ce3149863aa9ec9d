"""Analytic (bottleneck-link) timing of collective ops, without simpy events.

An op is a sequence of stages of its algorithm (``CollectiveModel.stages``); each stage
waits a fixed latency (software cost and path latencies, seconds) and then moves bytes
over links. ``stage_loads(op)`` gives, per stage, that latency and the bytes the stage
puts on each link it uses (sparse: edge indices and bytes), a pure function of the op.
The loads come from the model's one decomposition (``CollectiveModel.atom_flows``, routed
by ``Fabric.paths``): every algorithm but the direct all-to-all moves bytes proportional
to the op's size, so its per-stage loads at 1 byte are cached per (kind, algorithm,
members) and scaled; an all-to-all's routes are cached per member set and weighted by its
matrix. Caches follow the fabric's ``routing_version``. ``seconds(op)`` is the op alone
on the fabric: per stage, its latency plus its most loaded link's bytes / capacity, the
same time as ``Network`` in analytic mode for the flows of ``CollectiveModel.atom_flows``.
An executor that runs several ops at once (``sim.step.schedule.run_analytic``) can sum the
stage loads of concurrent ops instead, and adds their statistics with ``record``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sim.network.collective_algorithms import Atom
from sim.network.collective_model import CollectiveModel
from sim.network.deepep_forward import forward_floor_seconds
from testbed.policy.collectives import CollectiveOp


class StageLoad(NamedTuple):
    """One stage of an op: ``fixed_s`` seconds of latency before its bytes flow, then
    ``nbytes[k]`` bytes (and ``messages[k]`` library messages) on edge ``edges[k]``
    (unique edge indices of the fabric). ``edges`` is empty for a stage that moves nothing."""

    fixed_s: float
    edges: np.ndarray
    nbytes: np.ndarray
    messages: np.ndarray


class _Pattern(NamedTuple):
    """Cached routes of an all-to-all's member set: every ordered pair of distinct members."""

    i: np.ndarray  # member index of each flow's source
    j: np.ndarray  # member index of each flow's destination
    hops: np.ndarray  # edges per flow
    latency: np.ndarray  # path latency per flow (s)
    edges: np.ndarray  # unique edges the flows cross
    entry_edge: np.ndarray  # position in ``edges`` of each (flow, hop) entry, flows in order
    by_edge: np.ndarray  # the entries in edge order (stable: flows in order on each)
    firsts: np.ndarray  # where each edge's entries start in that order


_NONE = np.zeros(0, np.int64), np.zeros(0), np.zeros(0)


class AnalyticTimer:
    """The analytic time of ops, with loads cached per algorithm and member set;
    statistics go to the network's per-edge counters (``model.network``)."""

    def __init__(self, model: CollectiveModel):
        self.model = model
        self.fabric = model.fabric
        self.stats = model.network
        self._stages: dict[tuple, list[tuple]] = {}
        self._patterns: dict[tuple, _Pattern] = {}
        self._version = self.fabric.routing_version

    # ---- loads -------------------------------------------------------------------------------
    def stage_loads(self, op: CollectiveOp) -> list[StageLoad]:
        """Per stage of ``op``'s algorithm: its fixed latency and the bytes on each link of
        all its atoms together (module doc). Pure: adds no statistics."""
        if self.fabric.routing_version != self._version:
            self._stages.clear()
            self._patterns.clear()
            self._version = self.fabric.routing_version
        if op.kind == "all_to_all_v":
            return [self.all_to_all_loads(op.members, [op])[0][0]]
        algorithm = "direct" if op.kind == "p2p" else self.model.algorithm_for(op)
        key = (op.kind, algorithm, op.members)
        unit = self._stages.get(key)
        if unit is None:
            stages = [[Atom("p2p", op.members, 1.0)]] if op.kind == "p2p" else \
                self.model.stages_of(op.kind, algorithm, op.members, 1.0)
            unit = self._stages[key] = [self._merge(stage) for stage in stages]
        size = float(op.size)
        if size > 0:
            return [StageLoad(fixed, edges, per_byte * size, messages.copy()) for fixed, edges, per_byte, messages in unit]
        return [StageLoad(fixed, edges, per_byte * 0.0, messages * 0.0) for fixed, edges, per_byte, messages in unit]

    def _merge(self, stage: list[Atom]) -> tuple:
        """(fixed s, edges, bytes per byte of the op's size, messages) of a stage's atoms."""
        fixed, parts = 0.0, []
        for atom in stage:
            u = self.model.unit_load(atom)
            if u is None:
                continue
            fixed = max(fixed, u.fixed_s if atom.fixed_s is None else atom.fixed_s)
            parts.append((u.edges, u.per_byte * atom.size, u.messages))
        if not parts:
            return (fixed, *_NONE)
        if len(parts) == 1:
            return (fixed, *parts[0])
        edges = np.concatenate([p[0] for p in parts])
        uniq, inv = np.unique(edges, return_inverse=True)
        return (fixed, uniq, np.bincount(inv, np.concatenate([p[1] for p in parts]), len(uniq)),
                np.bincount(inv, np.concatenate([p[2] for p in parts]), len(uniq)))

    def stage_seconds(self, load: StageLoad) -> float:
        """Seconds of one stage alone on the fabric: latency + bottleneck link."""
        if len(load.edges) == 0:
            return load.fixed_s
        cap = self.fabric.capacity[load.edges].clip(min=1e-300)
        return load.fixed_s + float((load.nbytes / cap).max())

    def record(self, loads: list[StageLoad]) -> None:
        """Add the stages' bytes, messages and busy seconds (bytes / capacity) to the
        network's per-edge statistics."""
        for load in loads:
            if len(load.edges):
                self.stats.bytes_by_edge[load.edges] += load.nbytes
                self.stats.messages_by_edge[load.edges] += load.messages
                self.stats.busy_by_edge[load.edges] += load.nbytes / self.fabric.capacity[load.edges].clip(min=1e-300)

    def seconds(self, op: CollectiveOp) -> float:
        """Seconds ``op`` takes alone on the fabric (and its statistics recorded), at least
        its kernels' floor (``floor_seconds``)."""
        loads = self.stage_loads(op)
        self.record(loads)
        return max(sum(self.stage_seconds(load) for load in loads), self.floor_seconds(op))

    def floor_seconds(self, op: CollectiveOp) -> float:
        """The least seconds ``op`` takes whatever its links: DeepEP's forwarding kernels'
        (``sim.network.deepep_forward``), else 0."""
        return forward_floor_seconds(op, self.model.profile.collectives)

    # ---- the direct all-to-all ------------------------------------------------------------
    def _pattern(self, members: tuple[int, ...]) -> _Pattern:
        pat = self._patterns.get(members)
        if pat is None:
            p = len(members)
            i, j = np.nonzero(~np.eye(p, dtype=bool))
            m = np.asarray(members, dtype=np.int64)
            src, dst = m[i], m[j]
            paths = self.fabric.paths(src, dst, nic_of_src=self.model.pxn_nics(src, dst))
            uniq, inv = np.unique(paths.edges, return_inverse=True)
            by_edge = np.argsort(inv, kind="stable")
            firsts = np.flatnonzero(np.r_[True, np.diff(inv[by_edge]) != 0])
            pat = self._patterns[members] = _Pattern(i, j, paths.hops, paths.latency, uniq, inv, by_edge, firsts)
        return pat

    def all_to_all_loads(self, members: tuple[int, ...], ops: list[CollectiveOp]
                         ) -> tuple[list[StageLoad], list[np.ndarray]]:
        """The one stage of each direct all-to-all of ``members`` in ``ops``: the flows of
        ``CollectiveModel.atom_flows`` (the matrix's non-zero off-diagonal entries) on the
        member set's cached routes, all ops at once; and per op the bytes of its largest
        flow on each edge of its ``StageLoad.edges`` (what an executor sharing links
        between ops needs: max-min lets a stage's largest flow on a link finish last).
        Pure: adds no statistics."""
        if len(members) < 2:
            return [StageLoad(0.0, *_NONE) for _ in ops], [np.zeros(0) for _ in ops]
        pat = self._pattern(members)
        matrices = np.stack([np.asarray(op.matrix, dtype=np.float64) for op in ops])  # [ops, p, p]
        flows = matrices[:, pat.i, pat.j]  # [ops, flows] bytes
        used = flows > 0
        # [(flow, hop) entries by edge, ops]: each edge's entries are consecutive rows
        entries = np.repeat(flows.T, pat.hops, axis=0)[pat.by_edge]
        load = np.add.reduceat(entries, pat.firsts, axis=0).T.copy()  # [ops, edges]
        largest = np.maximum.reduceat(entries, pat.firsts, axis=0).T.copy()
        sent = np.repeat(used.T.astype(np.float64), pat.hops, axis=0)[pat.by_edge]
        messages = np.add.reduceat(sent, pat.firsts, axis=0).T.copy()
        hop_s = np.where(used, pat.latency, -np.inf).max(axis=1)  # the slowest path of its messages
        nz = matrices != 0  # the most peer messages of a member: those it sends and receives
        diagonal = np.arange(len(members))
        nz[:, diagonal, diagonal] = False
        peers = (nz.sum(axis=2) + nz.sum(axis=1)).max(axis=1)
        out, big = [], []
        for k, op in enumerate(ops):
            if not used[k].any():  # the call costs its latency, moves nothing
                out.append(StageLoad(self.model.call_latency, *_NONE))
                big.append(np.zeros(0))
                continue
            fixed = self.model.all_to_all_fixed(Atom(op.kind, members, 0, op.matrix), float(hop_s[k]), int(peers[k]))
            out.append(StageLoad(fixed, pat.edges, load[k], messages[k]))
            big.append(largest[k])
        return out, big

