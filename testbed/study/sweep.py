"""The sweep engine every experiment uses: a base scenario, axes, repeats and backends.

A **sweep** is a base scenario and a list of **points**, each a set of scenario keys with
values (``{"router.capacity_factor": 1.25, "workload.skew": 1.0}``): the product of the
sweep's axes, or a list given explicitly (a simplex grid of heat weights is not a
product). Every point runs on every backend of the sweep:

- **real** (measured): ``repeats`` separate runs, one at a time (their ranks need the
  machine's cores), with ``real_set`` applied (``real.network = emulated``, a profile);
- **sim** (simulated): with a real backend in the sweep, the simulator replays the
  routing of the point's first real run (``workload.trace``) with ``sim_set`` applied
  (the calibrated profile), so the two differ only in how time is modelled; without one,
  it routes the synthetic workload (M4). A simulation is deterministic: one run a point.
  Simulator points run in parallel (``executor``: ``local`` = joblib's loky process pool
  on every core, ``dask`` = a dask.distributed cluster, local or at an address).

Every run goes into the run store (``testbed.run.store``: ``<output_dir>/<run id>/``).
The sweep keeps its own index, ``<output_dir>/sweeps/<name>.jsonl``: a line per task
(point x backend x repeat) when its run completes, naming the run. A sweep that is
stopped or killed and started again reads the index and runs only the tasks that have
no complete run, so no point is lost and none is run twice; ``fresh`` ignores the
index.

The result is one row per run (``rows``: the tidy table written as CSV) and one entry per
point (``points``) with the simulated and measured step time, the speedup of each over
the sweep's baseline point (baseline step time / point step time: > 1 is faster), and
the measured spread over repeats. Times are seconds, bytes are bytes.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from joblib import Parallel, delayed
from tqdm import tqdm

from testbed.core.errors import ScenarioError
from testbed.core.files import write_atomic
from testbed.run.runner import run_scenario
from testbed.run.store import is_complete, load_run, scenario_hash
from testbed.scenario.scenario import Scenario

SWEEPS = "sweeps"
#: summary figures copied into every row of the table (flattened: ``stage_time_s.experts``)
ROW_METRICS = ("step_time_s", "stage_time_s", "bytes_by_level", "wire_bytes_by_level", "peak_memory_bytes",
               "dropped_token_fraction", "page_moves_per_step", "page_stall_s", "group_cache_hit_rate",
               "moves_by_reason", "heat_updates", "max_frozen_fraction", "loss_first", "loss_last",
               "fitted_share", "group_create_s", "steps", "measured_steps", "tokens_per_s_per_gpu", "mfu",
               "model_flops_per_step", "megatron_flops_per_step", "megatron_tflops_per_gpu", "memory_breakdown_bytes",
               "peak_memory_at", "fits_in_device_memory", "pipeline")
EXECUTORS = ("local", "dask")


@dataclass
class Sweep:
    """What to run. ``axes``: scenario key -> values (their product is the grid), or
    ``points``: the grid as a list of {key: value}. ``baseline``: the point speedups are
    measured against (default: the first). ``real_set`` / ``sim_set``: keys applied to
    every real run / every simulated run (a simulated replay gets both)."""

    name: str
    base: Scenario
    axes: dict[str, list] = field(default_factory=dict)
    points: list[dict[str, Any]] | None = None
    backends: tuple[str, ...] = ("sim",)
    repeats: int = 2
    baseline: dict[str, Any] | None = None
    real_set: dict[str, Any] = field(default_factory=dict)
    sim_set: dict[str, Any] = field(default_factory=dict)

    def grid(self) -> list[dict[str, Any]]:
        if self.points is not None:
            return [dict(p) for p in self.points]
        keys = list(self.axes)
        return [dict(zip(keys, values)) for values in itertools.product(*(self.axes[k] for k in keys))]

    @classmethod
    def of_scenarios(cls, name: str, scenarios: list[Scenario], **kw) -> "Sweep":
        """A sweep whose points are whole scenarios (grids no product of axes describes):
        the first is the base, every other point the fields in which it differs."""
        if not scenarios:
            raise ScenarioError("sweep", name, "no scenario to run")
        base = _flat_fields(scenarios[0].to_dict())
        points = [{k: v for k, v in _flat_fields(s.to_dict()).items() if base.get(k) != v} for s in scenarios]
        return cls(name, scenarios[0], points=points, **kw)

    @property
    def keys(self) -> list[str]:
        """The scenario keys the points set, in order of first appearance."""
        out: list[str] = []
        for p in self.grid():
            out += [k for k in p if k not in out]
        return out


def _flat_fields(data: dict) -> dict[str, Any]:
    """``section.key`` -> value of a scenario mapping (its sections' fields)."""
    return {f"{section}.{k}": v for section, table in data.items() if isinstance(table, dict)
            for k, v in table.items()}


def point_label(point: dict[str, Any]) -> str:
    """``capacity_factor=1.25 skew=1`` (the last part of each key)."""
    return " ".join(f"{k.rsplit('.', 1)[-1]}={_show(v)}" for k, v in point.items())


def _show(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_show(x) for x in v) + ")"
    return str(v)


def point_scenario(base: Scenario, sweep_name: str, point: dict[str, Any]) -> Scenario:
    """The scenario of one point of a sweep: ``base`` with the point's fields, its notes
    naming the sweep and the point (``testbed runs`` and reports show them), so that a
    sweep's runs do not read as runs of the base scenario."""
    s = with_keys(base, point)
    label = point_label(point) or "base point"
    return dataclasses.replace(s, notes=f"sweep {sweep_name}: {label}" + (f" (base: {base.notes})" if base.notes else ""))


def with_keys(scenario: Scenario, values: dict[str, Any]) -> Scenario:
    """``scenario`` with ``section.key`` fields set (validated: a ScenarioError names the
    first field that cannot be run)."""
    data = scenario.to_dict()
    for key, value in values.items():
        section, sep, name = key.partition(".")
        if not sep or not name or "." in name:
            raise ScenarioError("sweep axis", key, "expected section.key")
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ScenarioError("sweep axis", key, f"{section} is not a table")
        table[name] = value
    return Scenario.from_dict(data)


# ---- tasks -------------------------------------------------------------------------------
@dataclass
class Task:
    point: int  # index into the grid
    backend: str
    repeat: int
    scenario: Scenario

    @property
    def key(self) -> str:
        """What identifies the task in the sweep's index: backend, the scenario's hash, repeat."""
        return f"{self.backend}/{scenario_hash(self.scenario)}/r{self.repeat}"


def _run_task(scenario_dict: dict, backend: str) -> dict:
    """One run (in this process or a pool's worker); returns its summary."""
    return run_scenario(Scenario.from_dict(scenario_dict), backend)


class SweepIndex:
    """``<output_dir>/sweeps/<name>.jsonl``: task key -> run folder of its complete run."""

    def __init__(self, output_dir: Path, name: str, fresh: bool):
        self.path = output_dir / SWEEPS / f"{name}.jsonl"
        self.done: dict[str, str] = {}
        if not fresh and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    if is_complete(entry["run_dir"]):
                        self.done[entry["task"]] = entry["run_dir"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a kill
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, task: Task, run_dir: str) -> None:
        self.done[task.key] = run_dir
        with open(self.path, "a") as f:  # one short line per append
            f.write(json.dumps({"task": task.key, "run_dir": run_dir, "point": task.point,
                                "backend": task.backend, "repeat": task.repeat, "time": time.time()}) + "\n")


# ---- running -----------------------------------------------------------------------------
@dataclass
class SweepResult:
    sweep: Sweep
    grid: list[dict[str, Any]]
    skipped: list[tuple[dict[str, Any], str]]  # points the scenario refuses, with the reason
    summaries: dict[tuple[int, str, int], dict]  # (point, backend, repeat) -> run summary
    ran: int  # tasks run now (the rest came from the index)
    wall_s: float

    def rows(self) -> list[dict]:
        """The tidy table: one row per run, point keys first, then backend, repeat, run and
        the summary's figures (nested ones flattened with dots)."""
        out = []
        for (i, backend, repeat), s in sorted(self.summaries.items()):
            row = dict(self.grid[i])
            row.update({"point": i, "label": point_label(self.grid[i]), "backend": backend, "repeat": repeat,
                        "run_id": Path(s["run_dir"]).name, "profile": s.get("profile"),
                        "routing_source": s.get("routing_source")})
            for m in ROW_METRICS:
                row.update(_flat(m, s.get(m)))
            out.append(row)
        return out

    def points(self) -> list[dict]:
        """Per point: simulated and measured step time (s), speedups over the baseline, the
        measured spread over repeats ((max - min) / mean) and the range of the measured
        speedup (slowest against fastest repeat, both ways), and the mean of every figure
        over the point's runs per backend."""
        base = self._baseline_index()
        out = []
        for i, p in enumerate(self.grid):
            entry: dict[str, Any] = {"point": i, "label": point_label(p), **{k: v for k, v in p.items()},
                                     "baseline": i == base}
            sim, real = self._times(i, "sim"), self._times(i, "real")
            bsim, breal = self._times(base, "sim"), self._times(base, "real")
            entry["sim_step_s"] = sim[0] if sim else None
            entry["measured_step_s"] = statistics.mean(real) if real else None
            entry["measured_spread"] = (max(real) - min(real)) / statistics.mean(real) if real else None
            entry["sim_speedup"] = bsim[0] / sim[0] if sim and bsim else None
            if real and breal:
                entry["measured_speedup"] = statistics.mean(breal) / statistics.mean(real)
                entry["measured_speedup_range"] = [min(breal) / max(real), max(breal) / min(real)]
            else:
                entry["measured_speedup"] = entry["measured_speedup_range"] = None
            for backend in ("sim", "real"):
                runs = [s for (j, b, _), s in self.summaries.items() if j == i and b == backend]
                if runs:
                    entry[backend] = _mean_figures(runs)
                    entry[backend]["runs"] = [s["run_dir"] for s in runs]
            out.append(entry)
        return out

    def _baseline_index(self) -> int:
        want = self.sweep.baseline
        if want is None:
            return 0
        for i, p in enumerate(self.grid):
            if all(p.get(k) == v for k, v in want.items()):
                return i
        raise ScenarioError("sweep baseline", point_label(want), "is not a point of the sweep")

    def _times(self, i: int, backend: str) -> list[float]:
        return [s["step_time_s"] for (j, b, _), s in sorted(self.summaries.items())
                if j == i and b == backend and s.get("step_time_s") is not None]


def _flat(name: str, value) -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(f"{name}.{k}", v))
        return out
    return {name: value}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _mean_figures(runs: list[dict]) -> dict:
    """The mean over runs of every number in ROW_METRICS (nested dicts kept nested)."""
    out = {}
    for m in ROW_METRICS:
        vals = [r.get(m) for r in runs if r.get(m) is not None]
        if not vals:
            out[m] = None
        elif isinstance(vals[0], dict):  # numbers averaged; others (a pipeline's schedule name, lists) the first run's
            out[m] = {k: statistics.mean(v.get(k, 0) or 0 for v in vals) if _number(x) else x
                      for k, x in vals[0].items()}
        elif isinstance(vals[0], (int, float)) and not isinstance(vals[0], bool):
            out[m] = statistics.mean(vals)
        else:
            out[m] = vals[0]
    return out


