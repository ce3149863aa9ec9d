"""The validation experiment's scoring and report, and a real calibration at 2 ranks."""


import pytest

from testbed.report.validation import write_validation_report
from testbed.scenario.profile import load_profile
from testbed.study.experiments import load_experiment


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


@pytest.mark.slow
def test_calibrate_two_ranks_writes_a_usable_profile(tmp_path):
    from real.calibrate.tool import calibrate

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
    # what calibration did is recorded: device, network, every scenario whose runs it fitted
    cal = p.calibration
    assert (cal.made_by_calibrate, cal.device, cal.fabric, cal.quick) == (True, "cpu", "loopback", True)
    assert len(cal.scenarios) == 10  # 4 strategy pairs x 2 shapes, and both shapes as a whole transformer
    assert {r["world"] for r in cal.scenarios} == {2}
    assert {(r["hidden"], r["tokens_per_rank"]) for r in cal.scenarios} == {(96, 256), (192, 640)}
    # every GEMM kind measured, no placeholder peak kept from the base profile
    base = load_profile("local-cpu")
    assert p.compute.peak_tflops.bf16 != base.compute.peak_tflops.bf16
    assert p.compute.efficiency.dense != base.compute.efficiency.dense
    for key in ("compute.peak_tflops.bf16", "compute.efficiency.dense", "compute.efficiency.attention", "copy.table"):
        assert p.source_of(key).startswith("measured by testbed calibrate"), key


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
    from testbed.report.validation_emulated import write_emulated_report

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


# ---- the out-of-sample promise, in code (issue 22, item 8) -----------------------------
def calibrated_profile(tmp_path, name="cal", device="cpu", fabric="loopback", gpu="", scenarios=()):
    """local-cpu marked as made by testbed calibrate on ``device`` over ``fabric``."""
    from dataclasses import replace

    from testbed.scenario.profile import CALIBRATE_TOOL, Calibration, save_profile

    cal = Calibration(tool=CALIBRATE_TOOL, device=device, fabric=fabric, gpu=gpu, scenarios=tuple(scenarios))
    return str(save_profile(replace(load_profile("local-cpu"), name=name, calibration=cal), tmp_path / f"{name}.toml"))


def calibration_rows(worlds=(2, 4)):
    from real.calibrate.tool import calibration_scenarios, scenario_name
    from testbed.run.sources import scenario_record

    return [scenario_record(scenario_name(s), s) for w in worlds for s in calibration_scenarios(w, "runs")]


@pytest.fixture
def no_runs(monkeypatch):
    """The validation must refuse before it runs anything: running is an error here."""
    v = load_experiment("validate_sim_vs_real")

    def refuse_to_run(*args, **kwargs):
        raise AssertionError("the validation started its runs")

    monkeypatch.setattr(v, "run_sweep", refuse_to_run)
    return v


