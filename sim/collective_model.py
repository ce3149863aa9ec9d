"""Timing of collective ops on the network, by the algorithm the machine profile names.

``flows_for(op)`` is the one decomposition of an op into flows (used in both network
modes): ``(src, dst, nbytes, fixed_latency_s)``. The op waits ``fixed_latency_s``, then
its flows start together without their own path latency; the op ends when the last one
arrives. The fixed latency is the library's software cost, per call plus per sequential
step of the algorithm (``SoftwareLatency``), and the path latency of each step. With p
members and the per-member ``size`` of ``CollectiveOp``:

- ring all_reduce: p flows member i -> i+1 of 2(p-1)/p * size each (a pipelined ring:
  reduce-scatter then all-gather), 2(p-1) steps, each at the slowest hop's latency;
- ring all_gather: p flows of (p-1) * size, (p-1) steps;
- ring reduce_scatter: p flows of (p-1)/p * size, (p-1) steps; with algorithm
  ``all_reduce`` (gloo) the all-reduce of the full input instead;
- direct all_to_all_v: one flow per non-zero off-diagonal matrix entry, all at once
  (every send and receive is posted, then all are waited for): p-1 software steps (one
  message posted to each other member) and the largest path latency among them;
- p2p: one flow, one step at its path latency.

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

from sim.fabric import build_fabric
from sim.network import Network
from testbed.collectives import CollectiveOp, algorithm_messages, algorithm_steps
from testbed.profile import MachineProfile

from sim.software_latency import SoftwareLatency


class Flows(NamedTuple):
    """Flows of one op: rank arrays, bytes per flow, the latency before they start (s), and
    the library messages each flow carries."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    fixed_latency_s: float
    messages: int = 1


