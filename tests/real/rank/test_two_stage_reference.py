"""Two-stage sync (M9) where it matters: replicas, EP groups that use only some experts,
stale replicas and their refresh. Over several steps the distributed run computes what
one process computes from the formulas (``real.rank.reference``): every step's outputs, the
first step's gradients, and after the last step every fresh replica's weights and the
router's."""

import numpy as np
import pytest
import torch

from real.backend import RealBackend
from real.rank.reference import reference_run
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


def scenario(world, replicas, tmp_path):
    """EP = world / replicas; 8 experts and few tokens per rank with skewed, drifting
    popularity, so that an EP group keeps no token for some experts in some steps."""
    ep = world // replicas
    return Scenario.from_dict({
        "model": {"hidden_size": 16, "ffn_hidden_size": 24, "num_experts": 8, "num_layers": 2, "top_k": 1},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": world // 2, "microclusters": 1},
        "parallelism": {"ep_size": ep},
        "router": {"capacity_factor": 1.5},
        "pager": {"page_size_bytes": 1024, "gpu_budget_bytes": 16384},
        "comm": {"token_strategy": "alltoall", "expert_sync": "two_stage"},
        "workload": {"tokens_per_rank": 8, "skew": 1.5, "drift": 0.3, "locality": 0.8},
        "run": {"steps": 4, "warmup_steps": 0, "output_dir": str(tmp_path)},
    })


def partial_groups(routed: np.ndarray, scenario: Scenario) -> int:
    """(step, layer, expert) triples some EP group kept tokens for and another did not,
    from the routed counts [S, L, W, E] (capacity keeps at least one of any routed)."""
    lay = Layout(scenario)
    by_group = np.stack([routed[:, :, list(lay.ep_group(g))].sum(axis=2) for g in range(lay.replicas)], axis=2)
    used = by_group > 0  # [S, L, R, E]
    return int((used.any(axis=2) & ~used.all(axis=2)).sum())


@pytest.mark.slow
@pytest.mark.parametrize("world, replicas", [(4, 2), (8, 2), (8, 4)])
def test_two_stage_with_partial_groups_and_stale_replicas_matches_the_reference(world, replicas, tmp_path,
                                                                                  float_bound):
    s = scenario(world, replicas, tmp_path)
    result = RealBackend().run(s, debug={"capture": True})
    ref = reference_run(s)
    assert partial_groups(result.routing.routed, s) > 0  # some experts synced by some groups only
    refreshed = sum((r.moves_by_reason or {}).get("refresh", 0) for r in result.records)
    assert refreshed > 0  # stale replicas were used again, after a refresh
    close, n, steps = float_bound.assert_close, float_bound.chain(s), float_bound.updates(s)
    for step, (rec, want) in enumerate(zip(result.records, ref)):
        assert rec.loss == float_bound.approx(want["loss"], n), step
    first = ref[0]
    for rank, cap in enumerate(result.captured):
        for step, out in enumerate(cap["outputs"]):
            close(out, ref[step]["outputs"][rank], n, msg=f"step {step}")
        for inst, grad in cap["expert_grads"].items():
            close(grad, first["expert_grads"][inst], n)
        for (w, b), (rw, rb) in zip(cap["router_grads"], first["router_grads"]):
            close(w, rw, n)
            close(b, rb, n)
        assert cap["final_experts"]  # every rank holds fresh replicas at the end
        for inst, w in cap["final_experts"].items():
            close(w, ref[-1]["experts_after"][inst], steps)
        for (w, b), (rw, rb) in zip(cap["final_router"], ref[-1]["router_after"]):
            close(w, rw, steps)
            close(b, rb, steps)


def test_the_bound_admits_the_reduction_order_noise_another_machine_showed(tmp_path, float_bound):
    """On a machine like CI's, world 4 x 2 replicas gave a router gradient element
    (3, 7) of about 1.2e-5 off by 1.17e-8 (9.7e-4 relative): float32 noise, as the
    gradients' largest magnitude here is 9.0e-4 (measured on this scenario). The old
    tolerance (atol 1e-8, rtol 1e-4) refused it; the dtype's bound admits it, and still
    refuses a gradient missing a quarter of its sum (one rank's share of four)."""
    n = float_bound.chain(scenario(4, 2, tmp_path))
    expected = torch.linspace(-9.0e-4, 9.0e-4, 16 * 8).reshape(16, 8)
    expected[3, 7] = 1.2e-5
    noisy = expected.clone()
    noisy[3, 7] += 1.17e-8
    with pytest.raises(AssertionError):
        torch.testing.assert_close(noisy, expected, rtol=1e-4, atol=1e-8)
    float_bound.assert_close(noisy, expected, n)
    with pytest.raises(AssertionError):
        float_bound.assert_close(0.75 * expected, expected, n)