def test_an_uncalibrated_profile_is_refused_unless_allowed(tmp_path, capsys, no_runs):
    v = no_runs
    assert v.main(["--quick", "--profile", "local-cpu", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not made by testbed calibrate" in err[0] and "--allow-uncalibrated" in err[0]
    grid = v.cpu_grid(True, str(tmp_path), "local-cpu")
    check = v.provenance("CPU grids", "local-cpu", grid, "cpu", "loopback", allow=True)
    assert "not made by testbed calibrate (allowed by --allow-uncalibrated)" in check["made"]
    assert not check["calibrated"] and check["shared"] == []
    assert "not checked" in check["out_of_sample"]


def test_the_gpu_grid_refuses_a_profile_not_calibrated_on_a_gpu(tmp_path, capsys, monkeypatch, no_runs):
    v = no_runs
    monkeypatch.setattr(v, "gpus_here", lambda: 1)
    monkeypatch.setattr(v.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    cpu = calibrated_profile(tmp_path, scenarios=calibration_rows())
    for extra in ([], ["--allow-uncalibrated"]):
        assert v.main(["--quick", "--profile", cpu, "--gpu-profile", cpu, "--output-dir", str(tmp_path)] + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--gpu-profile" in err[0] and "calibrated on cpu" in err[0] and "cuda" in err[0]
    other = calibrated_profile(tmp_path, "a100", device="cuda", fabric="device", gpu="NVIDIA A100")
    assert v.main(["--quick", "--profile", cpu, "--gpu-profile", other, "--output-dir", str(tmp_path)]) == 2
    assert "NVIDIA A100" in capsys.readouterr().err
    gpu = calibrated_profile(tmp_path, "gpu", device="cuda", fabric="device", gpu="NVIDIA H200")
    with pytest.raises(AssertionError, match="started its runs"):  # both profiles pass: the runs would start
        v.main(["--quick", "--profile", cpu, "--gpu-profile", gpu, "--output-dir", str(tmp_path)])
    with pytest.raises(AssertionError, match="started its runs"):  # no GPU profile: the CPU grids alone, said so
        v.main(["--quick", "--profile", cpu, "--gpu-profile", "no-such", "--output-dir", str(tmp_path)])
    assert "left out the GPU grid: no profile no-such (testbed calibrate --device cuda" in capsys.readouterr().err
    # a GPU profile on the CPU grids is refused too
    assert v.main(["--quick", "--profile", gpu, "--output-dir", str(tmp_path)]) == 2
    assert "calibrated on cuda" in capsys.readouterr().err


def test_a_loopback_profile_cannot_judge_the_emulated_grid(tmp_path, no_runs):
    from testbed.core.errors import ScenarioError

    v = no_runs
    loopback = calibrated_profile(tmp_path)
    grid = v.emulated_grid(True, str(tmp_path), loopback)
    with pytest.raises(ScenarioError, match="loopback network"):
        v.provenance("emulated grid", loopback, grid, "cpu", "emulated", allow=False)


def test_a_point_sharing_a_calibration_shape_and_token_count_is_refused(tmp_path, capsys, no_runs):
    v = no_runs
    grid = v.cpu_grid(True, str(tmp_path), "local-cpu")
    from testbed.run.sources import scenario_record

    own = grid[0][1].replace(comm={"token_strategy": "allgather"})
    same = scenario_record("fitted on the validation's own shape", own)
    cal = calibrated_profile(tmp_path, scenarios=calibration_rows() + [same])
    assert v.main(["--quick", "--profile", cal, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "shares the model shape and token count (128x256x8 top-2, 512 tokens a rank)" in err
    assert "fitted on the validation's own shape" in err
    # another token count is another shape: out of sample
    other = dict(same, tokens_per_rank=640)
    check = v.provenance("CPU grids", calibrated_profile(tmp_path, scenarios=calibration_rows() + [other]), grid,
                         "cpu", "loopback", allow=False)
    assert check["out_of_sample"].startswith("No point shares a model shape and token count")
    assert "128x256x8 top-2, 640 tokens a rank" in check["out_of_sample"]


def test_the_report_states_what_calibration_and_validation_share(tmp_path, no_runs):
    v = no_runs
    cal = calibrated_profile(tmp_path, scenarios=calibration_rows())
    grid = v.cpu_grid(True, str(tmp_path), cal) + v.whole_grid(True, str(tmp_path), cal)
    check = v.provenance("CPU grids", cal, grid, "cpu", "loopback", allow=False)
    shared = "; ".join(check["shared"])
    assert "world size 2, 4" in shared and "EP size 2" in shared and "layers 2" in shared
    assert "token strategy allgather, alltoall, hierarchical" in shared and "expert sync allreduce, two_stage" in shared
    assert "cluster (GPUs per node x nodes per micro-cluster x micro-clusters) 2x1x1, 2x2x1" in shared
    # calibration's whole transformer runs sequences of 64, validation's 128: only the MoE stack alone is shared
    assert "sequence length none (the MoE stack alone);" in shared and "64" not in shared and "128" not in shared
    assert "top-k 2" in shared and "hidden size" not in shared and "tokens per rank" not in shared
    assert "made by testbed calibrate on cpu over the loopback network, fitting the real runs of 20" in check["made"]
    points = [point("alltoall", "allreduce", 0.100, 0.130), point("allgather", "allreduce", 0.120, 0.118)]
    pairs = v.speedups(points, tie=0.05)
    result = dict(v.summarize(points, pairs), profile=cal, points=points, speedup_pairs=pairs, tie=0.05, repeats=2,
                  median_run_to_run_spread=0.01, provenance=[check])
    html = write_validation_report(result, tmp_path / "v.html").read_text()
    assert "world size 2, 4" in html and "No point shares a model shape and token count" in html
    assert "none of these points was used to fit it" not in html and "the only fitted collective figures" not in html


def test_the_why_of_a_missed_point_is_computed_from_its_stage_errors():
    from testbed.report.validation import miss_reason

    a = point("alltoall", "allreduce", 0.100, 0.130)
    a["stages"] = {"dispatch": {"measured_s": 0.010, "simulated_s": 0.034, "error_s": 0.024},
                   "experts": {"measured_s": 0.050, "simulated_s": 0.056, "error_s": 0.006}}
    b = dict(a, stages={"dispatch": {"measured_s": 0.010, "simulated_s": 0.040, "error_s": 0.030}},
             run_to_run_spread=0.08)
    why_a, why_b = miss_reason(a, 0.1), miss_reason(b, 0.1)
    assert why_a.startswith("dispatch off by +24.00 ms (34.00 vs 10.00 ms, simulated longer, +240% of the stage)")
    assert "80% of the stages' summed |error| of 30.00 ms" in why_a and "next experts +6.00 ms" in why_a
    assert "step error +30.0% against a run-to-run spread of 1.0%" in why_a
    assert "100% of the stages' summed |error|" in why_b and "next" not in why_b and "spread of 8.0%" in why_b
    for why in (why_a, why_b):  # no fixed sentence per stage
        assert "TCP shares the links" not in why and "max-min model" not in why
    assert miss_reason(point("alltoall", "allreduce", 0.100, 0.105), 0.1) == ""  # within the goal: nothing to say


def test_the_report_opens_with_what_its_points_show(tmp_path, repo_root):
    from testbed.report.validation import validation_findings
    v = load_experiment("validate_sim_vs_real")
    points = [point("alltoall", "allreduce", 0.100, 0.130), point("allgather", "allreduce", 0.120, 0.118),
              point("hierarchical", "allreduce", 0.200, 0.190)]
    pairs = v.speedups(points, tie=0.05)
    result = dict(v.summarize(points, pairs), profile="local-cpu", points=points, speedup_pairs=pairs, tie=0.05,
                  repeats=2, median_run_to_run_spread=0.01)
    found = validation_findings(result)
    assert found[0].startswith("Over 3 points the simulated step is off by 5.0% at the median (goal 10%) and by "
                               "+30.0% at worst, at ")
    assert found[0].endswith("against a measured run-to-run spread of 1.0%.")
    assert found[1] == "2 of 3 points are under-predicted, 1 over-predicted."
    # alltoall is faster than allgather as measured (100 against 120 ms), slower as simulated (130 against 118)
    assert found[2] == "The simulator orders 2 of 3 scored speedup pairs as measured."
    points[0]["rel_error"] = -0.01
    assert validation_findings(result)[1] == "Every point is under-predicted: the error is a bias, not noise."
    html = write_validation_report(result, tmp_path / "v.html").read_text()
    assert '<div class="findings"><p>Over 3 points' in html
