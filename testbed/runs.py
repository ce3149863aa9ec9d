"""Run folders: ``<output_dir>/<backend>-<scenario hash>/`` and an index of runs.

A run folder holds ``scenario.toml`` (the resolved scenario), ``steps.jsonl`` (one
StepRecord per line, written as each step completes, so a stopped run keeps its steps),
``summary.json`` (``"complete": false`` when the run was stopped), ``trace.json``
(Chrome / Perfetto trace) and ``routing.npz`` (the routing trace). Every finished run
appends one line to ``<output_dir>/index.jsonl``; sweeps use ``find_complete`` to skip
runs they already have.

A run resumed from its checkpoints (``--resume RUN_DIR``, real backend) is written into
the same folder: ``steps.jsonl`` keeps the steps before the resume point and continues.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import tomli_w
import tomllib

from testbed.errors import ScenarioError
from testbed.results import StepRecord
from testbed.routing_trace import RoutingTrace
from testbed.scenario import Scenario

INDEX = "index.jsonl"
#: fields a resumed run may change: how long it runs and how the real backend runs it
RESUMABLE_CHANGES = ("run.steps", "run.warmup_steps", "run.output_dir", "real.")


def scenario_hash(scenario: Scenario) -> str:
    """12 hex digits identifying what a run computes (output folder left out)."""
    data = scenario.to_dict()
    data["run"] = {k: v for k, v in data["run"].items() if k != "output_dir"}
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def run_dir_for(scenario: Scenario, backend: str) -> Path:
    return Path(scenario.run.output_dir) / f"{backend}-{scenario_hash(scenario)}"


def find_complete(scenario: Scenario, backend: str) -> Path | None:
    """The folder of a finished run of this scenario on this backend, if there is one."""
    d = run_dir_for(scenario, backend)
    try:
        return d if json.loads((d / "summary.json").read_text()).get("complete") else None
    except (OSError, ValueError):
        return None


def check_resumable(run_dir: str | Path, scenario: Scenario) -> None:
    """Raise ScenarioError unless ``run_dir`` is a run folder of ``scenario`` (up to the
    ``RESUMABLE_CHANGES``), so a resumed run continues what was stopped."""
    d = Path(run_dir)
    if not (d / "scenario.toml").is_file():
        raise ScenarioError("--resume", str(run_dir), "not a run folder (no scenario.toml)")
    old = _flatten(tomllib.loads((d / "scenario.toml").read_text()))
    new = _flatten(scenario.to_dict())
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key) and not key.startswith(RESUMABLE_CHANGES):
            raise ScenarioError("--resume", str(run_dir),
                                f"that run has {key} = {old.get(key)!r}, this scenario {new.get(key)!r}")


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class RunWriter:
    """Writes one run folder while the run goes on (``resume``: an existing one, continued)."""

    def __init__(self, scenario: Scenario, backend: str, resume: str | Path | None = None):
        self.scenario = scenario
        self.backend = backend
        self.kept: list[StepRecord] = []  # steps of the stopped run that a resumed one keeps
        if resume is None:
            self.dir = run_dir_for(scenario, backend)
            if self.dir.exists():
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
            self._old = None
            self._steps = open(self.dir / "steps.jsonl", "w")
        else:
            self.dir = Path(resume)
            path = self.dir / "steps.jsonl"
            lines = path.read_text().splitlines() if path.is_file() else []
            self._old = [StepRecord.from_dict(json.loads(line)) for line in lines if line.strip()]
            self.kept = self._old
            self._steps = None  # rewritten once the resume point is known
        (self.dir / "scenario.toml").write_text(tomli_w.dumps(scenario.to_dict()))
        self.started = time.time()

    def continue_from(self, step: int) -> list[StepRecord]:
        """Resume: keep the stored steps before ``step`` (rewriting steps.jsonl with them);
        returns them. Only the first call decides."""
        if self._steps is None:
            self.kept = [r for r in self._old if r.step < step]
            self._steps = open(self.dir / "steps.jsonl", "w")
            for r in self.kept:
                self._steps.write(json.dumps(r.to_dict()) + "\n")
            self._steps.flush()
        return self.kept

    def write_step(self, record: StepRecord) -> None:
        self.continue_from(record.step)
        self._steps.write(json.dumps(record.to_dict()) + "\n")
        self._steps.flush()

    def finish(self, summary: dict, trace_events: list[dict], routing: RoutingTrace | None,
               complete: bool = True) -> None:
        if self._steps is not None:
            self._steps.close()
        summary = dict(summary, complete=complete)
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=1))
        (self.dir / "trace.json").write_text(json.dumps({"traceEvents": trace_events, "displayTimeUnit": "ms"}))
        if routing is not None:
            routing.save(self.dir)
        if complete:
            line = {"run_dir": str(self.dir), "backend": self.backend, "time": time.time(),
                    "step_time_s": summary.get("step_time_s")}
            with open(self.dir.parent / INDEX, "a") as f:
                f.write(json.dumps(line) + "\n")


def load_run(run_dir: str | Path) -> tuple[dict, dict, list[StepRecord]]:
    """(scenario mapping, summary, step records) of a run folder."""
    d = Path(run_dir)
    scenario = tomllib.loads((d / "scenario.toml").read_text())
    summary = json.loads((d / "summary.json").read_text())
    steps = [StepRecord.from_dict(json.loads(line)) for line in (d / "steps.jsonl").read_text().splitlines() if line]
    return scenario, summary, steps
