"""deepep on real CPU ranks computes what the flat all-to-all computes: layer outputs,
expert and router gradients and updated weights (fp32, within float tolerance), with
the group inside one node (the NVLink forward only), across nodes of one GPU (the hop
only) and across nodes of two (both)."""

import pytest

from real.backend import RealBackend
from real.rank.reference import reference_step
from testbed.scenario.scenario import Scenario


def scenario(tmp_path, gpus_per_node, nodes, ep, token="deepep", sync="allreduce"):
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": gpus_per_node, "nodes_per_microcluster": nodes, "microclusters": 1},
        "parallelism": {"ep_size": ep},
        "router": {"capacity_factor": 1.0},  # some drops: tokens whose slots all dropped go nowhere
        "pager": {"page_size_bytes": 4096, "gpu_budget_bytes": 16384},
        "comm": {"token_strategy": token, "expert_sync": sync},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)},
    })


def assert_same_step(result, expected, s, float_bound):
    close, n = float_bound.assert_close, float_bound.chain(s)
    assert result.records[0].loss == float_bound.approx(expected["loss"], n)
    for rank, cap in enumerate(result.captured):
        close(cap["output"], expected["outputs"][rank], n)
        for inst, grad in cap["expert_grads"].items():
            close(grad, expected["expert_grads"][inst], n)
        for inst, w in cap["experts_after"].items():
            close(w, expected["experts_after"][inst], float_bound.updates(s))
        for (w, b), (rw, rb) in zip(cap["router_grads"], expected["router_grads"]):
            close(w, rw, n)
            close(b, rb, n)


@pytest.mark.slow
@pytest.mark.parametrize("gpus_per_node, nodes, ep", [(2, 1, 2), (1, 4, 4), (2, 2, 4)])
def test_deepep_matches_the_single_process_reference(tmp_path, float_bound, gpus_per_node, nodes, ep):
    s = scenario(tmp_path, gpus_per_node, nodes, ep, sync="two_stage" if ep == 2 else "allreduce")
    result = RealBackend().run(s, debug={"capture": True})
    assert result.records[0].dropped_slots > 0
    assert_same_step(result, reference_step(s), s, float_bound)


@pytest.mark.slow
def test_deepep_computes_what_the_flat_all_to_all_computes(tmp_path, float_bound):
    """The same step on the same ranks with both strategies (EP 4 over 2 nodes of 2)."""
    s = scenario(tmp_path, 2, 2, 4)
    deepep = RealBackend().run(s, debug={"capture": True})
    flat = RealBackend().run(s.replace(comm={"token_strategy": "alltoall"}), debug={"capture": True})
    expected = {"loss": flat.records[0].loss, "outputs": [c["output"] for c in flat.captured],
                "expert_grads": {i: g for c in flat.captured for i, g in c["expert_grads"].items()},
                "experts_after": {i: w for c in flat.captured for i, w in c["experts_after"].items()},
                "router_grads": flat.captured[0]["router_grads"]}
    assert_same_step(deepep, expected, s, float_bound)
    # and moves fewer bytes between the nodes: a token once per node, not once per slot
    assert deepep.records[0].bytes_by_level["leaf"] < flat.records[0].bytes_by_level["leaf"]
