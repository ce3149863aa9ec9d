"""experiments/compare_strategies.py: the variants, errors, and (with the sim backend) a sweep."""

from __future__ import annotations

import json

from testbed.scenario.scenario import Scenario
from testbed.study.experiments import load_experiment


def load_script():
    return load_experiment("compare_strategies")


def test_strategy_scenarios_are_the_six_combinations():
    base = Scenario().replace(router={"capacity_factor": 2.0})
    variants = load_script().strategy_scenarios(base)
    pairs = [(s.comm.token_strategy, s.comm.expert_sync) for s in variants]
    assert sorted(pairs) == sorted({(t, e) for t in ("alltoall", "allgather", "hierarchical")
                                    for e in ("allreduce", "two_stage")})
    assert len(pairs) == 6
    assert all(s.router.capacity_factor == 2.0 for s in variants)  # the rest of the base is kept


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    script = load_script()
    assert script.main(["--backends", "nope", "--output", str(tmp_path / "r.html")]) == 2
    assert script.main(["--backends", "sim", "--set", "router.capacity_factr=1", "--output", str(tmp_path / "r.html")]) == 2
    assert script.main(["--backends", "sim", "--jobs", "0", "--output", str(tmp_path / "r.html")]) == 2
    # a report that cannot be written is refused before any run, not after the sweep
    assert script.main(["--backends", "sim", "--output", "/proc/no/r.html"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and "--backends" in err[0] and "capacity_factr" in err[1]
    assert "--jobs = 0" in err[2] and "--report = '/proc/no/r.html': cannot write there" in err[3]
    assert not (tmp_path / "r.html").exists()


def test_sim_sweep_writes_six_runs_and_a_report(tmp_path, capsys):
    out = tmp_path / "r.html"
    args = ["--backends", "sim", "--set", "run.steps=2", "--set", "run.warmup_steps=0", "--no-progress",
            "--set", f"run.output_dir={tmp_path / 'runs'}", "--output", str(out), "--json"]
    assert load_script().main(args) == 0
    result = json.loads(capsys.readouterr().out)
    points = result["points"]
    assert len(points) == 6 and result["ran"] == 6
    assert {(p["comm.token_strategy"], p["comm.expert_sync"]) for p in points} == {
        (t, e) for t in ("alltoall", "allgather", "hierarchical") for e in ("allreduce", "two_stage")}
    assert all(p["sim_speedup"] > 0 and p["measured_speedup"] is None for p in points)
    assert len(result["headline"]["ranking_sim"]) == 6
    assert out.is_file() and out.with_suffix(".csv").is_file()
    assert (tmp_path / "index.html").is_file() and out.name in (tmp_path / "index.html").read_text()
    # a second sweep reuses every finished run
    assert load_script().main(args) == 0
    assert json.loads(capsys.readouterr().out)["ran"] == 0
