"""The validation experiment's scoring and report, and a real calibration at 2 ranks."""


import pytest

from testbed.experiment import load_experiment
from testbed.profile import load_profile
from testbed.validation_report import write_validation_report


def point(token, sync, measured, simulated, world=4):
    return {"grid": "cpu", "world": world, "capacity_factor": 1.25, "token_strategy": token, "expert_sync": sync,
            "measured_step_s": measured, "simulated_step_s": simulated, "rel_error": (simulated - measured) / measured,
            "stages": {"dispatch": {"measured_s": 0.01, "simulated_s": 0.02, "error_s": 0.01}},
            "worst_stage": "dispatch", "run_to_run_spread": 0.01, "real_runs": ["r"], "real_run": "r", "sim_run": "s"}


def test_speedups_score_only_distinguishable_pairs(repo_root):
    v = load_experiment("validate_sim_vs_real")
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
    v = load_experiment("validate_sim_vs_real")
    points = [point("alltoall", "allreduce", 0.100, 0.130), point("allgather", "allreduce", 0.120, 0.118)]
    s = v.summarize(points, v.speedups(points, tie=0.05))
    assert s["speedup_rank_agreement"] == 0.0


def test_report_names_runs_profile_and_misses(tmp_path, repo_root):
    v = load_experiment("validate_sim_vs_real")
    points = [point("alltoall", "allreduce", 0.100, 0.130), point("allgather", "allreduce", 0.120, 0.118)]
    pairs = v.speedups(points, tie=0.05)
    result = dict(v.summarize(points, pairs), profile=str(load_profile("local-cpu").name), points=points,
                  speedup_pairs=pairs, tie=0.05, repeats=2, median_run_to_run_spread=0.01)
    html = write_validation_report(result, tmp_path / "v.html").read_text()
    assert "<script src=" not in html and "Plotly" in html
    assert "dispatch off by +10.00 ms" in html  # the missed point says which stage and why
    assert "local-cpu" in html and "identity" in html


def test_a_missing_profile_is_one_line(tmp_path, repo_root, capsys, monkeypatch):
    v = load_experiment("validate_sim_vs_real")
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


def emulated_point(measured, simulated, spread=0.01, **knobs):
    p = {"grid": "emulated", "world": 8, "cluster": "2x2x2", "token_strategy": "alltoall", "expert_sync": "allreduce",
         "placement": "topology", "oversubscription": 1.0, "skew": 1.0, "shape": "256x128x1024x16"}
    p.update(knobs)
    p.update({"measured_step_s": measured, "simulated_step_s": simulated, "rel_error": (simulated - measured) / measured,
              "stages": {"dispatch": {"measured_s": 0.1, "simulated_s": 0.12, "error_s": 0.02}},
              "worst_stage": "dispatch", "run_to_run_spread": spread, "real_runs": ["r0", "r1"], "real_run": "r0",
              "sim_run": "s", "fitted_share": 0.1, "network_share": 0.8,
              "wire_bytes_by_level": {"leaf": {"measured": 1e6, "simulated": 1.02e6, "error": 0.02}},
              "utilization_by_level": {"leaf": {"measured": 0.5, "simulated": 0.52}}})
    return p


def test_emulated_pairs_are_one_knob_apart_and_scored_beyond_the_spread(repo_root):
    v = load_experiment("validate_sim_vs_real")
    base = emulated_point(1.0, 1.02)
    strided = emulated_point(1.5, 1.40, placement="strided")
    slow_spine = emulated_point(1.03, 1.0, oversubscription=4.0, spread=0.05)
    two_knobs = emulated_point(2.0, 2.0, placement="strided", oversubscription=4.0)
    pairs = v.knob_pairs([base, strided, slow_spine, two_knobs])
    by = {(q["knob"], q["a"], q["b"]): q for q in pairs}
    assert len(pairs) == 4  # base-strided, base-slow_spine, strided-two_knobs, slow_spine-two_knobs
    q = by[("placement", v._name(base), v._name(strided))]
    assert q["scored"] and q["agree"]
    assert q["measured_speedup"] == pytest.approx(1 / 1.5) and q["error_pp"] == pytest.approx(100 * abs(1.02 / 1.4 - 1 / 1.5))
    q = by[("oversubscription", v._name(base), v._name(slow_spine))]
    assert not q["scored"] and not q["agree"]  # 3% apart, within the 5% spread: not scored
    s = v.summarize_emulated([base, strided, slow_spine, two_knobs], pairs)
    assert s["speedup_direction_agreement"] == 1.0 and s["scored_pairs"] == 3
    assert s["max_wire_bytes_error"] == pytest.approx(0.02) and s["goals_met"]["max_wire_bytes_error"]
    assert s["max_abs_error"] == pytest.approx(0.1 / 1.5) and s["goals_met"]["max_abs_error"]
    assert s["median_abs_error"] == pytest.approx((0.02 + 0.03 / 1.03) / 2) and s["goals_met"]["median_abs_error"]


def test_emulated_report_names_goals_runs_and_shapes(tmp_path, repo_root):
    from testbed.validation_emulated import write_emulated_report

    v = load_experiment("validate_sim_vs_real")
    points = [emulated_point(1.0, 1.3), emulated_point(1.5, 1.4, placement="strided")]
    pairs = v.knob_pairs(points)
    result = dict(v.summarize_emulated(points, pairs), fabric="emulated", profile="emulated", points=points,
                  speedup_pairs=pairs, tie=0.05, repeats=2, median_run_to_run_spread=0.01)
    html = write_emulated_report(result, tmp_path / "e.html").read_text()
    assert "<script src=" not in html and "Plotly" in html
    assert "MISSED" in html and "dispatch off by +20.00 ms" in html  # the 30% miss says which stage
    assert "256x128x1024x16" in html and "r0, r1" in html and "placement" in html
    assert "Wire bytes per step and level" in html and "Stage times, measured / simulated" in html
    assert "100 / 120" not in html and "100.00 / 120.00" in html  # dispatch, measured / simulated ms