def run_sweep(sweep: Sweep, *, jobs: int | None = None, executor: str = "local", address: str | None = None,
              fresh: bool = False, progress: bool = True) -> SweepResult:
    """Run every task of ``sweep`` that the sweep's index has no complete run of; real runs
    one at a time first, then the simulated ones in parallel (``jobs`` processes; default
    every core). A run that fails stops the sweep with its error; what finished is kept."""
    if executor not in EXECUTORS:
        raise ScenarioError("--executor", executor, "expected one of " + ", ".join(EXECUTORS))
    if sweep.repeats < 1:
        raise ScenarioError("--repeats", sweep.repeats, "must be at least 1")
    if jobs is not None and jobs < 1:
        raise ScenarioError("--jobs", jobs, "must be at least 1 (or left out: every core)")
    start = time.perf_counter()
    output_dir = Path(sweep.base.run.output_dir).resolve()
    base = sweep.base.replace(run={"output_dir": str(output_dir)})
    grid, scenarios, skipped = [], [], []
    for p in sweep.grid():
        try:
            scenarios.append(point_scenario(base, sweep.name, p))
            grid.append(p)
        except ScenarioError as e:
            skipped.append((p, str(e)))
    if not grid:
        raise ScenarioError("sweep", sweep.name, "no point of the grid is a valid scenario: "
                            + "; ".join(r for _, r in skipped[:3]))
    index = SweepIndex(output_dir, sweep.name, fresh)
    summaries: dict[tuple[int, str, int], dict] = {}
    real = "real" in sweep.backends
    real_tasks = [Task(i, "real", r, with_keys(s, sweep.real_set)) for i, s in enumerate(scenarios)
                  for r in range(sweep.repeats)] if real else []
    bar = _bar(len(real_tasks) + (len(scenarios) if "sim" in sweep.backends else 0), sweep.name, progress)
    ran = 0
    try:
        for t in real_tasks:
            if t.key in index.done:
                summary = load_run(index.done[t.key])[1]
            else:
                bar.set_postfix_str(f"real {point_label(grid[t.point])} #{t.repeat + 1}")
                summary = _run_task(t.scenario.to_dict(), "real")
                index.add(t, summary["run_dir"])
                ran += 1
            summaries[(t.point, "real", t.repeat)] = summary
            bar.update(1)
        if "sim" in sweep.backends:
            sim_tasks = []
            for i, s in enumerate(scenarios):
                sim = with_keys(s, {**(sweep.real_set if real else {}), **sweep.sim_set})
                if real:  # M4 replaced by the measured routing of the point's first real run
                    sim = with_keys(sim, {"workload.trace": summaries[(i, "real", 0)]["run_dir"]})
                sim_tasks.append(Task(i, "sim", 0, sim))
            for t in sim_tasks:
                if t.key in index.done:
                    summaries[(t.point, "sim", 0)] = load_run(index.done[t.key])[1]
                    bar.update(1)
            todo = [t for t in sim_tasks if t.key not in index.done]
            for t, summary in _parallel(todo, jobs, executor, address):
                index.add(t, summary["run_dir"])
                summaries[(t.point, "sim", 0)] = summary
                ran += 1
                bar.update(1)
    finally:
        bar.close()
    return SweepResult(sweep, grid, skipped, summaries, ran, time.perf_counter() - start)


