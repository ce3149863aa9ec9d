"""M10 discovery's cost on both backends: the all-gather of every rank's kept-expert bit
masks is timed (``discovery_s``), where it runs and only there."""

import pytest

from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario


def scenario(tmp_path, ep=2):
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 8, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 2},
        "parallelism": {"ep_size": ep},
        "comm": {"expert_sync": "two_stage"},
        "pager": {"enabled": False},
        "workload": {"tokens_per_rank": 32},
        "run": {"steps": 3, "warmup_steps": 1, "output_dir": str(tmp_path)},
    })


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sim", "real"])
def test_discovery_is_timed_where_it_runs(tmp_path, backend):
    """With 2 replicas every step discovers the active groups: a positive time, a small
    share of the step; with one replica (EP = the world) none runs: no time."""
    replicated = run_scenario(scenario(tmp_path), backend)
    assert 0 < replicated["discovery_s"] < 0.5 * replicated["step_time_s"]
    assert run_scenario(scenario(tmp_path, ep=4), backend)["discovery_s"] is None


def test_the_simulated_discovery_is_its_all_gather(tmp_path):
    """On the simulator discovery_s is the bit-mask all-gather's time: longer on a
    slower network (the a100-seed profile's latencies against local-cpu's)."""
    fast = run_scenario(scenario(tmp_path).replace(cluster={"profile": "h200"}), "sim")["discovery_s"]
    slow = run_scenario(scenario(tmp_path).replace(cluster={"profile": "local-cpu"}), "sim")["discovery_s"]
    assert fast != slow and min(fast, slow) > 0
