"""The backend interface and the registry that finds a backend by name.

``testbed`` never imports a backend at module level (DESIGN: sim -> testbed <- real);
``get_backend("sim")`` imports ``sim.backend`` when it is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from testbed.errors import ScenarioError
from testbed.results import StepRecord
from testbed.routing_trace import RoutingTrace
from testbed.scenario import Scenario

BACKENDS = {"sim": "sim.backend:SimBackend", "real": "real.backend:RealBackend"}


@dataclass
class RunResult:
    """What a backend returns: step records, trace events, routing trace, extra summary fields."""

    scenario: Scenario
    records: list[StepRecord]
    trace_events: list[dict] = field(default_factory=list)
    routing: RoutingTrace | None = None
    extra: dict = field(default_factory=dict)  # backend-specific summary fields
    summary: dict = field(default_factory=dict)  # filled in by testbed.runner
    run_dir: Path | None = None
    captured: list | None = None  # real backend, tests only: per-rank tensors of step 0


class Backend(Protocol):
    name: str

    def run(self, scenario: Scenario, *, progress: bool = False,
            on_step: Callable[[StepRecord], None] | None = None) -> RunResult:
        """Run every step of ``scenario``; call ``on_step`` as each step completes."""


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ScenarioError("--backend", name, "expected one of " + ", ".join(BACKENDS))
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
