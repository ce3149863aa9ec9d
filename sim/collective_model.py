"""Timing of collective ops on the network, by the algorithm the machine profile names.

``flows_for(op)`` is the one decomposition of an op into flows (used in both network
modes): ``(src, dst, nbytes, fixed_latency_s)``. The op waits ``fixed_latency_s`` (the
profile's per-call ``latency_us`` plus the algorithm's hop latencies), then its flows
start together without their own path latency; the op ends when the last one arrives.
With p members and the per-member ``size`` of ``CollectiveOp``:

- ring all_reduce: p flows member i -> i+1 of 2(p-1)/p * size each (a pipelined ring:
  reduce-scatter then all-gather), latency 2(p-1) x the slowest hop's path latency;
- ring all_gather: p flows of (p-1) * size, latency (p-1) hops;
- ring reduce_scatter: p flows of (p-1)/p * size, latency (p-1) hops; with algorithm
  ``all_reduce`` (gloo) the all-reduce of the full input instead;
- direct all_to_all_v: one flow per non-zero off-diagonal matrix entry, latency the
  largest path latency among them;
- p2p: one flow, its path latency.

On one link class of bandwidth B this gives the nccl-tests closed forms: all-reduce
time = 2(p-1)/p * S / B (bus bandwidth = algbw * 2(p-1)/p = B), all-gather and
reduce-scatter busbw = algbw * (p-1)/p = B. ``op.wire_bytes`` (what both backends
report) stays the standard algorithm's; ``wire_bytes_on_fabric(op)`` is what this
profile's algorithm really puts on the wire.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import simpy

from sim.network import Network
from testbed.collectives import CollectiveOp
from testbed.profile import MachineProfile


class Flows(NamedTuple):
    """Flows of one op: rank arrays, bytes per flow, and the latency before they start (s)."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    fixed_latency_s: float


class CollectiveModel:
    """Times ``CollectiveOp``s on a ``Network`` with a profile's algorithms and latencies."""

    def __init__(self, network: Network, profile: MachineProfile):
        self.network = network
        self.env = network.env
        self.fabric = network.fabric
        self.profile = profile
        self.call_latency = profile.collectives.latency_us * 1e-6  # s

    def algorithm(self, kind: str) -> str:
        """Algorithm of ``kind`` in the profile (p2p: direct)."""
        return "direct" if kind == "p2p" else getattr(self.profile.collectives.algorithm, kind)

    def flows_for(self, op: CollectiveOp) -> Flows:
        """The flows and fixed latency of ``op`` (module doc). Single-member ops: none."""
        m = np.asarray(op.members, dtype=np.int64)
        p = len(m)
        empty = Flows(m[:0], m[:0], np.zeros(0), 0.0)
        if op.kind == "all_to_all_v":
            mat = np.asarray(op.matrix, dtype=np.float64)
            i, j = np.nonzero(mat)
            keep = i != j
            src, dst, nbytes = m[i[keep]], m[j[keep]], mat[i[keep], j[keep]]
            if len(src) == 0:
                return empty if p < 2 else Flows(src, dst, nbytes, self.call_latency)
            lat = float(self.fabric.paths(src, dst).latency.max())
            return Flows(src, dst, nbytes, self.call_latency + lat)
        if op.kind == "p2p":
            if m[0] == m[1]:
                return empty
            lat = float(self.fabric.paths(m[:1], m[1:2]).latency[0])
            return Flows(m[:1], m[1:2], np.array([float(op.size)]), self.call_latency + lat)
        if p < 2:
            return empty
        kind = "all_reduce" if op.kind == "reduce_scatter" and self.algorithm(op.kind) == "all_reduce" else op.kind
        per_flow, steps = {  # bytes per ring flow, sequential hops of the ring algorithm
            "all_reduce": (2 * (p - 1) / p * op.size, 2 * (p - 1)),
            "all_gather": ((p - 1) * op.size, p - 1),
            "reduce_scatter": ((p - 1) / p * op.size, p - 1),
        }[kind]
        src, dst = m, np.roll(m, -1)
        hop = float(self.fabric.paths(src, dst).latency.max())  # the ring runs at its slowest hop
        return Flows(src, dst, np.full(p, float(per_flow)), self.call_latency + steps * hop)

    def wire_bytes_on_fabric(self, op: CollectiveOp) -> int:
        """Bytes this profile's algorithm sends between ranks (>= ``op.wire_bytes``)."""
        return int(round(float(self.flows_for(op).nbytes.sum())))

    def run(self, op: CollectiveOp) -> simpy.Process:
        """A process that takes the op's simulated time; ``yield model.run(op)``."""
        return self.env.process(self._run(op))

    def _run(self, op: CollectiveOp):
        flows = self.flows_for(op)
        if flows.fixed_latency_s > 0:
            yield self.env.timeout(flows.fixed_latency_s)
        yield self.network.start_flows(flows.src, flows.dst, flows.nbytes, tag=op.stage,
                                       path_latency=False)


