"""Analytic (bottleneck-link) timing of collective ops, without simpy events.

An op is a sequence of stages of its algorithm (``CollectiveModel.stages``); each stage
waits a fixed latency (software cost and path latencies, seconds) and then moves bytes
over links. ``stage_loads(op)`` gives, per stage, that latency and the bytes the stage
puts on each link it uses (sparse: edge indices and bytes), a pure function of the op
with routes cached per member set. ``seconds(op)`` is the op alone on the fabric: per
stage, its latency plus its most loaded link's bytes / capacity, the same time as
``Network`` in analytic mode for the flows of ``CollectiveModel.atom_flows``. An executor
that runs several ops at once (``sim.schedule.run_analytic``) can sum the stage loads
of concurrent ops instead, and adds their statistics with ``record``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from testbed.collectives import CollectiveOp, algorithm_messages

from sim.collective_model import Atom, CollectiveModel, ring_share


class StageLoad(NamedTuple):
    """One stage of an op: ``fixed_s`` seconds of latency before its bytes flow, then
    ``nbytes[k]`` bytes (and ``messages[k]`` library messages) on edge ``edges[k]``
    (unique edge indices of the fabric). ``edges`` is empty for a stage that moves nothing."""

    fixed_s: float
    edges: np.ndarray
    nbytes: np.ndarray
    messages: np.ndarray


class _Pattern(NamedTuple):
    """Cached routes of an op shape: flows between member indices and their paths."""

    i: np.ndarray  # member index of each flow's source
    j: np.ndarray  # member index of each flow's destination
    hops: np.ndarray  # edges per flow
    latency: np.ndarray  # path latency per flow (s)
    edges: np.ndarray  # unique edges the flows cross
    entry_edge: np.ndarray  # position in ``edges`` of each (flow, hop) entry, flows in order


class AnalyticTimer:
    """The analytic time of ops, with routes cached per member set; statistics go to the
    network's per-edge counters (``model.network``)."""

    def __init__(self, model: CollectiveModel):
        self.model = model
        self.fabric = model.fabric
        self.stats = model.network
        self._patterns: dict[tuple, _Pattern] = {}

    # ---- loads -------------------------------------------------------------------------------
    def stage_loads(self, op: CollectiveOp) -> list[StageLoad]:
        """Per stage of ``op``'s algorithm: its fixed latency and the bytes on each link of
        all its atoms together (module doc). Pure: adds no statistics."""
        out = []
        for stage in self.model.stages(op):
            fixed = 0.0
            parts = []
            for atom in stage:
                got = self._atom_load(atom)
                if got is None:
                    continue
                fixed = max(fixed, got[0])
                if got[1] is not None:
                    parts.append(got[1:])
            if not parts:
                out.append(StageLoad(fixed, np.zeros(0, np.int64), np.zeros(0), np.zeros(0)))
            elif len(parts) == 1:
                out.append(StageLoad(fixed, *parts[0]))
            else:
                edges = np.concatenate([p[0] for p in parts])
                uniq, inv = np.unique(edges, return_inverse=True)
                out.append(StageLoad(fixed, uniq,
                                     np.bincount(inv, np.concatenate([p[1] for p in parts]), len(uniq)),
                                     np.bincount(inv, np.concatenate([p[2] for p in parts]), len(uniq))))
        return out

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
        """Seconds ``op`` takes alone on the fabric (and its statistics recorded)."""
        loads = self.stage_loads(op)
        self.record(loads)
        return sum(self.stage_seconds(load) for load in loads)

    # ---- one atom ----------------------------------------------------------------------------
    def _pattern(self, kind: str, members: tuple[int, ...]) -> _Pattern:
        key = (kind, members)
        pat = self._patterns.get(key)
        if pat is None:
            p = len(members)
            if kind in ("all_to_all_v", "p2p"):
                i, j = np.nonzero(~np.eye(p, dtype=bool)) if kind == "all_to_all_v" else (np.array([0]), np.array([1]))
            else:  # ring: member i -> i + 1
                i = np.arange(p)
                j = np.roll(i, -1)
            m = np.asarray(members)
            paths = self.fabric.paths(m[i], m[j])
            uniq, inv = np.unique(paths.edges, return_inverse=True)
            pat = self._patterns[key] = _Pattern(i, j, paths.hops, paths.latency, uniq, inv)
        return pat

    def _atom_load(self, atom: Atom):
        """(fixed latency s, edges, bytes per edge, messages per edge) of one atom; the
        last three None when it moves nothing; None when it costs nothing."""
        model = self.model
        p = len(atom.members)
        if atom.kind == "p2p":
            if atom.members[0] == atom.members[1]:
                return None
        elif atom.kind != "all_to_all_v" and p < 2:
            return None
        ring = atom.kind in ("all_reduce", "all_gather", "reduce_scatter")
        pat = self._pattern("ring" if ring else atom.kind, atom.members)
        if atom.kind == "all_to_all_v":
            nbytes = np.asarray(atom.matrix, dtype=np.float64)[pat.i, pat.j]
            used = nbytes > 0
            if not used.any():
                return model.call_latency, None, None, None  # the call costs its latency, moves nothing
            fixed = model.call_latency + model.software_steps(atom) * model.step_latency + float(pat.latency[used].max())
        elif atom.kind == "p2p":
            nbytes = np.array([float(atom.size)])
            fixed = model.fixed_latency(1, float(pat.latency[0]))
        else:
            per_flow, steps = ring_share(atom.kind, p, atom.size)
            nbytes = np.full(p, float(per_flow))
            fixed = model.fixed_latency(steps, float(pat.latency.max()))
        n = len(pat.edges)
        load = np.bincount(pat.entry_edge, weights=np.repeat(nbytes, pat.hops), minlength=n)
        per_flow_messages = algorithm_messages(atom.kind, p) * (nbytes > 0)
        messages = np.bincount(pat.entry_edge, weights=np.repeat(per_flow_messages, pat.hops), minlength=n)
        return fixed, pat.edges, load, messages
