"""The run store never loses a result: a refused command changes no run folder, a rerun
never overwrites an earlier run, refused runs leave no folder, files are written whole,
and the store can be listed and searched."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from testbed.cli.main import main as cli_main
from testbed.core.errors import ScenarioError
from testbed.core.files import write_atomic
from testbed.run.runner import run_scenario
from testbed.run.store import is_complete, latest_run, list_runs, read_steps
from testbed.scenario.scenario import Scenario


def scenario(tmp_path, data=None, **changes) -> Scenario:
    data = json.loads(json.dumps(data or {"run": {"steps": 3, "warmup_steps": 1}}))
    data.setdefault("run", {})["output_dir"] = str(tmp_path / "runs")
    for section, fields in changes.items():
        if isinstance(fields, dict):
            data.setdefault(section, {}).update(fields)
        else:
            data[section] = fields
    return Scenario.from_dict(data)


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` with the hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_rerun_gets_its_own_folder_and_the_latest_is_a_lookup(tmp_path):
    s = scenario(tmp_path)
    first = run_scenario(s, "sim")
    before = fingerprint(Path(first["run_dir"]))
    second = run_scenario(s, "sim")
    assert first["run_dir"] != second["run_dir"]
    assert fingerprint(Path(first["run_dir"])) == before  # routing trace and all
    assert latest_run(s, "sim") == Path(second["run_dir"])
    assert run_scenario(s, "sim", reuse=True)["run_dir"] == second["run_dir"]
    rows = list_runs(tmp_path / "runs")
    assert [r["id"] for r in rows] == [Path(first["run_dir"]).name, Path(second["run_dir"]).name]
    assert all(r["complete"] and r["backend"] == "sim" and r["steps"] == 3 for r in rows)


def test_a_stopped_rerun_never_replaces_the_complete_run(tmp_path, monkeypatch):
    s = scenario(tmp_path)
    done = run_scenario(s, "sim")
    before = fingerprint(Path(done["run_dir"]))
    import sim.backend

    original = sim.backend.ClusterSim.step

    def stop_at_step_2(self, step, *args, **kw):
        if step == 2:
            raise KeyboardInterrupt
        return original(self, step, *args, **kw)

    monkeypatch.setattr(sim.backend.ClusterSim, "step", stop_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        run_scenario(s, "sim")
    assert fingerprint(Path(done["run_dir"])) == before
    assert latest_run(s, "sim") == Path(done["run_dir"])  # the complete one
    stopped = latest_run(s, "sim", complete=False)
    assert stopped != Path(done["run_dir"]) and not is_complete(stopped) and len(read_steps(stopped)) == 2
    rows = {r["id"]: r for r in list_runs(tmp_path / "runs")}
    assert rows[stopped.name]["complete"] is False and rows[stopped.name]["steps"] == 2


def test_refused_runs_leave_no_folder(tmp_path, two_ranks):
    out = tmp_path / "runs"
    with pytest.raises(ScenarioError, match="simulated only"):  # refused by the backend's check
        run_scenario(scenario(tmp_path, two_ranks, faults=[{"at_step": 1, "kind": "gpu_lost", "target": "gpu:1"}]),
                     "real")
    with pytest.raises(ScenarioError, match="cluster.profile"):  # refused when the profile is looked up
        run_scenario(scenario(tmp_path, cluster={"profile": "nosuchprofile"}), "sim")
    with pytest.raises(ScenarioError, match="workload.trace"):  # refused while it runs, before its first step
        run_scenario(scenario(tmp_path, workload={"trace": str(tmp_path / "nowhere")}), "sim")
    assert not out.exists() or not [p for p in out.iterdir() if p.is_dir()]


@pytest.mark.slow
def test_a_refused_resume_changes_nothing_in_the_run_it_refused(tmp_path, two_ranks):
    s = scenario(tmp_path, two_ranks)
    done = run_scenario(s, "real")  # a complete run without checkpoints
    d = Path(done["run_dir"])
    # every summary says where its numbers come from
    assert done["routing_source"] == "real router" and done["profile"] == "local-cpu"
    assert done["profile_calibrated_here"] is False
    replay = run_scenario(s.replace(workload={"trace": str(d)}), "sim")
    assert replay["routing_source"] == f"replayed trace of {d}"
    assert run_scenario(s, "sim")["routing_source"] == "synthetic workload (M4)"
    before = fingerprint(d)
    for argv in (["run", "--backend", "real", "--resume", str(d), "--no-progress"],
                 ["run", "--backend", "real", "--resume", str(d), "--no-progress", "--set", "checkpoint.enabled=true"]):
        assert cli_main(argv) == 2
        assert fingerprint(d) == before


def test_whole_files_or_none(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    write_atomic(target, "old")

    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_atomic(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_the_store_writes_keep_the_users_umask(tmp_path, umask):
    """summary.json, scenario.toml and trace.json get the mode steps.jsonl gets (0666 less
    the umask), not the 0600 of a temporary file."""
    old = os.umask(umask)
    try:
        done = run_scenario(scenario(tmp_path), "sim")
    finally:
        os.umask(old)
    d = Path(done["run_dir"])
    modes = {name: (d / name).stat().st_mode & 0o777
             for name in ("summary.json", "scenario.toml", "trace.json", "steps.jsonl")}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


def test_a_step_line_cut_by_a_kill_is_left_out(tmp_path):
    done = run_scenario(scenario(tmp_path), "sim")
    steps = Path(done["run_dir"]) / "steps.jsonl"
    steps.write_text(steps.read_text() + '{"step": 3, "step_ti')
    assert [r.step for r in read_steps(done["run_dir"])] == [0, 1, 2]


def test_testbed_runs_lists_the_store(tmp_path, capsys):
    s = scenario(tmp_path, notes="a note")
    run_scenario(s, "sim")
    assert cli_main(["runs", "--output-dir", str(tmp_path / "runs")]) == 0
    header, line = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["run", "backend", "started", "state", "scenario"]
    assert line.startswith("sim-") and " sim " in line and "complete" in line and line.endswith("a note")
    assert cli_main(["runs", "--output-dir", str(tmp_path / "empty")]) == 0
    assert "no runs" in capsys.readouterr().out
