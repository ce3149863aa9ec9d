"""The sweep engine: grids, the sweep index (resume after a kill), speedups, executors,
and a paired real + simulated sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from testbed.cli.main import main as cli_main
from testbed.core.errors import ScenarioError
from testbed.run.store import read_index
from testbed.scenario.profile import find_profile
from testbed.scenario.scenario import Scenario
from testbed.study.sweep import Sweep, SweepIndex, point_label, run_sweep, with_keys, write_table

TINY = {"model": {"hidden_size": 32, "ffn_hidden_size": 64},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "run": {"steps": 3, "warmup_steps": 1}}


def tiny(tmp_path, **sections) -> Scenario:
    data = {k: dict(v) for k, v in TINY.items()}
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    data["run"]["output_dir"] = str(tmp_path / "runs")
    return Scenario.from_dict(data)


def test_grid_is_the_product_of_axes_or_the_points_given(tmp_path):
    s = Sweep("g", tiny(tmp_path), axes={"router.capacity_factor": [1.0, 2.0], "workload.skew": [0, 1, 2]})
    grid = s.grid()
    assert len(grid) == 6 and grid[0] == {"router.capacity_factor": 1.0, "workload.skew": 0}
    assert grid[-1] == {"router.capacity_factor": 2.0, "workload.skew": 2}
    pts = [{"heat.alpha": 1.0, "heat.beta": 0.0}, {"heat.alpha": 0.0, "heat.beta": 1.0}]
    assert Sweep("p", tiny(tmp_path), axes={"x.y": [1]}, points=pts).grid() == pts
    assert point_label({"router.capacity_factor": 1.25, "heat.alpha": 0.5}) == "capacity_factor=1.25 alpha=0.5"


def test_with_keys_names_the_bad_field(tmp_path):
    s = tiny(tmp_path)
    assert with_keys(s, {"router.capacity_factor": 2.0}).router.capacity_factor == 2.0
    with pytest.raises(ScenarioError, match="capacity_factr"):
        with_keys(s, {"router.capacity_factr": 2.0})
    with pytest.raises(ScenarioError, match="section.key"):
        with_keys(s, {"capacity_factor": 2.0})


def test_sim_sweep_speedups_table_and_invalid_points(tmp_path):
    # ep_size 3 does not divide 4 GPUs: that point is skipped with its reason, the rest run
    sweep = Sweep("s", tiny(tmp_path), axes={"parallelism.ep_size": [2, 3, 4]}, backends=("sim",))
    result = run_sweep(sweep, jobs=1, progress=False)
    assert [p["parallelism.ep_size"] for p in result.grid] == [2, 4]
    assert len(result.skipped) == 1 and "ep_size" in result.skipped[0][1]
    pts = result.points()
    assert pts[0]["baseline"] and pts[0]["sim_speedup"] == 1.0
    assert pts[1]["sim_speedup"] == pytest.approx(pts[0]["sim_step_s"] / pts[1]["sim_step_s"])
    assert pts[1]["measured_speedup"] is None  # no real backend in this sweep
    rows = result.rows()
    assert len(rows) == 2 and {r["backend"] for r in rows} == {"sim"}
    path = write_table(rows, tmp_path / "t.csv")
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and "step_time_s" in lines[0] and "stage_time_s.experts" in lines[0]
    # run again: everything comes from the sweep's index, nothing runs
    again = run_sweep(sweep, jobs=1, progress=False)
    assert again.ran == 0 and [p["sim_step_s"] for p in again.points()] == [p["sim_step_s"] for p in pts]
    assert run_sweep(sweep, jobs=1, progress=False, fresh=True).ran == 2


@pytest.mark.slow
def test_parallel_executors_give_the_same_results(tmp_path):
    """joblib's process pool, a dask cluster the sweep starts itself, and an existing dask
    cluster named by its scheduler's address give the same simulated steps."""
    axes = {"workload.skew": [0.0, 0.5, 1.0]}
    local = run_sweep(Sweep("par", tiny(tmp_path / "l"), axes=axes), jobs=2, progress=False)
    assert local.ran == 3
    distributed = pytest.importorskip("dask.distributed")
    own = run_sweep(Sweep("par", tiny(tmp_path / "d"), axes=axes), jobs=2, executor="dask", progress=False)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        existing = run_sweep(Sweep("par", tiny(tmp_path / "e"), axes=axes), executor="dask",
                             address=cluster.scheduler_address, progress=False)
    want = [p["sim_step_s"] for p in local.points()]
    assert own.ran == existing.ran == 3
    assert [p["sim_step_s"] for p in own.points()] == want == [p["sim_step_s"] for p in existing.points()]


def test_unknown_executor_and_baseline_are_refused(tmp_path):
    sweep = Sweep("x", tiny(tmp_path), axes={"workload.skew": [0.0]})
    with pytest.raises(ScenarioError, match="--executor"):
        run_sweep(sweep, executor="spark", progress=False)
    bad = Sweep("y", tiny(tmp_path), axes={"workload.skew": [0.0]}, baseline={"workload.skew": 9.0})
    with pytest.raises(ScenarioError, match="baseline"):
        run_sweep(bad, jobs=1, progress=False).points()


KILLED_SWEEP = """
import sys
from testbed.scenario.scenario import Scenario
from testbed.study.sweep import Sweep, run_sweep
base = Scenario.from_dict({data!r})
sweep = Sweep("killed", base, axes={{"workload.skew": [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]}}, backends=("sim",))
run_sweep(sweep, jobs=1, progress=False)
print("done")
"""


