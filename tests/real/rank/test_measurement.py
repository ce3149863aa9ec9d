"""Measurement: compute heat from measured expert kernel time (M18), summed over every
rank so that every rank's controller decides alike; a torch.profiler trace per rank
beside the run; per-stage times; frozen (cold) experts stay routable (M19)."""

import json

import pytest

from real.backend import RealBackend
from testbed.scenario.scenario import Scenario


@pytest.mark.slow
def test_measured_heat_and_profiler_traces(tmp_path):
    s = Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 64},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": "4KiB", "gpu_budget_bytes": "40KiB", "cold_consecutive_updates": 1},
        "heat": {"update_interval": 2, "window_steps": 2, "compute_source": "measured"},
        "comm": {"expert_sync": "two_stage"},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 5, "warmup_steps": 3, "output_dir": str(tmp_path)},
        "real": {"check_weights": True, "profile": True},
    })
    result = RealBackend().run(s, run_dir=tmp_path, debug={"capture": True})
    states = [cap["heat_states"] for cap in result.captured]
    assert all((st == states[0]).all() for st in states)  # one controller state everywhere
    updates = [r.expert_states for r in result.records if r.expert_states]
    assert updates and any(u["cold"] > 0 for u in updates)  # frozen experts, routed to again
    for r in result.records:
        # the all-reduce of measured seconds runs (and is counted) at heat updates only
        assert (r.bytes_by_stage.get("heat", 0) > 0) == (r.step % 2 == 1)
        assert r.stage_time_s["experts"] > 0 and r.stage_time_s["experts_backward"] > 0
    for rank in range(4):
        trace = json.loads((tmp_path / f"torch_trace_rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "step 3" in names and "step 4" in names and "step 2" not in names  # after warm-up only
