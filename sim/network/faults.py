"""Faults of a simulated run (``[[faults]]`` in the scenario): what breaks, what it costs.

At the start of its step a fault changes the fabric or stops the job:

- ``link_degraded``: the named links keep ``factor`` of their bandwidth from then on; the
  cost shows in the step times.
- ``link_down``: a GPU's NIC (``gpu:N``) is routed around through a node peer's NIC over
  NVLink (the cost shows in the step times); any other link down (a level, a leaf's
  uplink) cuts ranks off: the job restarts (below) and the link is taken as repaired.
- ``gpu_lost``: the job restarts from its last checkpoint (M23): ``checkpoint.restart_s``
  plus redoing the steps since the latest optimizer checkpoint (the resume point), at
  the mean step time so far.

Each fault is reported with what was done and the seconds of training it cost
(``time_lost_s``; 0 when the cost is in the step times).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from sim.hardware.fabric import Fabric
from testbed.scenario.scenario import Scenario
from testbed.scenario.sections import FaultConfig


@dataclass
class FaultOutcome:
    step: int
    kind: str
    target: str
    action: str  # degraded | rerouted | restart
    time_lost_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def selector(fabric: Fabric, target: str):
    """Fabric edges a fault target names."""
    kind, _, index = target.partition(":")
    if kind == "gpu":
        r = int(index)
        return np.array([fabric.offset["nic_up"] + r, fabric.offset["nic_down"] + r])
    if kind == "leaf":
        m = int(index)
        return np.array([fabric.offset["spine_up"] + m, fabric.offset["spine_down"] + m])
    return {"nic": "leaf"}.get(kind, kind)  # a level: the NIC links are the leaf level


class Faults:
    def __init__(self, scenario: Scenario, fabric: Fabric):
        self.s, self.fabric = scenario, fabric
        self.by_step: dict[int, list[FaultConfig]] = {}
        for f in scenario.faults:
            self.by_step.setdefault(f.at_step, []).append(f)
        self.outcomes: list[FaultOutcome] = []

    def apply(self, step: int, step_times: list[float]) -> list[FaultOutcome]:
        """Apply the faults of ``step``; ``step_times`` are the simulated steps so far."""
        out = []
        for f in self.by_step.get(step, []):
            if f.kind == "link_degraded":
                self.fabric.set_capacity(selector(self.fabric, f.target), f.factor)
                out.append(FaultOutcome(step, f.kind, f.target, "degraded", 0.0))
            elif f.kind == "link_down" and f.target.startswith("gpu:"):
                self.fabric.set_capacity(selector(self.fabric, f.target), 0.0)
                self.fabric.reroute_nic(int(f.target.split(":")[1]))
                out.append(FaultOutcome(step, f.kind, f.target, "rerouted", 0.0))
            else:  # a lost GPU, or a cut the fabric cannot route around: restart
                out.append(FaultOutcome(step, f.kind, f.target, "restart", self.restart_cost(step, step_times)))
        self.outcomes += out
        return out

    def restart_cost(self, step: int, step_times: list[float]) -> float:
        """restart_s + the steps since the resume point (latest optimizer checkpoint, M23)."""
        interval = self.s.checkpoint.optimizer_interval
        resume = (step // interval) * interval
        mean = float(np.mean(step_times)) if step_times else 0.0
        return self.s.checkpoint.restart_s + (step - resume) * mean