def _parallel(tasks: list[Task], jobs: int | None, executor: str, address: str | None) -> Iterable[tuple[Task, dict]]:
    """(task, summary) as each simulated run finishes, in any order."""
    if not tasks:
        return
    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if executor == "dask":
        yield from _dask(tasks, jobs, address)
        return
    if jobs == 1 or len(tasks) == 1:
        for t in tasks:
            yield t, _run_task(t.scenario.to_dict(), t.backend)
        return
    results = Parallel(n_jobs=min(jobs, len(tasks)), backend="loky", return_as="generator_unordered")(
        delayed(_indexed)(k, t.scenario.to_dict(), t.backend) for k, t in enumerate(tasks))
    for k, summary in results:
        yield tasks[k], summary


def _indexed(k: int, scenario_dict: dict, backend: str) -> tuple[int, dict]:
    return k, _run_task(scenario_dict, backend)


def _dask(tasks: list[Task], jobs: int, address: str | None) -> Iterable[tuple[Task, dict]]:
    """Simulated runs on a dask.distributed cluster: the one at ``address``, or a local
    one of ``jobs`` worker processes started for this sweep and closed after it."""
    try:
        from dask.distributed import Client, LocalCluster, as_completed  # noqa: PLC0415 - optional extra
    except ImportError:
        raise ScenarioError("--executor", "dask", "needs dask.distributed: pip install 'moe-testbed[dask]'") from None
    cluster = None
    if address:
        client = Client(address)
    else:
        cluster = LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
    try:
        futures = {client.submit(_run_task, t.scenario.to_dict(), t.backend, pure=False): t for t in tasks}
        for fut in as_completed(futures):
            yield futures[fut], fut.result()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


class _NoBar:
    def update(self, n=1): ...
    def set_postfix_str(self, s): ...
    def close(self): ...


def _bar(total: int, name: str, enabled: bool):
    if not enabled:
        return _NoBar()
    return tqdm(total=total, desc=name, unit="run", file=sys.stderr, dynamic_ncols=True)


# ---- writing -----------------------------------------------------------------------------
def write_table(rows: list[dict], path: str | Path) -> Path:
    """The tidy table as CSV: every column any row has, in order of first appearance."""
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns)
    w.writeheader()
    for r in rows:
        w.writerow({k: json.dumps(v) if isinstance(v, (list, tuple)) else v for k, v in r.items()})
    write_atomic(out, buf.getvalue())
    return out
