"""The backend interface and the registry that finds a backend, or a backend's tool, by name.

``testbed`` never imports a backend at module level (DESIGN: sim -> testbed <- real);
``get_backend("sim")`` imports ``sim.backend`` when it is asked for, and ``get_tool``
does the same for the commands a backend provides (calibration, the emulated network).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from testbed.core.errors import ScenarioError
from testbed.run.results import StepRecord
from testbed.run.routing_trace import RoutingTrace
from testbed.scenario.scenario import Scenario

BACKENDS = {"sim": "sim.backend:SimBackend", "real": "real.backend:RealBackend"}
#: commands of the backends, looked up by name like the backends themselves
TOOLS = {
    "calibrate": "real.calibrate.tool:calibrate",  # measure this machine, write a profile
    "net-check": "real.netem:check_privileges",  # ScenarioError unless this process may emulate
    "net-leftovers": "real.netem:leftovers",  # emulated clusters on this machine
    "net-clean": "real.netem:clean",  # remove what killed emulated runs left behind
    "net-probe": "real.netem.probe:probe",  # measure the emulated links and gloo's algorithms
    "sim-collective-seconds": "sim.network.collective_model:seconds_alone",  # an op timed alone, by algorithm
    "sim-collective-alone": "sim.network.collective_model:alone",  # ... with the algorithm it ran
    "real-collective-table": "real.calibrate.bench:collective_table",  # nccl-tests-style timings on real ranks
}


@dataclass
class RunResult:
    """What a backend returns: step records, trace events, routing trace, extra summary fields."""

    scenario: Scenario
    records: list[StepRecord]
    trace_events: list[dict] = field(default_factory=list)
    routing: RoutingTrace | None = None
    extra: dict = field(default_factory=dict)  # backend-specific summary fields
    summary: dict = field(default_factory=dict)  # filled in by testbed.run.runner
    run_dir: Path | None = None
    captured: list | None = None  # real backend, tests only: per-rank tensors of step 0


class Backend(Protocol):
    name: str

    def run(self, scenario: Scenario, *, progress: bool = False,
            on_step: Callable[[StepRecord], None] | None = None) -> RunResult:
        """Run every step of ``scenario``; call ``on_step`` as each step completes."""


def get_tool(name: str):
    """The function a backend provides under ``name`` (see ``TOOLS``), imported now."""
    module, attr = TOOLS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ScenarioError("--backend", name, "expected one of " + ", ".join(BACKENDS))
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
