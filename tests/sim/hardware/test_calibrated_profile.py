"""A calibrated profile: it round-trips, and the simulator follows what it measured."""

from dataclasses import replace

import numpy as np
import pytest

from real.calibrate.latency_fit import fit_software_latency
from real.calibrate.tool import COMM_STAGES, fit_host_costs, stage_calls
from sim.backend import ClusterSim, routing_source
from sim.hardware.compute import contention_factor
from sim.hardware.software_latency import SoftwareLatency, stage_host_seconds
from testbed.core.stages import STAGES
from testbed.run.runner import run_scenario
from testbed.scenario.profile import Measured, load_profile, profile_from_dict, save_profile
from testbed.scenario.scenario import Scenario

MEASURED = Measured(
    collective_latency=({"world": 4, "call_us": 700.0, "step_us": 300.0}, {"world": 2, "call_us": 5.0, "step_us": 1.0}),
    compute_scale=({"world": 4, "factor": 3.0},),
    stage_us=({"world": 4, "stage": "route", "variant": "", "us": 1500.0, "us_per_MB": 200.0},
              {"world": 4, "stage": "dispatch", "variant": "alltoall", "us": 400.0, "us_per_MB": 0.0},
              {"world": 4, "stage": "dispatch", "variant": "allgather", "us": 9000.0, "us_per_MB": 0.0}))