class _Pattern(NamedTuple):
    """Cached routes of an op shape: flows between member indices and their paths."""

    i: np.ndarray  # member index of each flow's source
    j: np.ndarray  # member index of each flow's destination
    hops: np.ndarray  # edges per flow
    edges: np.ndarray  # concatenated edge indices of the flows
    latency: np.ndarray  # path latency per flow (s)


class AnalyticTimer:
    """The analytic (bottleneck-link) time of ops, with routes cached per member set.

    Gives the same time as ``Network`` in analytic mode for the flows of ``flows_for``,
    without creating simpy events, so millions of ops stay cheap. Adds each op's bytes
    and busy seconds to the network's per-edge statistics.
    """

    def __init__(self, model: CollectiveModel):
        self.model = model
        self.fabric = model.fabric
        self.stats = model.network
        self._patterns: dict[tuple, _Pattern] = {}

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
            pat = self._patterns[key] = _Pattern(i, j, paths.hops, paths.edges, paths.latency)
        return pat

    def seconds(self, op: CollectiveOp) -> float:
        """Seconds ``op`` takes alone on the fabric (fixed latency + bottleneck link)."""
        model = self.model
        p = len(op.members)
        if op.kind == "p2p" and op.members[0] == op.members[1]:
            return 0.0
        if op.kind not in ("all_to_all_v", "p2p") and p < 2:
            return 0.0
        kind = op.kind
        if kind == "reduce_scatter" and model.algorithm(kind) == "all_reduce":
            kind = "all_reduce"
        pat = self._pattern("ring" if kind in ("all_reduce", "all_gather", "reduce_scatter") else kind, op.members)
        if kind == "all_to_all_v":
            nbytes = np.asarray(op.matrix, dtype=np.float64)[pat.i, pat.j]
            used = nbytes > 0
            if not used.any():
                return model.call_latency
            fixed = model.call_latency + float(pat.latency[used].max())
        elif kind == "p2p":
            nbytes = np.array([float(op.size)])
            fixed = model.call_latency + float(pat.latency[0])
        else:
            per_flow, steps = {"all_reduce": (2 * (p - 1) / p * op.size, 2 * (p - 1)),
                               "all_gather": ((p - 1) * op.size, p - 1),
                               "reduce_scatter": ((p - 1) / p * op.size, p - 1)}[kind]
            nbytes = np.full(p, float(per_flow))
            fixed = model.call_latency + steps * float(pat.latency.max())
        load = np.bincount(pat.edges, weights=np.repeat(nbytes, pat.hops), minlength=self.fabric.num_edges)
        busy = load / self.fabric.capacity.clip(min=1e-300)
        self.stats.bytes_by_edge += load
        self.stats.busy_by_edge += busy
        return fixed + float(busy.max())
