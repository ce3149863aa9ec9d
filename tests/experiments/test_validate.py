"""The validation experiment's scoring and report, and a real calibration at 2 ranks."""

import importlib.util
import sys

import pytest

from testbed.profile import load_profile
from testbed.validation_report import write_validation_report


def load_experiment(repo_root):
    path = repo_root / "experiments" / "validate_sim_vs_real.py"
    spec = importlib.util.spec_from_file_location("validate_sim_vs_real", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def point(token, sync, measured, simulated, world=4):
    return {"grid": "cpu", "world": world, "capacity_factor": 1.25, "token_strategy": token, "expert_sync": sync,
            "measured_step_s": measured, "simulated_step_s": simulated, "rel_error": (simulated - measured) / measured,
            "stages": {"dispatch": {"measured_s": 0.01, "simulated_s": 0.02, "error_s": 0.01}},
            "worst_stage": "dispatch", "run_to_run_spread": 0.01, "real_runs": ["r"], "real_run": "r", "sim_run": "s"}


def test_speedups_score_only_distinguishable_pairs(repo_root):
    v = load_experiment(repo_root)
    points = [point("alltoall", "allreduce", 0.100, 0.095), point("allgather", "allreduce", 0.120, 0.118),
              point("hierarchical", "allreduce", 0.102, 0.090)]
    pairs = v.speedups(points, tie=0.05)
    by = {(q["a"].split("/")[0], q["b"].split("/")[0]): q for q in pairs}
    assert by[("alltoall", "allgather")]["scored"] and by[("alltoall", "allgather")]["agree"]
    assert not by[("alltoall", "hierarchical")]["scored"]  # 2% apart: a tie
    s = v.summarize(points, pairs)
    assert s["median_abs_error"] == pytest.approx(0.05)  # errors 5%, 1.7%, 11.8%
    assert s["max_abs_error"] == pytest.approx(0.12 / 1.02)
    assert s["speedup_rank_agreement"] == 1.0 and s["scored_pairs"] == 2


def test_a_wrong_order_is_caught(repo_root):
    v = load_experiment(repo_root)
    points = [point("alltoall", "allreduce", 0.100, 0.130), point("allgather", "allreduce", 0.120, 0.118)]
    s = v.summarize(points, v.speedups(points, tie=0.05))
    assert s["speedup_rank_agreement"] == 0.0


def test_report_names_runs_profile_and_misses(tmp_path, repo_root):
    v = load_experiment(repo_root)
    points = [point("alltoall", "allreduce", 0.100, 0.130), point("allgather", "allreduce", 0.120, 0.118)]
    pairs = v.speedups(points, tie=0.05)
    result = dict(v.summarize(points, pairs), profile=str(load_profile("local-cpu").name), points=points,
                  speedup_pairs=pairs, tie=0.05, repeats=2, median_run_to_run_spread=0.01)
    html = write_validation_report(result, tmp_path / "v.html").read_text()
    assert "<script src=" not in html and "Plotly" in html
    assert "dispatch off by +10.00 ms" in html  # the missed point says which stage and why
    assert "local-cpu" in html and "identity" in html


def test_a_missing_profile_is_one_line(tmp_path, repo_root, capsys, monkeypatch):
    v = load_experiment(repo_root)
    monkeypatch.chdir(tmp_path)
    assert v.main(["--quick", "--profile", "nosuchprofile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "testbed calibrate --name nosuchprofile" in err[0]


def test_calibrate_two_ranks_writes_a_usable_profile(tmp_path):
    from real.calibrate import calibrate

    path = calibrate("mini", ranks=2, out_dir=tmp_path, quick=True, log=lambda line: None)
    p = load_profile(path)
    assert p.name == "mini" and p.versions["backend"] == "gloo" and p.date
    (lat,) = p.measured.collective_latency
    assert lat["world"] == 2 and lat["call_us"] + lat["step_us"] > 0
    # no collective time table: the loopback's measured link rate feeds the network model
    assert p.links.nvlink.bandwidth_GBps == p.links.nic.bandwidth_GBps > 0
    assert p.links.nvlink.bandwidth_GBps != load_profile("local-cpu").links.nvlink.bandwidth_GBps
    assert {r["world"] for r in p.measured.compute_scale} == {2}
    variants = {(r["stage"], r["variant"]) for r in p.measured.stage_us}
    assert ("dispatch", "allgather") in variants and ("expert_sync", "two_stage") in variants
    comm = [r for r in p.measured.stage_us if r["stage"] in ("dispatch", "combine", "expert_sync", "dense_sync")]
    assert comm and all(r["us_per_MB"] == 0 for r in comm)  # communication stages: a fixed cost only
