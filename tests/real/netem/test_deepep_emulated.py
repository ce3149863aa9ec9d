"""deepep on the emulated cluster (real.network = emulated): the kernel's counters measure
the cut in leaf traffic that sending a token once per node, not once per slot, makes
against the flat all-to-all, and the simulator's replays of both runs predict it within
5%. Needs root, like the other emulated tests (it makes network namespaces)."""

import json

import pytest

from real.netem import privileges_missing
from real.netem.nsenter import existing_namespaces
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

REASON = privileges_missing()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster: {REASON}")

#: 8 ranks, 2 per node, 2 nodes per micro-cluster: an EP group of 4 is one leaf's two nodes
#: (its tokens cross the leaf), the replicas sit in the other micro-cluster (the sync crosses the spine);
#: top-4 of 8 experts, so most tokens have several slots on the other node
CLUSTER = {
    "model": {"hidden_size": 128, "ffn_hidden_size": 64, "num_layers": 2, "num_experts": 8, "top_k": 4},
    "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 2, "profile": "emulated"},
    "parallelism": {"ep_size": 4},
    "pager": {"enabled": False},
    "workload": {"tokens_per_rank": 512},
    "real": {"network": "emulated"},
    "run": {"steps": 3, "warmup_steps": 1},
}


def scenario(tmp_path, token: str) -> Scenario:
    data = json.loads(json.dumps(CLUSTER))
    data["run"]["output_dir"] = str(tmp_path / "runs")
    data["comm"] = {"token_strategy": token}
    return Scenario.from_dict(data)


@pytest.fixture
def no_new_namespaces():
    before = set(existing_namespaces())
    yield
    left = set(existing_namespaces()) - before
    assert not left, f"left behind: {sorted(left)}"


@pytest.mark.slow
@needs_root
def test_the_wire_shows_deepeps_cut_in_leaf_traffic_as_the_simulator_predicts(tmp_path, no_new_namespaces):
    measured, predicted = {}, {}
    for token in ("alltoall", "deepep"):
        s = scenario(tmp_path, token)
        real = run_scenario(s, "real")
        sim = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
        assert sim["bytes_by_level"] == real["bytes_by_level"]  # the same plan, deepep's fanout included
        measured[token] = real["wire_bytes_by_level"]["leaf"]
        predicted[token] = sim["wire_bytes_by_level"]["leaf"]
        # each run's leaf bytes on the wire as the simulator's network carries them (headers, acknowledgements)
        assert predicted[token] == pytest.approx(measured[token], rel=0.05), token
    cut_measured = 1 - measured["deepep"] / measured["alltoall"]
    cut_predicted = 1 - predicted["deepep"] / predicted["alltoall"]
    assert cut_measured > 0.2  # top-4 of 8: a token's slots on the other node cross it once
    assert cut_measured == pytest.approx(cut_predicted, rel=0.05)
