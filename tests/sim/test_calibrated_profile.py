"""A calibrated profile: it round-trips, and the simulator follows what it measured."""

from dataclasses import replace

import numpy as np
import pytest

from real.calibrate import COMM_STAGES, fit_host_costs, fit_software_latency, stage_calls
from sim.backend import ClusterSim, routing_source
from testbed.profile import Measured, load_profile, profile_from_dict, save_profile
from testbed.runner import run_scenario
from testbed.scenario import Scenario
from testbed.stages import STAGES

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
