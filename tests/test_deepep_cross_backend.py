"""deepep on both backends (``comm.token_strategy = "deepep"``): real CPU ranks count the
same bytes per stage and link level as the simulator's replay of their routing (its
fanout included: deepep's rows are tokens, not slots), with model and FP8 payloads,
and the small CPU config (configs/deepep-cpu.toml) runs on both."""

import pytest

from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario


def scenario(tmp_path, payload="model", sync="two_stage"):
    # 2 micro-clusters of one node of 2: EP 4 spans both nodes (hop and forward), 2 replicas
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 64},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 4},
        "parallelism": {"ep_size": 4},
        "pager": {"page_size_bytes": "4KiB", "gpu_budget_bytes": "40KiB"},
        "heat": {"update_interval": 2, "window_steps": 2},
        "comm": {"token_strategy": "deepep", "expert_sync": sync, "payload_dtype": payload},
        "workload": {"tokens_per_rank": 96},
        "run": {"steps": 4, "warmup_steps": 1, "output_dir": str(tmp_path)},
        "real": {"check_weights": True},
    })


@pytest.mark.slow
@pytest.mark.parametrize("payload", ["model", "fp8"])
def test_real_deepep_and_its_replay_move_the_same_bytes(tmp_path, payload):
    s = scenario(tmp_path, payload)
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    assert real["bytes_by_level"] == replay["bytes_by_level"]
    assert real["page_moves_per_step"] == replay["page_moves_per_step"]
    assert real["bytes_by_level"]["spine"] > 0 and real["bytes_by_level"]["nvlink"] > 0
    # the replay used the real run's fanout: the one modelled from counts moves other bytes
    modelled = run_scenario(s, "sim")
    assert modelled["bytes_by_stage"]["dispatch"] != real["bytes_by_stage"]["dispatch"]


@pytest.mark.slow
def test_the_deepep_cpu_config_runs_on_both_backends(tmp_path, repo_root):
    s = load_scenario(repo_root / "configs" / "deepep-cpu.toml", [f"run.output_dir={tmp_path}"])
    assert s.comm.token_strategy == "deepep"
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    assert real["bytes_by_level"] == replay["bytes_by_level"]
    assert run_scenario(s, "sim")["bytes_by_stage"]["dispatch"] > 0
