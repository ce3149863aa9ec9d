"""The run store: one folder per run, never overwritten, and an index to find runs by scenario.

A run lives in ``<output_dir>/<run id>/``; the id is ``<backend>-<scenario hash>-<UTC time>-<4
hex>`` (``new_run_id``), so a rerun of a scenario, even one stopped after a few steps, never
touches an earlier run. The folder holds ``scenario.toml`` (the resolved scenario),
``steps.jsonl`` (one StepRecord per line, written as each step completes, so a stopped run
keeps its steps), ``summary.json`` (``"complete": false`` when the run was stopped),
``trace.json`` (Chrome / Perfetto trace), ``routing.npz`` (the routing trace) and
``groups.json`` (every GPU's process groups, ``testbed.run.runner``).

Nothing is written before the backend delivers its first step: a run refused before that
(a bad option, no privileges, nothing to resume) leaves no folder, and a refused
``--resume`` leaves the folder it names as it was. Whole files are written atomically
(a temporary file, then a rename); ``steps.jsonl`` grows a line at a time, and a line cut
by a kill is ignored when it is read.

``<output_dir>/index.jsonl`` gets a line when a run's folder is made (``complete``
false) and one when it finishes (``complete`` true or false): id, scenario hash, backend,
time (Unix seconds), notes. The last line of an id wins. ``latest_run`` looks up the newest
run of a scenario (what sweeps use to resume where they stopped); ``list_runs`` lists the
store (``testbed runs``).

A run resumed from its checkpoints (``--resume RUN_DIR``, real backend) continues in its
own folder: ``steps.jsonl`` keeps the steps before the resume point and continues.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import time
import tomllib
from pathlib import Path

from testbed.core.errors import ScenarioError
from testbed.core.files import write_atomic
from testbed.run.results import StepRecord
from testbed.run.routing_trace import RoutingTrace
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

INDEX = "index.jsonl"
#: fields a resumed run may change: how long it runs and how the real backend runs it
RESUMABLE_CHANGES = ("run.steps", "run.warmup_steps", "run.output_dir", "real.")
#: what makes a folder a run folder
SCENARIO_FILE, SUMMARY_FILE, STEPS_FILE, TRACE_FILE = "scenario.toml", "summary.json", "steps.jsonl", "trace.json"
#: every GPU's process groups (``testbed.run.runner.process_groups_file``)
GROUPS_FILE = "groups.json"


def scenario_hash(scenario: Scenario) -> str:
    """12 hex digits identifying what a run computes: the scenario (output folder left
    out) and the content of the machine profile it resolves to, so that a run made before
    a profile was recalibrated or edited is never taken for one of the new profile."""
    data = scenario.to_dict()
    data["run"] = {k: v for k, v in data["run"].items() if k != "output_dir"}
    data["resolved_profile"] = load_profile(scenario.cluster.profile).to_dict()
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def new_run_id(scenario: Scenario, backend: str, job: str | None = None) -> str:
    """A fresh run id: backend, scenario hash, UTC time and 4 random hex digits. ``job``:
    an id every process of one launched job shares (torchrun's), which then replaces time
    and randomness so that every rank names the same folder."""
    if job is not None:
        return f"{backend}-{scenario_hash(scenario)}-job{hashlib.sha256(job.encode()).hexdigest()[:10]}"
    return f"{backend}-{scenario_hash(scenario)}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def read_steps(run_dir: str | Path) -> list[StepRecord]:
    """The step records of a run folder; a last line cut short by a kill is left out."""
    path = Path(run_dir) / STEPS_FILE
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(StepRecord.from_dict(json.loads(line)))
        except (ValueError, TypeError):
            continue  # a line the run did not finish writing
    return out


def check_resumable(run_dir: str | Path, scenario: Scenario) -> None:
    """Raise ScenarioError unless ``run_dir`` is a run folder of ``scenario`` (up to the
    ``RESUMABLE_CHANGES``), so a resumed run continues what was stopped."""
    d = Path(run_dir)
    if not (d / SCENARIO_FILE).is_file():
        raise ScenarioError("--resume", str(run_dir), f"not a run folder (no {SCENARIO_FILE})")
    old = _flatten(tomllib.loads((d / SCENARIO_FILE).read_text()))
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


# ---- the index ---------------------------------------------------------------------------
def _index_line(output_dir: Path, run_dir: Path, scenario: Scenario, backend: str, complete: bool) -> None:
    line = {"id": run_dir.name, "scenario_hash": scenario_hash(scenario), "backend": backend,
            "time": time.time(), "notes": scenario.notes, "complete": complete}
    with open(output_dir / INDEX, "a") as f:  # one short line per append: whole or not at all
        f.write(json.dumps(line) + "\n")


def read_index(output_dir: str | Path) -> dict[str, dict]:
    """Run id -> its latest index entry, with ``started`` (time of its first line); runs
    whose folder is gone are left out."""
    path = Path(output_dir) / INDEX
    runs: dict[str, dict] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            entry = json.loads(line)
            run_id = entry["id"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short, or one of an older index format
        started = runs.get(run_id, {}).get("started", entry.get("time"))
        runs[run_id] = dict(entry, started=started)
    return {k: v for k, v in runs.items() if (Path(output_dir) / k).is_dir()}


def is_complete(run_dir: str | Path) -> bool:
    """A run folder whose run finished: its summary says ``complete``."""
    try:
        return bool(json.loads((Path(run_dir) / SUMMARY_FILE).read_text()).get("complete"))
    except (OSError, ValueError, AttributeError):
        return False


def latest_run(scenario: Scenario, backend: str, complete: bool = True) -> Path | None:
    """The newest run folder of this scenario on this backend in its output folder (only
    finished ones with ``complete``), or None."""
    out = Path(scenario.run.output_dir)
    h = scenario_hash(scenario)
    found = [(e["started"], out / run_id) for run_id, e in read_index(out).items()
             if e.get("scenario_hash") == h and e.get("backend") == backend]
    for _, d in sorted(found, reverse=True):
        if not complete or is_complete(d):
            return d
    return None


def list_runs(output_dir: str | Path) -> list[dict]:
    """The store, oldest first: id, scenario (notes or hash), backend, started (Unix
    seconds), steps written, complete."""
    out = []
    for run_id, e in read_index(output_dir).items():
        d = Path(output_dir) / run_id
        out.append({"id": run_id, "scenario": e.get("notes") or e.get("scenario_hash", "?"),
                    "backend": e.get("backend", "?"), "started": e.get("started"),
                    "steps": len(read_steps(d)), "complete": is_complete(d)})
    return sorted(out, key=lambda r: r["started"] or 0)


# ---- writing a run -----------------------------------------------------------------------
class RunWriter:
    """Writes one run folder while the run goes on (``resume``: an existing one, continued).

    Nothing is written until the first step (or ``finish``) arrives; ``abandon`` undoes a
    folder the run made but never wrote a step into.
    """

    def __init__(self, scenario: Scenario, backend: str, resume: str | Path | None = None,
                 run_id: str | None = None):
        self.scenario = scenario
        self.backend = backend
        self.output_dir = Path(scenario.run.output_dir)
        self.resume = resume is not None
        if self.resume:
            self.dir = Path(resume)
            self._old = read_steps(self.dir)
            self.kept: list[StepRecord] = list(self._old)  # steps of the stopped run a resumed one keeps
        else:
            self.dir = self.output_dir / (run_id or new_run_id(scenario, backend))
            self._old = None
            self.kept = []
        self._steps = None  # open once the first step arrives
        self.started = time.time()

    def _open(self, kept: list[StepRecord]) -> None:
        """Make (or, resuming, rewrite) the folder's scenario and steps, keeping ``kept``."""
        if not self.resume:
            # the id is new: a folder that exists holds only what this run's ranks put there
            # before its first step (checkpoint folders, profiler traces)
            self.dir.mkdir(parents=True, exist_ok=True)
            _index_line(self.output_dir, self.dir, self.scenario, self.backend, complete=False)
        import tomli_w  # only where TOML is written (the GPU machine's check runs without it)
        write_atomic(self.dir / SCENARIO_FILE, tomli_w.dumps(self.scenario.to_dict()))
        if self.resume:
            write_atomic(self.dir / STEPS_FILE, "".join(json.dumps(r.to_dict()) + "\n" for r in kept))
        self._steps = open(self.dir / STEPS_FILE, "a")

    def continue_from(self, step: int) -> list[StepRecord]:
        """The stored steps before ``step`` (resume) that the run keeps; the first call
        opens the folder for writing."""
        if self._steps is None:
            self.kept = [r for r in (self._old or []) if r.step < step]
            self._open(self.kept)
        return self.kept

    def write_step(self, record: StepRecord) -> None:
        self.continue_from(record.step)
        self._steps.write(json.dumps(record.to_dict()) + "\n")
        self._steps.flush()

    @property
    def started_writing(self) -> bool:
        return self._steps is not None

    def abandon(self) -> None:
        """A run that wrote no step: remove the folder it (or its ranks) made; a resumed one
        stays as it was."""
        if self._steps is not None:
            self._steps.close()
        if not self.resume and self.dir.exists() and not read_steps(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)

    def finish(self, summary: dict, trace_events: list[dict], routing: RoutingTrace | None,
               complete: bool = True, files: dict[str, str] | None = None) -> None:
        """Write the run's last files: ``files`` (name -> text, each written whole), the
        trace, the routing and, last, the summary (``complete`` or not)."""
        if self._steps is None:
            self.continue_from(self._old[-1].step + 1 if self._old else 0)
        self._steps.close()
        summary = dict(summary, complete=complete)
        # compact separators: the trace is the largest file of a run, read by programs only
        write_atomic(self.dir / TRACE_FILE, json.dumps({"traceEvents": trace_events, "displayTimeUnit": "ms"},
                                                       separators=(",", ":")))
        if routing is not None:
            routing.save(self.dir)
        for name, text in (files or {}).items():
            write_atomic(self.dir / name, text)
        write_atomic(self.dir / SUMMARY_FILE, json.dumps(summary, indent=1))  # last: the run is whole
        _index_line(self.output_dir, self.dir, self.scenario, self.backend, complete=complete)


def load_run(run_dir: str | Path) -> tuple[dict, dict, list[StepRecord]]:
    """(scenario mapping, summary, step records) of a run folder."""
    d = Path(run_dir)
    scenario = tomllib.loads((d / SCENARIO_FILE).read_text())
    summary = json.loads((d / SUMMARY_FILE).read_text())
    return scenario, summary, read_steps(d)
