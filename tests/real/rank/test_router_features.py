"""The router features on real CPU ranks against the single-process reference written from
the formulas (``real.rank.reference``): sigmoid or softmax scores, group-limited routing,
the balancing bias moving step by step (one for the whole batch, on 2 replicas: the same
on every rank and the reference's, bit for bit), top-k normalised or not, a routed
scaling factor, the sequence-wise and Switch balance losses. Over several steps every
step's routed counts, loss, balance loss and outputs, the first step's gradients and the
weights after the last step match; and a run killed and resumed holds the same bias, bit
for bit."""

import pickle

import numpy as np
import pytest
import torch

from real.backend import RealBackend
from real.rank.reference import reference_run
from testbed.core.errors import RunError
from testbed.policy.bias_balance import BiasBalance
from testbed.scenario.scenario import Scenario

FEATURES = {
    # DeepSeek-V3-like: sigmoid, top2_sum groups, normalised and scaled; Gumbel noise on
    "sigmoid": {"score": "sigmoid", "group_score": "top2_sum", "routed_scaling_factor": 2.5},
    # DeepSeek-V2-like: softmax, groups by their max, the top-k not renormalised
    "softmax": {"score": "softmax", "group_score": "max", "normalize_top_k": False, "noise": "none"},
}


def scenario(tmp_path, features):
    """4 ranks, EP 2 x 2 replicas (one bias, the whole batch's); 8 experts in 4 groups of 2, a token
    inside 2 of them, top-3. The bias rate is large (0.05) so that it changes the routing
    within the run's 3 steps; the sequence-wise loss's coefficient too (0.05), so that its
    gradient shows in the router's (without the whole transformer a rank's 64 tokens are one
    sequence)."""
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 8, "num_layers": 2, "top_k": 3},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "router": {"capacity_factor": 1.25, "expert_groups": 4, "groups_per_token": 2, "bias_update_rate": 0.05,
                   "seq_aux_loss_coef": 0.05, "aux_loss_coef": 0.01, **FEATURES[features]},
        "pager": {"page_size_bytes": 4096, "gpu_budget_bytes": 16384},
        "comm": {"token_strategy": "alltoall", "expert_sync": "two_stage"},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 3, "warmup_steps": 0, "output_dir": str(tmp_path)},
    })


@pytest.mark.slow
@pytest.mark.parametrize("features", list(FEATURES))
def test_router_features_match_the_single_process_reference(tmp_path, features, float_bound):
    s = scenario(tmp_path, features)
    result = RealBackend().run(s, debug={"capture": True})
    ref = reference_run(s)
    # the bias moved after steps 0 and 1 and changed the routing; every rank routed each step
    # with the reference's (the whole batch's, the replica groups' all-reduce of the counts)
    assert not ref[0]["balance_bias"].any() and ref[2]["balance_bias"].std() > 0
    for rank, cap in enumerate(result.captured):
        assert len(cap["balance_bias"]) == 3
        for step, bias in enumerate(cap["balance_bias"]):
            assert np.array_equal(bias, ref[step]["balance_bias"]), (rank, step)
    close, n, steps = float_bound.assert_close, float_bound.chain(s), float_bound.updates(s)
    for step, (rec, want) in enumerate(zip(result.records, ref, strict=True)):
        assert np.array_equal(result.routing.routed[step], want["routed"]), step
        assert rec.loss == float_bound.approx(want["loss"], n), step
        assert rec.aux_loss == float_bound.approx(want["aux"], n), step
        assert rec.dropped_slots > 0
    first = ref[0]
    for rank, cap in enumerate(result.captured):
        for step, out in enumerate(cap["outputs"]):
            close(out, ref[step]["outputs"][rank], n, msg=f"step {step}")
        for inst, grad in cap["expert_grads"].items():
            close(grad, first["expert_grads"][inst], n)
        for (w, b), (rw, rb) in zip(cap["router_grads"], first["router_grads"], strict=True):
            close(w, rw, n)
            close(b, rb, n)
        for inst, w in cap["final_experts"].items():
            close(w, ref[-1]["experts_after"][inst], steps)
        for (w, b), (rw, rb) in zip(cap["final_router"], ref[-1]["router_after"], strict=True):
            close(w, rw, steps)
            close(b, rb, steps)


def test_the_reference_bias_is_routed_counts_under_the_sign_rule(tmp_path):
    """The reference's own bias (written from the formula) is the policy's ``BiasBalance``
    of its routed counts, step after step (a check of the reference, in one process)."""
    s = scenario(tmp_path, "softmax").replace(run={"steps": 3})
    ref = reference_run(s)
    balance = BiasBalance(s.router.bias_update_rate, s.model.num_layers, s.model.num_experts)
    for step in ref:
        assert np.array_equal(step["balance_bias"], balance.bias)
        balance.update(step["routed"].sum(axis=1))  # [L, W, E] -> the whole batch's [L, E]
    assert balance.bias.std() > 0


def checkpointed(tmp_path):
    """test_checkpoint.py's killed-and-resumed scenario with bias balancing on, sigmoid
    scores and groups (4 ranks, EP 2 x 2, checkpoints of the optimizer every 2 steps)."""
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 64, "num_experts": 8, "top_k": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "router": {"score": "sigmoid", "expert_groups": 4, "groups_per_token": 2, "bias_update_rate": 0.01,
                   "seq_aux_loss_coef": 0.001},
        "pager": {"page_size_bytes": "4KiB", "gpu_budget_bytes": "40KiB"},
        "comm": {"expert_sync": "two_stage"},
        "workload": {"tokens_per_rank": 64},
        "checkpoint": {"enabled": True, "optimizer_interval": 2, "expert_interval": 4},
        "run": {"steps": 8, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")},
    })


def final_bias(run_dir, world):
    """Every rank's balancing bias [L, E] after the 8 steps: its controller in the last
    optimizer checkpoint."""
    out = []
    for rank in range(world):
        payload = torch.load(run_dir / "checkpoints" / f"rank{rank}" / "optimizer-00000008-from-00000006.pt",
                             map_location="cpu", weights_only=False)
        out.append(pickle.loads(payload["controller"]).balance.bias)
    return out


@pytest.mark.slow
def test_the_bias_survives_a_resume_bit_identically(tmp_path):
    s = checkpointed(tmp_path)
    straight = RealBackend().run(s, run_dir=tmp_path / "straight")
    with pytest.raises(RunError, match="rank 1 died"):
        RealBackend().run(s, run_dir=tmp_path / "killed", debug={"fail_at": {"rank": 1, "after_steps": 7}})
    resumed = RealBackend().run(s, run_dir=tmp_path / "killed", resume=True)
    first = resumed.extra["resumed_from"]
    assert first in (4, 6)
    for a, b in zip(straight.records[first:], resumed.records, strict=True):
        assert (a.loss, a.aux_loss, a.routed_slots, a.bytes_by_stage) == (b.loss, b.aux_loss, b.routed_slots,
                                                                          b.bytes_by_stage)
    want, got = final_bias(tmp_path / "straight", 4), final_bias(tmp_path / "killed", 4)
    # the bias every controller derives from the counts: the straight run's routing replayed
    balance = BiasBalance(s.router.bias_update_rate, s.model.num_layers, s.model.num_experts)
    for routed in straight.routing.routed:
        balance.update(routed.sum(axis=1))
    assert balance.bias.std() > 0
    for rank in range(4):
        assert np.array_equal(want[rank], got[rank])  # bit for bit after the resume
        assert np.array_equal(want[rank], balance.bias)  # the whole batch's counts' bias, on every rank
