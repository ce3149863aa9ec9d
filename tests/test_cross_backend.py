"""The testbed's central invariant: for the same routing, the real backend and the
simulator report the same bytes per stage and per link level (and page moves and drops),
and a real run's weights stay bit-identical to an unpaged copy whatever the pager did."""

import pytest

from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario


def scenario(tmp_path, token, sync, payload="model"):
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 64},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 2},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": "4KiB", "gpu_budget_bytes": "40KiB"},
        "heat": {"update_interval": 2, "window_steps": 2},
        "comm": {"token_strategy": token, "expert_sync": sync, "payload_dtype": payload},
        "workload": {"tokens_per_rank": 96},
        "run": {"steps": 5, "warmup_steps": 1, "output_dir": str(tmp_path)},
        "real": {"check_weights": True},  # every rank checks its pages each step
    })


@pytest.mark.parametrize("token, sync, payload", [
    ("alltoall", "two_stage", "model"), ("allgather", "allreduce", "model"), ("hierarchical", "two_stage", "model"),
    ("alltoall", "allreduce", "fp8"), ("allgather", "two_stage", "fp8"),  # M22: FP8 payloads, 1 byte per element
])
@pytest.mark.slow
def test_real_run_and_its_replay_move_the_same_bytes(tmp_path, token, sync, payload):
    s = scenario(tmp_path, token, sync, payload)
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    assert real["bytes_by_level"] == replay["bytes_by_level"]
    assert real["page_moves_per_step"] == replay["page_moves_per_step"] > 0
    assert real["dropped_token_fraction"] == replay["dropped_token_fraction"]
    assert real["group_cache_hit_rate"] == replay["group_cache_hit_rate"]
    assert real["bytes_by_level"]["spine"] > 0 and real["bytes_by_level"]["pcie"] > 0


@pytest.mark.slow
def test_measured_heat_all_reduce_is_planned(tmp_path):
    """With measured compute heat the ranks add up their kernel seconds at every heat
    update (every 2 steps here), those of the steps since the last one in one all-reduce;
    the planner plans it, so the heat stage moves the same bytes in the replay: per
    measured step (1-4), 2 steps' worth every other step. (Page moves may differ: the
    pager follows measured, not simulated, heat; so may the M20 probes' answers, 8 bytes
    per probed expert, fewer than L x E.)"""
    s = scenario(tmp_path, "alltoall", "allreduce").replace(heat={"compute_source": "measured"},
                                                            real={"check_weights": False})
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    world, experts, layers = s.world_size, s.model.num_experts, s.model.num_layers
    heat = 2 * (world - 1) * 2 * layers * experts * 8  # compute and memory heat (paged: M18)
    for side in (real, replay):
        assert heat <= side["bytes_by_stage"]["heat"] < heat + (world - 1) * layers * experts * 8
    for stage in ("dispatch", "combine", "expert_sync", "dense_sync"):
        assert real["bytes_by_stage"][stage] == replay["bytes_by_stage"][stage]


@pytest.mark.slow
def test_gloo_reduce_scatters_count_as_the_all_reduces_they_run(tmp_path):
    """allgather tokens: the combine is one reduce-scatter per EP group and layer of the
    P x T partial output rows; gloo all-reduces the whole input (``docs/bytes.md``), so it
    counts 2 (P-1) x its input, not a ring reduce-scatter's (P-1) x; the replay counts
    the same for the same library (the local-cpu profile's reduce_scatter = all_reduce)."""
    s = scenario(tmp_path, "allgather", "allreduce")
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    m, p = s.model, s.parallelism.ep_size
    rows = p * s.workload.tokens_per_rank  # each member's input: every member's tokens
    ring_all_reduce = 2 * (p - 1) * rows * m.hidden_size * m.dtype_bytes
    assert real["bytes_by_stage"]["combine"] == m.num_layers * (s.world_size // p) * ring_all_reduce
    assert replay["bytes_by_stage"]["combine"] == real["bytes_by_stage"]["combine"]