def scenario(tmp_path, profile, **comm):
    return Scenario.from_dict({
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1, "profile": str(profile)},
        "parallelism": {"ep_size": 2}, "comm": comm,
        "run": {"steps": 3, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")}})


@pytest.fixture
def profiles(tmp_path):
    base = load_profile("local-cpu")
    plain = save_profile(base, tmp_path / "plain.toml")
    calibrated = save_profile(replace(base, name="cal", measured=MEASURED), tmp_path / "cal.toml")
    return plain, calibrated


def test_a_calibrated_profile_round_trips(profiles):
    _, path = profiles
    p = load_profile(path)
    assert p.measured == MEASURED
    assert profile_from_dict(p.to_dict()) == p
    save_profile(p, path.with_name("again.toml"))
    assert path.with_name("again.toml").read_text() == path.read_text()


def test_the_simulator_follows_the_measured_profile(tmp_path, profiles):
    plain, calibrated = profiles
    a = run_scenario(scenario(tmp_path, plain), "sim")
    b = run_scenario(scenario(tmp_path, calibrated), "sim")
    assert b["step_time_s"] > a["step_time_s"]
    assert b["bytes_by_stage"] == a["bytes_by_stage"]  # time changes, traffic does not
    # route: 1,500 us fixed per layer call + 200 us per MB of tokens, plus the counts all-gather
    tokens_mb = 256 * 64 * 4 / 1e6
    assert b["stage_time_s"]["route"] >= 2 * (1500 + 200 * tokens_mb) * 1e-6
    # the counts all-gather of 4 ranks pays the fitted library latency of world 4: 700 us a
    # call and 300 us for each of its 3 ring steps, per layer (the profile's own is 75 us a call)
    counts_s = 700e-6 + 3 * 300e-6
    assert b["stage_time_s"]["route"] - a["stage_time_s"]["route"] > 2 * (counts_s - 75e-6 - 3 * 10e-6)
    # ... and is counted as fitted; the plain profile has nothing fitted
    assert a["fitted_share"] == 0 and 0.2 < b["fitted_share"] < 1
    # experts compute 3x slower with 4 ranks busy
    assert b["stage_time_s"]["experts"] == pytest.approx(3 * a["stage_time_s"]["experts"], rel=1e-6)
    # the host cost of the scenario's own token strategy is used
    c = run_scenario(scenario(tmp_path, calibrated, token_strategy="allgather"), "sim")
    assert c["stage_time_s"]["dispatch"] > 2 * 9000e-6


def test_host_calls_counted_by_calibration_match_the_simulator(tmp_path, profiles):
    """The calibration divides a stage's residual by stage_calls(); the simulator adds the
    host cost once per call: both must count the same calls."""
    s = scenario(tmp_path, profiles[0])
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    sim.builder.host_s = {st: (1.0, 0.0) for st in STAGES}  # 1 s per call: count them
    sim.step(0, routing_source(s)(0), [])
    phases = sim.builder.phases
    calls = stage_calls(s)
    for st in STAGES:
        host = [p for p in phases if p.stage == st and p.kind == "compute" and np.all(p.seconds == 1.0)]
        assert len(host) == calls[st], st


def test_software_latency_fit_recovers_call_and_step_costs():
    """Tiny collectives of every kind: seconds = call + steps x (step + hop latency)."""
    prof = load_profile("local-cpu")  # 5 us per link: a hop within a node is 10 us
    cluster = Scenario.from_dict({"cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 1, "microclusters": 1},
                                  "parallelism": {"ep_size": 1}}).cluster
    steps = {"all_to_all_v": lambda p: p - 1, "all_gather": lambda p: p - 1, "all_reduce": lambda p: 2 * (p - 1),
             "reduce_scatter": lambda p: 2 * (p - 1)}  # gloo: an all-reduce
    rows = [{"kind": k, "group_size": p, "members": tuple(range(p)),
             "seconds": 400e-6 + n(p) * 150e-6 + (1 if k == "all_to_all_v" else n(p)) * 10e-6}
            for k, n in steps.items() for p in (2, 4)]
    fit = fit_software_latency(rows, 4, cluster, prof)
    assert fit["world"] == 4
    assert fit["call_us"] == pytest.approx(400.0, rel=1e-6) and fit["step_us"] == pytest.approx(150.0, rel=1e-6)


def test_host_costs_of_communication_stages_are_fixed_only():
    """A cost per byte in a communication stage would stand in for the network model."""
    points = {("dispatch", "alltoall"): [(1e5, 1e-3), (4e5, 2e-3)], ("experts", ""): [(1e5, 1e-3), (4e5, 2e-3)]}
    rows = {r["stage"]: r for r in fit_host_costs(points, world=4)}
    assert "dispatch" in COMM_STAGES and "experts" not in COMM_STAGES
    assert rows["dispatch"]["us_per_MB"] == 0 and rows["dispatch"]["us"] == pytest.approx(1500.0)
    assert rows["experts"]["us_per_MB"] == pytest.approx(1e-3 / 3e5 * 1e12)


# ---- a measured table applies at the world it was measured at; elsewhere the model, fitted --
def calibrated(**measured):
    return replace(load_profile("local-cpu"), name="cal", measured=Measured(**measured))


def cluster(nodes: int, microclusters: int = 1, profile="local-cpu") -> Scenario:
    return Scenario.from_dict({
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": nodes, "microclusters": microclusters,
                    "profile": str(profile)}, "parallelism": {"ep_size": 2}})


def test_library_latency_is_measured_only_at_its_world_and_a_fitted_line_elsewhere():
    """Rows at worlds 2 and 4 (5 / 1 us and 700 / 300 us): world 4 takes its row; world 8
    and world 3 the least-squares line through both (the nearest row would give 700 / 300
    at 8 and 5 / 1 at 3). All of it counts as fitted."""
    prof = calibrated(collective_latency=MEASURED.collective_latency)
    at4 = SoftwareLatency(prof, 4)
    assert (at4.call_s, at4.step_s, at4.fitted, at4.measured_here) == (pytest.approx(700e-6), pytest.approx(300e-6),
                                                                       True, True)
    at8 = SoftwareLatency(prof, 8)
    assert at8.call_s == pytest.approx((5 + 695 / 2 * 6) * 1e-6) and at8.step_s == pytest.approx((1 + 299 / 2 * 6) * 1e-6)
    assert at8.fitted and not at8.measured_here and "least-squares" in at8.source
    at3 = SoftwareLatency(prof, 3)
    assert at3.call_s == pytest.approx(352.5e-6) and at3.step_s == pytest.approx(150.5e-6)
    # a fitted line never gives a negative cost
    assert SoftwareLatency(prof, 1).call_s == 0.0


def test_one_measured_world_extrapolates_as_its_constant_and_is_counted_as_fitted():
    prof = calibrated(collective_latency=({"world": 8, "call_us": 2000.0, "step_us": 400.0},))
    lat = SoftwareLatency(prof, 16)
    assert (lat.call_s, lat.step_s) == (pytest.approx(2000e-6), pytest.approx(400e-6))
    assert lat.fitted and not lat.measured_here and "constant of world 8" in lat.source
    assert not SoftwareLatency(load_profile("local-cpu"), 16).fitted


def test_compute_contention_is_measured_only_at_its_world():
    """One row (world 4: 3x): ranks per core with the cores fitted to it (4 / 3 cores), so
    6x at world 8 and 1.5x at world 2, never below 1; several rows: their least-squares line."""
    one = calibrated(compute_scale=({"world": 4, "factor": 3.0},))
    assert contention_factor(one, 4) == 3.0
    assert contention_factor(one, 8) == pytest.approx(6.0) and contention_factor(one, 2) == pytest.approx(1.5)
    assert contention_factor(one, 1) == 1.0
    two = calibrated(compute_scale=({"world": 2, "factor": 1.2}, {"world": 4, "factor": 2.0}))
    assert contention_factor(two, 2) == 1.2 and contention_factor(two, 8) == pytest.approx(3.6)
    measured_below_one = calibrated(compute_scale=({"world": 2, "factor": 0.97},))
    assert contention_factor(measured_below_one, 2) == 0.97  # a measurement stays a measurement


def test_host_costs_are_measured_only_at_their_world():
    """stage_us rows of route at worlds 2 and 4: world 8 gets their line, not world 4's row;
    an entry measured at one world only keeps its constant."""
    rows = MEASURED.stage_us + ({"world": 2, "stage": "route", "variant": "", "us": 500.0, "us_per_MB": 100.0},)
    prof = calibrated(stage_us=rows)
    at4 = stage_host_seconds(prof, cluster(2))
    assert at4["route"] == (pytest.approx(1500e-6), pytest.approx(200e-12))
    at8 = stage_host_seconds(prof, cluster(2, 2))
    assert at8["route"] == (pytest.approx(3500e-6), pytest.approx(400e-12))
    assert at8["dispatch"] == (pytest.approx(400e-6), 0.0)  # alltoall: the scenario's strategy, one world
    allgather = stage_host_seconds(prof, cluster(2, 2).replace(comm={"token_strategy": "allgather"}))
    assert allgather["dispatch"][0] == pytest.approx(9000e-6)


def test_the_simulator_uses_the_fitted_model_away_from_the_measured_world(tmp_path):
    """A profile measured at worlds 2 and 4, simulated at world 8: library latency, compute
    contention and host costs all come from the fits, not from world 4's rows."""
    rows = MEASURED.stage_us + ({"world": 2, "stage": "route", "variant": "", "us": 500.0, "us_per_MB": 100.0},)
    path = save_profile(calibrated(collective_latency=MEASURED.collective_latency,
                                   compute_scale=MEASURED.compute_scale, stage_us=rows), tmp_path / "cal.toml")
    s = cluster(2, 2, path)
    sim = ClusterSim(s, load_profile(path))
    assert sim.collectives.software.call_s == pytest.approx(2090e-6)
    assert sim.builder.compute.scale == pytest.approx(6.0)
    assert sim.builder.host_s["route"][0] == pytest.approx(3500e-6)