@pytest.mark.slow
def test_a_sweep_killed_half_way_finishes_every_point_exactly_once(tmp_path):
    data = tiny(tmp_path, run={"steps": 12}).to_dict()
    script = KILLED_SWEEP.format(data=data)
    index = tmp_path / "runs" / "sweeps" / "killed.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if index.is_file() and len(index.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the sweep finished before it could be killed: make its points slower"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(index.read_text().splitlines())
    assert 2 <= done_before < 6
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    tasks = [json.loads(line)["task"] for line in index.read_text().splitlines()]
    assert len(tasks) == 6 and len(set(tasks)) == 6  # every point once in the index
    complete = [e for e in read_index(tmp_path / "runs").values() if e["complete"]]
    per_scenario = {}
    for e in complete:
        per_scenario[e["scenario_hash"]] = per_scenario.get(e["scenario_hash"], 0) + 1
    assert len(per_scenario) == 6 and set(per_scenario.values()) == {1}  # none completed twice


def test_index_ignores_a_line_cut_short_and_runs_that_are_gone(tmp_path):
    idx = SweepIndex(tmp_path, "cut", fresh=False)
    idx.path.write_text('{"task": "sim/abc/r0", "run_dir": "' + str(tmp_path / "gone") + '"}\n{"task": "si')
    assert SweepIndex(tmp_path, "cut", fresh=False).done == {}


@pytest.mark.slow
def test_paired_sweep_replays_each_points_real_routing(tmp_path, two_ranks):
    """Real runs (2 repeats a point) and the simulator replaying the first one's routing."""
    two_ranks["run"]["output_dir"] = str(tmp_path / "runs")
    base = Scenario.from_dict(two_ranks)
    sweep = Sweep("paired", base, axes={"router.capacity_factor": [1.0, 2.0]}, backends=("sim", "real"), repeats=2)
    result = run_sweep(sweep, jobs=1, progress=False)
    assert result.ran == 6
    pts = result.points()
    for p in pts:
        assert p["measured_step_s"] > 0 and p["sim_step_s"] > 0 and p["measured_spread"] >= 0
        assert len(p["real"]["runs"]) == 2
        lo, hi = p["measured_speedup_range"]
        assert lo <= p["measured_speedup"] <= hi
        sim_summary = result.summaries[(p["point"], "sim", 0)]
        assert sim_summary["routing_source"].startswith("replayed")
        # same routing on both sides: the planner's bytes per level are the same
        assert sim_summary["bytes_by_level"] == result.summaries[(p["point"], "real", 0)]["bytes_by_level"]
    assert pts[0]["measured_speedup"] == 1.0


def test_a_sweep_of_whole_scenarios_runs_each_as_given(tmp_path):
    """Points that are whole scenarios (the validation's grids): each run is the scenario
    given, whatever fields it changes against the first."""
    a = tiny(tmp_path)
    b = tiny(tmp_path, cluster={"nodes_per_microcluster": 1}, workload={"skew": 0.5})
    sweep = Sweep.of_scenarios("whole", [a, b])
    assert sweep.grid() == [{}, {"cluster.nodes_per_microcluster": 1, "workload.skew": 0.5}]
    result = run_sweep(sweep, jobs=1, progress=False)
    ran = [Scenario.from_dict(tomllib.loads((Path(result.summaries[(i, "sim", 0)]["run_dir"])
                                                           / "scenario.toml").read_text())) for i in (0, 1)]
    assert [s.world_size for s in ran] == [4, 2] and [s.workload.skew for s in ran] == [a.workload.skew, 0.5]


def test_editing_the_profile_makes_a_rerun_simulate_again(tmp_path):
    """The run's identity holds the resolved profile's content, not only its name: after the
    profile file is edited (recalibrated), a sweep reruns its points instead of reporting the
    runs of the old profile, and the new runs carry the new figures."""
    prof = tmp_path / "mine.toml"
    prof.write_text(find_profile("local-cpu").read_text())
    sweep = Sweep("edit", tiny(tmp_path, cluster={"profile": str(prof)}), axes={"workload.skew": [0.0, 1.0]},
                  backends=("sim",))
    first = run_sweep(sweep, jobs=1, progress=False)
    assert first.ran == 2
    assert run_sweep(sweep, jobs=1, progress=False).ran == 0  # nothing changed: nothing runs
    data = tomllib.loads(prof.read_text())
    data["compute"]["launch_us"] = data["compute"]["launch_us"] * 10 + 50
    prof.write_text(tomli_w.dumps(data))
    again = run_sweep(sweep, jobs=1, progress=False)
    assert again.ran == 2
    slow = [p["sim_step_s"] for p in again.points()]
    fast = [p["sim_step_s"] for p in first.points()]
    assert all(s > f for s, f in zip(slow, fast))


def test_a_sweeps_runs_are_named_by_their_sweep_and_point_in_the_store(tmp_path, capsys):
    sweep = Sweep("named", Scenario.from_dict({**tiny(tmp_path).to_dict(), "notes": "quick start"}),
                  axes={"workload.skew": [0.0, 1.0]})
    run_sweep(sweep, jobs=1, progress=False)
    notes = sorted(e["notes"] for e in read_index(tmp_path / "runs").values())
    assert notes == ["sweep named: skew=0 (base: quick start)", "sweep named: skew=1 (base: quick start)"]
    assert cli_main(["runs", "--output-dir", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "backend", "started", "state", "scenario"]
    assert len(lines) == 3 and all("sweep named: skew=" in line for line in lines[1:])
