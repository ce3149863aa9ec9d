"""Timing of collective ops on the network, by the algorithms the machine profile names (M21).

``CollectiveModel`` picks each op's algorithm and runs its sequential *stages* of concurrent
*atoms* (``stages(op)``; each atom a set of flows, ``atom_flows``: the decompositions of
``sim.network.collective_algorithms``) on a ``Network``: a stage waits its atoms' largest
fixed latency (s), then its flows start together without their own path latency; it ends
when the last one arrives.

``auto`` (the profile's algorithm) picks per op the candidate with the least predicted
time alone on the fabric: fixed latency + the busiest link's bytes / its nominal
bandwidth, summed over stages (``predicted``), linear in the op's size and so cached per
(kind, members) as NCCL's tuner caches its per-algorithm alpha and beta.

The bytes both backends report are those of the algorithm the library runs as
``testbed.policy.collectives`` counts them (gloo's reduce-scatter as its all-reduce);
``wire_bytes_on_fabric(op)`` is what this profile's algorithm sends on the fabric (NCCL's
trees, NVLS, hierarchical variants). ``alone``: one op alone on a scenario's fabric
(seconds, wire bytes per level, the algorithm it ran).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import simpy

from sim.hardware.fabric import build_fabric
from sim.hardware.software_latency import SoftwareLatency
from sim.network.collective_algorithms import (
    NVLS_KINDS,
    RING_KINDS,
    Atom,
    CollectiveAlgorithms,
    Flows,
    UnitLoad,
    _Template,
)
from sim.network.network import Network
from testbed.policy.collectives import CollectiveOp, algorithm_steps
from testbed.scenario.profile import MachineProfile


class CollectiveModel(CollectiveAlgorithms):
    """Times ``CollectiveOp``s on a ``Network`` with a profile's algorithms and latencies
    (module doc; the algorithms' decompositions: ``sim.network.collective_algorithms``).
    Routes and per-algorithm predictions are cached per member set until the fabric's
    routes change (``Fabric.routing_version``)."""

    def __init__(self, network: Network, profile: MachineProfile, world: int | None = None):
        self.network = network
        self.env = network.env
        self.fabric = network.fabric
        self.profile = profile
        self.software = SoftwareLatency(profile, world or network.fabric.world)
        self.call_latency = self.software.call_s  # s
        self.step_latency = self.software.step_s  # s
        c = profile.collectives
        self.channels = int(c.channels) or self.fabric.gpus_per_node
        self.peer_latency = c.all_to_all_peer_us * 1e-6  # s per peer message of an all-to-all
        self.pxn, self.nvls, self.collnet = c.pxn, c.nvls, c.collnet
        f = self.fabric
        sent = np.zeros(f.num_edges, dtype=bool)  # edges leaving a GPU (bytes a rank sends)
        for block in ("nvlink_up", "nic_up"):
            sent[f.offset[block]:f.offset[block] + f.world] = True
        self._sent_edge = sent
        self._cache: dict = {}
        self._version = f.routing_version

    # ---- algorithms ------------------------------------------------------------------------
    def algorithm(self, kind: str) -> str:
        """Algorithm of ``kind`` in the profile (p2p: direct); may be ``auto``."""
        return "direct" if kind == "p2p" else getattr(self.profile.collectives.algorithm, kind)

    def candidates(self, kind: str) -> tuple[str, ...]:
        """What ``auto`` chooses from for ``kind``: ring, tree (all_reduce), and nvls /
        collnet (all_reduce) where the profile has the capability."""
        out = ["ring"]
        if kind == "all_reduce":
            out.append("tree")
        if self.nvls:
            out.append("nvls")
        if self.collnet and kind == "all_reduce":
            out.append("collnet")
        return tuple(out)

    def algorithm_for(self, op: CollectiveOp) -> str:
        """The algorithm ``op`` runs: the profile's, or with ``auto`` the candidate with
        the least predicted time alone on the fabric (ties: the first candidate)."""
        alg = self.algorithm(op.kind)
        if alg != "auto":
            return alg
        if len(op.members) < 2:
            return "ring"
        cache = self._routes()
        key = ("auto", op.kind, op.members)
        fits = cache.get(key)
        if fits is None:
            fits = cache[key] = [(a, *self.predicted(op.kind, a, op.members)) for a in self.candidates(op.kind)]
        size = float(op.size)
        return min(fits, key=lambda f: f[1] + f[2] * size)[0]

    def predicted(self, kind: str, algorithm: str, members: tuple[int, ...]) -> tuple[float, float]:
        """(seconds, seconds per byte of size) of ``algorithm`` alone on the fabric at its
        nominal bandwidths: per stage its fixed latency plus its busiest link's bytes /
        bandwidth (NCCL's tuner's alpha and beta)."""
        alpha = beta = 0.0
        nominal = self.fabric.nominal.clip(min=1e-300)
        for stage in self.stages_of(kind, algorithm, members, 1.0):
            fixed, edges, load = 0.0, [], []
            for atom in stage:
                u = self.unit_load(atom)
                if u is None:
                    continue
                fixed = max(fixed, u.fixed_s if atom.fixed_s is None else atom.fixed_s)
                edges.append(u.edges)
                load.append(u.per_byte * atom.size)
            alpha += fixed
            if edges:
                e = np.concatenate(edges)
                per_edge = np.bincount(e, np.concatenate(load), self.fabric.num_edges)
                beta += float((per_edge / nominal).max())
        return alpha, beta

    # ---- stages --------------------------------------------------------------------------
    def flows_for(self, op: CollectiveOp) -> Flows:
        """The flows of a single-stage, single-atom op (ring or direct;
        ``sim.network.collective_algorithms``).
        Single-member ops: none."""
        stages = self.stages(op)
        if len(stages) != 1 or len(stages[0]) != 1:
            raise ValueError("flows_for: this op has several stages or atoms; use stages()")
        return self.atom_flows(stages[0][0])

    def wire_bytes_on_fabric(self, op: CollectiveOp) -> int:
        """Bytes this profile's algorithm sends from ranks: rank-to-rank flows once each,
        switch traffic on the links leaving a GPU (``op.wire_bytes`` for ring and direct)."""
        total = 0.0
        for stage in self.stages(op):
            for a in stage:
                f = self.atom_flows(a)
                total += float(f.nbytes[self._sent_edge[f.src]].sum() if f.kind == "edge" else f.nbytes.sum())
        return round(total)

    def stages(self, op: CollectiveOp) -> list[list[Atom]]:
        """The op's algorithm as sequential stages of concurrent atoms
        (``sim.network.collective_algorithms``)."""
        if op.kind in ("all_to_all_v", "p2p"):
            return [[Atom(op.kind, op.members, op.size, op.matrix)]]
        return self.stages_of(op.kind, self.algorithm_for(op), op.members, op.size)

    # ---- atoms -----------------------------------------------------------------------------
    def atom_flows(self, atom: Atom) -> Flows:
        """Flows of one atom (the decomposition of ``sim.network.collective_algorithms``)."""
        if atom.kind == "all_to_all_v":
            flows = self._all_to_all(atom)
        else:
            t = self._template(atom.kind, atom.members)
            flows = t.flows._replace(nbytes=t.flows.nbytes * float(atom.size))
        if atom.fixed_s is not None:
            flows = flows._replace(fixed_latency_s=atom.fixed_s)
        return flows


    def _routes(self) -> dict:
        """The route cache, emptied when the fabric's routes changed."""
        if self.fabric.routing_version != self._version:
            self._cache.clear()
            self._version = self.fabric.routing_version
        return self._cache

    def _template(self, kind: str, members: tuple[int, ...]) -> _Template:
        """The atom's flows at size 1, cached per (kind, members): every kind but
        all_to_all_v moves bytes proportional to its size."""
        cache = self._routes()
        key = ("flows", kind, members)
        t = cache.get(key)
        if t is None:
            m = np.asarray(members, dtype=np.int64)
            if kind in RING_KINDS:
                t = self._ring(kind, m)
            elif kind == "p2p":
                t = self._p2p(m)
            elif kind == "tree":
                t = self._tree(m)
            elif kind in NVLS_KINDS:
                t = self._switch_nvls(kind, m)
            elif kind == "collnet":
                t = self._switch_collnet(m)
            else:
                raise ValueError(f"unknown atom kind {kind!r}")
            cache[key] = t
        return t

    def unit_load(self, atom: Atom) -> UnitLoad | None:
        """The atom at size 1 on the fabric (``UnitLoad``), cached per (kind, members);
        None when it costs nothing (fewer than two members, a p2p to itself). Not for
        all_to_all_v, whose bytes are a matrix."""
        cache = self._routes()
        key = ("load", atom.kind, atom.members)
        if key in cache:
            return cache[key]
        t = self._template(atom.kind, atom.members)
        f = t.flows
        if len(f.src) == 0:
            cache[key] = None
            return None
        paths = t.paths
        if paths is None:
            paths = self.fabric.paths(f.src, f.dst, f.kind, nic_of_src=f.nic_of_src) if f.kind == "fabric" \
                else self.fabric.paths(f.src, f.dst, f.kind)
        edges, inv = np.unique(paths.edges, return_inverse=True)
        per_byte = np.bincount(inv, np.repeat(f.nbytes, paths.hops), len(edges))
        messages = np.bincount(inv, np.repeat(np.full(len(f.src), float(f.messages)), paths.hops), len(edges)) \
            if f.kind == "fabric" else np.zeros(len(edges))
        u = cache[key] = UnitLoad(f.fixed_latency_s, edges, per_byte, messages, t.steps)
        return u

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

    def software_steps(self, atom: Atom) -> int:
        """Sequential steps of an atom's algorithm: ring, direct and p2p as
        ``testbed.policy.collectives.algorithm_steps`` counts them; tree 2 (chain + depth); NVLS
        and collnet 1 or 2; a pipelined stage's parts as set on the atom."""
        if atom.steps is not None:
            return atom.steps
        if atom.kind in RING_KINDS or atom.kind in ("all_to_all_v", "p2p"):
            return algorithm_steps(atom.kind, len(atom.members))
        return self._template(atom.kind, atom.members).steps

    # ---- running -----------------------------------------------------------------------------
    def run(self, op: CollectiveOp) -> simpy.Process:
        """A process that takes the op's simulated time; ``yield model.run(op)``."""
        return self.env.process(self._run(op))

    def _run(self, op: CollectiveOp):
        for stage in self.stages(op):
            flows = [self.atom_flows(a) for a in stage]
            latency = max((f.fixed_latency_s for f in flows), default=0.0)
            if latency > 0:
                yield self.env.timeout(latency)
            yield simpy.AllOf(self.env, [self.network.start_flows(f.src, f.dst, f.nbytes, tag=op.stage, kind=f.kind,
                                                                  path_latency=False, messages=f.messages,
                                                                  nic_of_src=f.nic_of_src)
                                         for f in flows])


class Alone(NamedTuple):
    """One op alone on a fabric: seconds, wire bytes per level, and the algorithm it ran."""

    seconds: float
    wire_bytes_by_level: dict[str, int]
    algorithm: str


def alone(scenario, profile: MachineProfile, op: CollectiveOp) -> Alone:
    """``op`` alone on ``scenario``'s fabric, by the flow model with ``profile``'s
    algorithms (exact for one op): what ``testbed net probe`` sets against gloo and
    ``testbed collective`` prints. A hierarchical algorithm the members cannot run (one
    node) is named as the ring it falls back to."""
    env = simpy.Environment()
    network = Network(env, build_fabric(scenario, profile), "flow", coalesce=0.0)
    model = CollectiveModel(network, profile, scenario.world_size)
    algorithm = model.algorithm_for(op)
    if algorithm == "hierarchical" and len(model.stages(op)) == 1:
        algorithm = "ring"
    env.run(model.run(op))
    wire = network.wire_bytes_by_level(network.bytes_by_edge, profile.protocol, network.messages_by_edge)
    return Alone(env.now, wire, algorithm)


def seconds_alone(scenario, profile: MachineProfile, op: CollectiveOp) -> tuple[float, dict[str, int]]:
    """(seconds, wire bytes by level) of ``op`` alone (``alone``)."""
    got = alone(scenario, profile, op)
    return got.seconds, got.wire_bytes_by_level
