"""M22's local-first routing bias (``router.local_bias``): a bias on the gate logits of the
experts whose replica sits in the token's node moves traffic off the NICs, on both
backends, and the real ranks still compute what the formulas say."""

import numpy as np
import pytest
import torch

from real.backend import RealBackend
from real.rank.reference import reference_step
from testbed.policy.workload import SyntheticWorkload
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


def scenario(tmp_path, bias, scope="node", steps=3, warmup=1):
    """4 ranks, 2 per node, one EP group of 4: half of each rank's experts are on its node."""
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 8, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 2},
        "parallelism": {"ep_size": 4},
        "router": {"local_bias": bias, "local_scope": scope, "capacity_factor": 1.25},
        "pager": {"enabled": False},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": steps, "warmup_steps": warmup, "output_dir": str(tmp_path)},
    })


def test_local_experts_are_those_on_the_tokens_node():
    lay = Layout(scenario("/tmp", 1.0))
    mask = lay.local_expert_mask("node")
    for r in range(4):
        for e in range(8):
            assert mask[r, e] == (lay.node(lay.expert_rank(int(lay.group_of[r]), e)) == lay.node(r))
    assert mask.sum(axis=1).tolist() == [4, 4, 4, 4]
    assert lay.local_expert_mask("microcluster").sum(axis=1).tolist() == [4, 4, 4, 4]  # a node per micro-cluster


def test_the_simulated_router_picks_a_local_expert_e_to_the_bias_times_as_often(tmp_path):
    """The workload's routing popularity: each rank's local experts weighted e^b against
    the others, the data's popularity unchanged."""
    plain, biased = (SyntheticWorkload(scenario(tmp_path, b)) for b in (0.0, 1.5))
    p, q = plain.routing_popularity(2), biased.routing_popularity(2)
    assert np.array_equal(plain.popularity(2), biased.popularity(2))
    local = Layout(scenario(tmp_path, 1.5)).local_expert_mask()
    for r in range(4):
        change = q[:, r] / p[:, r]
        ratio = change / change[:, np.flatnonzero(~local[r])[:1]]  # against one of its non-local experts
        assert np.allclose(ratio[:, local[r]], np.exp(1.5)) and np.allclose(ratio[:, ~local[r]], 1.0)
    assert np.allclose(q.sum(axis=2), 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sim", "real"])
def test_a_local_first_bias_moves_token_bytes_from_the_spine_to_nvlink(tmp_path, backend):
    plain = run_scenario(scenario(tmp_path, 0.0), backend)
    biased = run_scenario(scenario(tmp_path, 2.0), backend)
    assert biased["bytes_by_level"]["nvlink"] > 1.2 * plain["bytes_by_level"]["nvlink"]
    assert biased["bytes_by_level"]["spine"] < 0.8 * plain["bytes_by_level"]["spine"]


@pytest.mark.slow
def test_real_ranks_with_the_bias_compute_the_reference(tmp_path):
    s = scenario(tmp_path, 1.0, steps=1, warmup=0)
    result = RealBackend().run(s, debug={"capture": True})
    ref = reference_step(s)
    assert result.records[0].loss == pytest.approx(ref["loss"], rel=1e-6)
    for rank, cap in enumerate(result.captured):
        torch.testing.assert_close(cap["output"], ref["outputs"][rank], rtol=1e-5, atol=1e-6)
        for (w, b), (rw, rb) in zip(cap["router_grads"], ref["router_grads"]):
            torch.testing.assert_close(w, rw, rtol=1e-4, atol=1e-8)
