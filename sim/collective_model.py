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
