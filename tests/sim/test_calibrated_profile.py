"""A calibrated profile: it round-trips, and the simulator follows what it measured."""

from dataclasses import replace

import numpy as np
import pytest

from real.calibrate import fit_alpha_beta, stage_calls
from sim.backend import ClusterSim, routing_source
from testbed.profile import Measured, load_profile, profile_from_dict, save_profile
from testbed.runner import run_scenario
from testbed.scenario import Scenario
from testbed.stages import STAGES

MEASURED = Measured(
    collectives=({"kind": "all_to_all_v", "group_size": 2, "world": 4, "latency_us": 900.0, "GBps": 0.5},
                 {"kind": "all_gather", "group_size": 4, "world": 4, "latency_us": 700.0, "GBps": 0.3}),
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
    # the measured all-gather of counts (700 us + bytes / 0.3 GB/s) replaces the link model
    assert b["stage_time_s"]["route"] - a["stage_time_s"]["route"] > 2 * 700e-6
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


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    rows = [{"kind": "all_reduce", "group_size": 2, "bytes": b, "seconds": 50e-6 + b / 2e9}
            for b in (4e3, 64e3, 1e6, 4e6)]
    (fit,) = fit_alpha_beta(rows, world=2)
    assert fit["latency_us"] == pytest.approx(50.0, rel=1e-6) and fit["GBps"] == pytest.approx(2.0, rel=1e-6)
