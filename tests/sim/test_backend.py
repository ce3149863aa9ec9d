"""The simulator backend end to end: determinism, the real-vs-replay byte invariant's
sim half, stage accounting, and that a slower fabric slows the step."""

import json

import numpy as np
import pytest

from sim.backend import SimBackend
from testbed.core.stages import STAGES
from testbed.policy.workload import SyntheticWorkload
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario


def quick(tmp_path, **sections):
    data = {"run": {"steps": 4, "warmup_steps": 1, "output_dir": str(tmp_path)},
            "pager": {"page_size_bytes": "16KiB", "gpu_budget_bytes": "192KiB"},
            "heat": {"update_interval": 2, "window_steps": 4},
            "comm": {"expert_sync": "two_stage"}}
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return Scenario.from_dict(data)


def test_same_scenario_and_seed_give_identical_results(tmp_path):
    s = quick(tmp_path)
    a = [r.to_dict() for r in SimBackend().run(s).records]
    b = [r.to_dict() for r in SimBackend().run(s).records]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c = [r.to_dict() for r in SimBackend().run(s.replace(workload={"seed": 7})).records]
    assert json.dumps(a, sort_keys=True) != json.dumps(c, sort_keys=True)


def test_routing_drawn_ahead_is_the_workload_step_by_step(tmp_path):
    """The next step's counts are drawn in a thread while a step is simulated: the same
    counts as drawing them one step after the other."""
    s = quick(tmp_path)
    routed = SimBackend().run(s).routing.routed
    w = SyntheticWorkload(s)
    assert all(np.array_equal(routed[step], w.routed_counts(step)) for step in range(s.run.steps))


def test_stage_times_add_up_to_the_step(tmp_path):
    result = SimBackend().run(quick(tmp_path))
    for rec in result.records:
        assert set(rec.stage_time_s) == set(STAGES)
        total = sum(rec.stage_time_s.values())
        # stages partition every rank's step; ranks end together within a collective
        assert total == pytest.approx(rec.step_time_s, rel=0.05)
        assert rec.stage_time_s["dispatch"] > 0 and rec.stage_time_s["experts"] > 0


def test_replaying_its_own_trace_reproduces_the_run(tmp_path):
    s = quick(tmp_path)
    first = run_scenario(s, "sim")
    replay = run_scenario(s.replace(workload={"trace": first["run_dir"]}), "sim")
    assert replay["bytes_by_stage"] == first["bytes_by_stage"]
    assert replay["step_time_s"] == first["step_time_s"]


@pytest.mark.parametrize("token", ["alltoall", "allgather", "hierarchical"])
def test_every_token_strategy_runs_and_moves_tokens(tmp_path, token):
    b = run_scenario(quick(tmp_path, comm={"token_strategy": token}), "sim")["bytes_by_stage"]
    assert b["dispatch"] > 0
    if token == "allgather":  # metadata forward, probability gradients backward ride along
        assert b["dispatch"] > b["combine_backward"] and b["dispatch_backward"] > b["combine"]
    else:  # the same slots travel each way
        assert b["dispatch"] == b["combine_backward"] == b["combine"] == b["dispatch_backward"]


def test_a_slower_spine_slows_the_step(tmp_path, monkeypatch):
    base = run_scenario(quick(tmp_path), "sim")["step_time_s"]
    from sim.hardware import fabric

    real_build = fabric.build_fabric

    def degraded(scenario, profile):
        f = real_build(scenario, profile)
        f.set_capacity("spine", 0.05)
        return f

    monkeypatch.setattr("sim.backend.build_fabric", degraded)
    slow = run_scenario(quick(tmp_path, run={"seed": 1}), "sim")["step_time_s"]
    monkeypatch.undo()
    same_seed = run_scenario(quick(tmp_path, run={"seed": 1}), "sim")["step_time_s"]
    assert slow > 1.2 * same_seed and same_seed == pytest.approx(base, rel=0.5)


def test_trace_is_chrome_trace_json(tmp_path):
    summary = run_scenario(quick(tmp_path), "sim")
    with open(f"{summary['run_dir']}/trace.json") as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    counters = [e for e in events if e["ph"] == "C"]
    names = [e for e in events if e["ph"] == "M"]
    assert spans and all(e["dur"] > 0 and {"pid", "tid", "ts", "name"} <= set(e) for e in spans)
    assert {e["tid"] for e in spans} <= {"compute", "comm", "copy", "sync"}
    assert np.isfinite([e["ts"] for e in events if "ts" in e]).all()
    links = [e for e in counters if e["name"] == "link utilization"]
    assert links and all(set(e["args"]) == {"nvlink", "leaf", "spine"} for e in links)
    assert max(e["args"]["leaf"] for e in links) > 0 and all(0 <= v <= 1.0001 for e in links for v in e["args"].values())
    assert any(e["name"] == "memory" and e["args"]["GiB"] > 0 for e in counters)
    assert {e["args"]["name"] for e in names} >= {"GPU 0", "fabric"}
