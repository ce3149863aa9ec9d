"""Runs every rank's program of a step as simpy processes over the network model.

A collective starts when the last of its members reaches it and ends for all members
together (the slowest rank sets the pace, as on real hardware); ops of one batch run
concurrently. Page copies are flows on the rank's PCIe link plus a fixed latency per
page. Each rank records the seconds it spends in every stage and the regions for the
Chrome trace. Deterministic: simpy orders simultaneous events by insertion, and
programs are built in rank order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import simpy

from sim.collective_model import CollectiveModel
from sim.fabric import build_fabric
from sim.network import Network
from testbed.profile import MachineProfile
from testbed.scenario import Scenario


@dataclass
class RankTiming:
    """Seconds per stage and (stage, kind, start_s, end_s) regions of one rank in one step."""

    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    regions: list[tuple[str, str, float, float]] = field(default_factory=list)
    end: float = 0.0


def network_mode(scenario: Scenario) -> str:
    mode = scenario.sim.network_model
    if mode == "auto":
        return "flow" if scenario.world_size <= scenario.sim.flow_max_gpus else "analytic"
    return mode


class Engine:
    def __init__(self, scenario: Scenario, profile: MachineProfile):
        self.env = simpy.Environment()
        self.fabric = build_fabric(scenario, profile)
        self.mode = network_mode(scenario)
        self.network = Network(self.env, self.fabric, self.mode)
        self.collectives = CollectiveModel(self.network, profile)
        self.copy_latency = profile.copy.latency_us * 1e-6
        self._pending: dict[int, list] = {}
        self.events = 0

    def run_step(self, programs: list[list[tuple]]) -> tuple[float, list[RankTiming]]:
        """Run one step's programs from now; returns (start time, per-rank timing)."""
        start = self.env.now
        timings = [RankTiming() for _ in programs]
        procs = [self.env.process(self._rank(r, prog, timings[r])) for r, prog in enumerate(programs)]
        self.env.run(until=simpy.AllOf(self.env, procs))
        if self._pending:  # every op must have been reached by all its members
            raise RuntimeError(f"{len(self._pending)} collectives never started: programs disagree")
        return start, timings

    def _collective(self, op) -> simpy.Event:
        entry = self._pending.get(id(op))
        if entry is None:
            entry = self._pending[id(op)] = [0, self.env.event()]
        entry[0] += 1
        if entry[0] == len(op.members):
            del self._pending[id(op)]
            done = entry[1]
            self.collectives.run(op).callbacks.append(lambda _event: done.succeed())
        return entry[1]

    def _copy(self, rank: int, copy) -> simpy.Event:
        events = []
        if copy.h2d_bytes:
            events.append(self.network.start_flows([rank], [rank], [copy.h2d_bytes], tag="paging", kind="h2d"))
        if copy.d2h_bytes:
            events.append(self.network.start_flows([rank], [rank], [copy.d2h_bytes], tag="paging", kind="d2h"))
        events.append(self.env.timeout(copy.pages * self.copy_latency))
        return simpy.AllOf(self.env, events)

    def _rank(self, rank: int, program: list[tuple], timing: RankTiming):
        env = self.env
        for stage, kind, payload in program:
            t0 = env.now
            if kind in ("compute", "wait"):
                if payload > 0:
                    yield env.timeout(payload)
            elif kind == "ops":
                if payload:
                    yield simpy.AllOf(env, [self._collective(op) for op in payload])
            elif kind == "copy":
                if payload:
                    yield self._copy(rank, payload)
            else:
                raise ValueError(f"unknown segment kind {kind!r}")
            self.events += 1
            if env.now > t0:
                timing.totals[stage] += env.now - t0
                timing.regions.append((stage, kind, t0, env.now))
        timing.end = env.now