class Atom(NamedTuple):
    """One ring / direct collective inside an op's algorithm (bytes as in CollectiveOp)."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all_v | p2p (ring or direct)
    members: tuple[int, ...]
    size: float
    matrix: np.ndarray | None = None


class CollectiveModel:
    """Times ``CollectiveOp``s on a ``Network`` with a profile's algorithms and latencies.

    ``stages(op)``: the op as sequential stages of concurrent ring or direct *atoms*.
    Ring and direct algorithms are one stage of one atom; ``hierarchical`` algorithms
    (members on several nodes, the same number on each) are, with g members per node:
    all-reduce = reduce-scatter in each node (S), all-reduce across nodes among members
    of the same position (S/g), all-gather in each node (S/g each); all-gather = across
    nodes (n), then in each node (n x nodes); reduce-scatter = in each node (S), then
    across nodes (S/g). Elsewhere they fall back to the ring.
    """

    def __init__(self, network: Network, profile: MachineProfile, world: int | None = None):
        self.network = network
        self.env = network.env
        self.fabric = network.fabric
        self.profile = profile
        self.software = SoftwareLatency(profile, world or network.fabric.world)
        self.call_latency = self.software.call_s  # s
        self.step_latency = self.software.step_s  # s

    def algorithm(self, kind: str) -> str:
        """Algorithm of ``kind`` in the profile (p2p: direct)."""
        return "direct" if kind == "p2p" else getattr(self.profile.collectives.algorithm, kind)

    def flows_for(self, op: CollectiveOp) -> Flows:
        """The flows of a single-stage op (ring or direct; module doc). Single-member ops: none."""
        stages = self.stages(op)
        if len(stages) != 1 or len(stages[0]) != 1:
            raise ValueError("flows_for: a hierarchical op has several stages; use stages()")
        return self.atom_flows(stages[0][0])

    def wire_bytes_on_fabric(self, op: CollectiveOp) -> int:
        """Bytes this profile's algorithm sends between ranks (>= ``op.wire_bytes`` for ring)."""
        return int(round(sum(float(self.atom_flows(a).nbytes.sum()) for st in self.stages(op) for a in st)))

    def stages(self, op: CollectiveOp) -> list[list[Atom]]:
        """The op's algorithm as sequential stages of concurrent atoms (class doc)."""
        kind = op.kind
        if kind == "reduce_scatter" and self.algorithm(kind) == "all_reduce":
            kind = "all_reduce"  # gloo: the full tensor is all-reduced
        if kind in ("all_reduce", "all_gather", "reduce_scatter") and self.algorithm(op.kind) == "hierarchical":
            grid = self._node_grid(op.members)
            if grid is not None:
                return self._hierarchical(kind, grid, op.size)
        return [[Atom(kind, op.members, op.size, op.matrix)]]

    def _node_grid(self, members) -> np.ndarray | None:
        """Members as (nodes x per node), or None when the algorithm has no two levels."""
        m = np.asarray(members)
        node = m // self.fabric.gpus_per_node
        nodes, counts = np.unique(node, return_counts=True)
        if len(nodes) < 2 or counts[0] < 2 or (counts != counts[0]).any():
            return None
        return m[np.lexsort((m, node))].reshape(len(nodes), counts[0])

    @staticmethod
    def _hierarchical(kind: str, grid: np.ndarray, size: float) -> list[list[Atom]]:
        a, g = grid.shape
        rows = [tuple(int(x) for x in grid[i]) for i in range(a)]
        cols = [tuple(int(x) for x in grid[:, j]) for j in range(g)]
        if kind == "all_reduce":
            return [[Atom("reduce_scatter", r, size) for r in rows],
                    [Atom("all_reduce", c, size / g) for c in cols],
                    [Atom("all_gather", r, size / g) for r in rows]]
        if kind == "all_gather":
            return [[Atom("all_gather", c, size) for c in cols], [Atom("all_gather", r, size * a) for r in rows]]
        return [[Atom("reduce_scatter", r, size) for r in rows], [Atom("reduce_scatter", c, size / g) for c in cols]]

    def atom_flows(self, atom: Atom) -> Flows:
        """Flows of one ring or direct atom (the decomposition of the module doc)."""
        m = np.asarray(atom.members, dtype=np.int64)
        p = len(m)
        empty = Flows(m[:0], m[:0], np.zeros(0), 0.0)
        if atom.kind == "all_to_all_v":
            mat = np.asarray(atom.matrix, dtype=np.float64)
            i, j = np.nonzero(mat)
            keep = i != j
            src, dst, nbytes = m[i[keep]], m[j[keep]], mat[i[keep], j[keep]]
            if len(src) == 0:
                return empty if p < 2 else Flows(src, dst, nbytes, self.call_latency)
            hop = float(self.fabric.paths(src, dst).latency.max())  # all messages in flight at once
            return Flows(src, dst, nbytes, self.call_latency + self.software_steps(atom) * self.step_latency + hop)
        if atom.kind == "p2p":
            if m[0] == m[1]:
                return empty
            lat = float(self.fabric.paths(m[:1], m[1:2]).latency[0])
            return Flows(m[:1], m[1:2], np.array([float(atom.size)]), self.fixed_latency(1, lat))
        if p < 2:
            return empty
        per_flow, steps = ring_share(atom.kind, p, atom.size)
        src, dst = m, np.roll(m, -1)
        hop = float(self.fabric.paths(src, dst).latency.max())  # the ring runs at its slowest hop
        return Flows(src, dst, np.full(p, float(per_flow)), self.fixed_latency(steps, hop),
                     algorithm_messages(atom.kind, p))

    def fixed_latency(self, steps: int, hop_s: float) -> float:
        """Seconds before an atom's bytes flow: one call, and ``steps`` sequential steps
        each paying the library's step cost and the path latency ``hop_s``."""
        return self.call_latency + steps * (self.step_latency + hop_s)

    def fitted_seconds(self, op: CollectiveOp) -> float:
        """Seconds of ``op``'s time that come from fitted constants (the software latency of
        a calibrated profile; 0 otherwise): per stage, the call and step costs of its
        atoms."""
        if not self.software.fitted:
            return 0.0
        total = 0.0
        for stage in self.stages(op):
            total += max((self.software_steps(a) for a in stage), default=0) * self.step_latency + self.call_latency
        return total

    @staticmethod
    def software_steps(atom: Atom) -> int:
        """Sequential steps of an atom's algorithm (``testbed.collectives.algorithm_steps``)."""
        return algorithm_steps(atom.kind, len(atom.members))

    def run(self, op: CollectiveOp) -> simpy.Process:
        """A process that takes the op's simulated time; ``yield model.run(op)``."""
        return self.env.process(self._run(op))

    def _run(self, op: CollectiveOp):
        for stage in self.stages(op):
            flows = [self.atom_flows(a) for a in stage]
            latency = max((f.fixed_latency_s for f in flows), default=0.0)
            if latency > 0:
                yield self.env.timeout(latency)
            yield simpy.AllOf(self.env, [self.network.start_flows(f.src, f.dst, f.nbytes, tag=op.stage,
                                                                  path_latency=False, messages=f.messages)
                                         for f in flows])


def ring_share(kind: str, p: int, size: float) -> tuple[float, int]:
    """(bytes per ring flow, sequential hops) of a ring all-reduce / all-gather / reduce-scatter."""
    return {"all_reduce": (2 * (p - 1) / p * size, 2 * (p - 1)),
            "all_gather": ((p - 1) * size, p - 1),
            "reduce_scatter": ((p - 1) / p * size, p - 1)}[kind]


def seconds_alone(scenario, profile: MachineProfile, op: CollectiveOp) -> tuple[float, dict[str, int]]:
    """(seconds, wire bytes by level) of ``op`` alone on ``scenario``'s fabric, by the flow
    model with ``profile``'s algorithms: what ``testbed net probe`` sets against gloo."""
    env = simpy.Environment()
    network = Network(env, build_fabric(scenario, profile), "flow", coalesce=0.0)
    model = CollectiveModel(network, profile, scenario.world_size)
    env.run(model.run(op))
    return env.now, network.wire_bytes_by_level(network.bytes_by_edge, profile.protocol, network.messages_by_edge)
