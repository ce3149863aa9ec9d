"""Small ops as the real backend runs them (and the simulator costs them): routed counts
within each EP group, refresh requests within replica groups, one active-group discovery
and one heat all-reduce per step, router gradients in buckets."""

import pytest
import torch

from testbed.policy.planner import Planner
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario


def scenario(tmp_path, ep):
    # 4 ranks (2 nodes of 2 in 2 micro-clusters); few tokens for many experts, so EP
    # groups leave experts unused and two-stage sync leaves replicas stale
    return Scenario.from_dict({
        "model": {"hidden_size": 16, "ffn_hidden_size": 16, "num_experts": 16, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 2},
        "parallelism": {"ep_size": ep},
        "comm": {"expert_sync": "two_stage"},
        "heat": {"update_interval": 2, "window_steps": 2},
        "workload": {"tokens_per_rank": 4},
        "run": {"steps": 4, "warmup_steps": 0, "output_dir": str(tmp_path)},
        "real": {"check_weights": True},
    })


@pytest.mark.slow
def test_counts_travel_within_ep_groups_and_the_replay_moves_the_same_bytes(tmp_path):
    s = scenario(tmp_path, 2)
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    # route: 2 EP groups of 2, E int32 each, per layer; the old world-wide all-gather moved 4 x 3 x E x 4
    m = s.model
    assert real["bytes_by_stage"]["route"] == m.num_layers * 2 * (2 * 1 * m.num_experts * 4)
    # once per step: discovery, L x E bits from each of 4 ranks to the 3 others
    (discovery,) = Planner(s).discovery_ops()
    assert discovery.wire_bytes == 4 * 3 * (m.num_layers * m.num_experts // 8)
    # once per heat update (every 2 steps): 2 steps of L x E float64 compute and memory heat
    # (each GPU's pager counts its own accesses, M18), all-reduced; and the answers of the
    # probed experts (M20: 8 bytes each, fewer than L x E)
    heat = 2 * 3 * (2 * 2 * m.num_layers * m.num_experts * 8) / 2
    assert heat <= real["bytes_by_stage"]["heat"] < heat + 2 * 3 * (m.num_layers * m.num_experts * 8) / 2


@pytest.mark.slow
def test_stale_replicas_are_refreshed_from_replicas_that_are_up_to_date(tmp_path):
    """EP 1: 4 replicas of every expert; under two-stage sync a stale replica needed by
    several ranks in one layer is sent by a replica that was up to date before the layer,
    never by one that is receiving it in the same layer (that one would send its stale
    copy; its pager refuses). Afterwards every up-to-date replica holds the same weights."""
    from real.backend import RealBackend

    s = scenario(tmp_path, 1)
    result = RealBackend().run(s, debug={"capture": True})
    assert sum(r.bytes_by_stage.get("paging", 0) for r in result.records) > 0  # refreshes happened
    finals: dict[int, list[torch.Tensor]] = {}
    for cap in result.captured:
        for inst, w in cap["final_experts"].items():
            finals.setdefault(inst, []).append(w)
    assert finals and all(torch.equal(ws[0], w) for ws in finals.values() for w in ws[1:])
