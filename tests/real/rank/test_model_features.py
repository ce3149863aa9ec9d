"""The models people train (issue 24) on real CPU ranks against the single-process reference
written from the formulas (``real.rank.reference``, ``real.rank.reference_model``), one
family each, over several steps: every step's loss (and MTP loss) and outputs, the first
step's gradients of the routed experts and of every other weight by name (routers, shared
experts, attention, dense FFNs, embedding, head, MTP projections), and every weight after
the last step (fp32, within the dtype's error bound, ``tests/conftest.py``).

- FFNs: SwiGLU experts (gate and up in one GEMM, ``real.kernels.ffn_activation``) on the
  per-expert loop, page by page as pages arrive (M14), the grouped GEMM and the grouped GEMM
  block by block; two shared experts of their own width behind a sigmoid gate.
- Attention: grouped-query attention with a head dimension of its own and biases on Q, K,
  V and O, a dense-first layer, SwiGLU dense FFNs, a gated shared expert.
- MLA and MTP: multi-head latent attention (with a query latent, and without as
  DeepSeek-V2-Lite), two MTP modules (each an extra MoE layer: its routing, pages, token
  exchange and expert sync), a dense-first layer, SwiGLU, a shared expert, DeepSeek-V3's
  router (sigmoid, groups, bias balancing), on two EP replicas.
- Tensor parallelism: the features that split by heads and columns (head_dim, Q/K/V
  biases, SwiGLU dense FFNs), TP 2 against TP 1 (split shared experts:
  tests/real/rank/test_shared_experts_tensor_parallel.py).
"""

import pytest
import torch

from real.backend import RealBackend
from real.rank.mtp import tokens_ahead
from real.rank.reference import reference_run
from testbed.core.errors import ScenarioError
from testbed.model.mtp_layers import controller_scenario
from testbed.scenario.scenario import Scenario


def scenario(tmp_path, world=2, **sections):
    """``world`` CPU ranks in nodes of 2, EP 2; 4 experts of F 48 in 2 MoE layers, H 32,
    capacity 1 (some drops); plain SGD (the reference's)."""
    d = {
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": world // 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "router": {"capacity_factor": 1.0},
        "pager": {"page_size_bytes": 4000, "gpu_budget_bytes": 40000},
        "comm": {"expert_sync": "two_stage"},
        "workload": {"tokens_per_rank": 32},
        "run": {"steps": 3, "warmup_steps": 0, "output_dir": str(tmp_path), "learning_rate": 0.05},
    }
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return Scenario.from_dict(d)


def transformer(**over):
    return {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": 16, "vocab_size": 128,
            "optimizer": "sgd", **over}


def assert_matches_reference(s, result, ref, float_bound):
    """Every step's loss, MTP loss and outputs; the first step's gradients; the weights
    after the last step. A key bias has no gradient (a shift of every score by q . b_k
    leaves the softmax as it is): both are held to the bound of the query bias's scale."""
    close, n, steps = float_bound.assert_close, float_bound.chain(controller_scenario(s)), float_bound.updates(s)
    assert len(result.records) == len(ref) == s.run.steps
    for step, (rec, want) in enumerate(zip(result.records, ref, strict=True)):
        assert rec.loss == float_bound.approx(want["loss"], n), step
        assert rec.aux_loss == float_bound.approx(want["aux"], n), step
        if want["mtp_loss"] is not None:
            assert rec.extra["mtp_loss"] == float_bound.approx(want["mtp_loss"], n), step
    first = ref[0]
    for rank, cap in enumerate(result.captured):
        for step, out in enumerate(cap["outputs"]):
            close(out, ref[step]["outputs"][rank], n, msg=f"step {step}")
        for inst, grad in cap["expert_grads"].items():
            close(grad, first["expert_grads"][inst], n, msg=f"expert {inst}")
        assert cap["named_grads"].keys() == first["named_grads"].keys()
        for name, grad in cap["named_grads"].items():
            want = first["named_grads"][name]
            if name.endswith(".bk"):
                bound = float_bound.atol(first["named_grads"][name[:-1] + "q"], n)
                assert float(grad.abs().max()) <= bound and float(want.abs().max()) <= bound, name
            else:
                close(grad, want, n, msg=name)
        for inst, w in cap["final_experts"].items():
            close(w, ref[-1]["experts_after"][inst], steps, msg=f"expert {inst}")
        for name, w in cap["final_named"].items():
            close(w, ref[-1]["named_after"][name], steps, msg=name)
    assert result.records[0].dropped_slots > 0


FFN = {"ffn_activation": "swiglu", "shared_experts": 2, "shared_ffn_hidden_size": 40, "shared_expert_gate": True}


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["loop", "blocked_pages", "grouped_kernel", "grouped_blocked"])
def test_swiglu_and_shared_experts_match_the_reference(tmp_path, kernel, float_bound):
    """The MoE stack (no transformer): SwiGLU experts on each expert kernel, pages of 1,000
    elements (rows of w1's 96 and w2's 32 split across them) computed page by page where
    asked, and two gated shared experts of F 40."""
    if "grouped" in kernel and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    s = scenario(tmp_path, model=FFN, pager={"pipeline_pages": True}, workload={"tokens_per_rank": 64})
    debug = {"capture": True, "blocked_pages": "blocked" in kernel, "grouped_kernel": "grouped" in kernel}
    result = RealBackend().run(s, debug=debug)
    assert_matches_reference(s, result, reference_run(s), float_bound)
    assert all((cap["blocked_experts"] > 0) == ("blocked" in kernel) for cap in result.captured)
    assert {k.split(".")[0] for k in result.captured[0]["named_grads"]} == {"router0", "router1", "shared0", "shared1"}


@pytest.mark.slow
def test_attention_features_match_the_reference(tmp_path, float_bound):
    """4 ranks, EP 2 x 2: head_dim 12 (not H / n = 8), biases on Q, K, V and O, a dense-first
    layer, a dense FFN in each block (moe_every 2), all FFNs SwiGLU, a gated shared expert."""
    s = scenario(tmp_path, world=4, model={"ffn_activation": "swiglu", "shared_experts": 1,
                                           "shared_expert_gate": True},
                 transformer=transformer(head_dim=12, attention_bias="all", first_dense_layers=1, moe_every=2,
                                         dense_ffn_hidden_size=40))
    result = RealBackend().run(s, debug={"capture": True})
    ref = reference_run(s)
    assert_matches_reference(s, result, ref, float_bound)
    grads = ref[0]["named_grads"]
    assert grads["layer0.attention0.wq"].shape == (32, 4 * 12) and "dense0.ffn.w3" in grads
    assert float(grads["layer1.attention1.bo"].abs().max()) > 0 and "shared1.gate" in grads


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank", [24, 0])
def test_mla_and_mtp_match_the_reference(tmp_path, q_lora_rank, float_bound):
    """4 ranks, EP 2 x 2: MLA (a query latent of 24, or none), 2 MTP modules (MoE layers 2
    and 3 for the controller: their routing trace rows, experts and expert sync), a
    dense-first layer, SwiGLU, a shared expert, sigmoid scores in 2 of 4 groups with bias
    balancing moving the bias of every layer, the MTP modules' too."""
    s = scenario(tmp_path, world=4,
                 model={"ffn_activation": "swiglu", "shared_experts": 1, "num_experts": 8, "top_k": 2},
                 router={"score": "sigmoid", "expert_groups": 4, "groups_per_token": 2, "bias_update_rate": 0.05,
                         "routed_scaling_factor": 2.5},
                 transformer=transformer(attention="mla", q_lora_rank=q_lora_rank, kv_lora_rank=16,
                                         qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, mtp_layers=2,
                                         first_dense_layers=1))
    result = RealBackend().run(s, debug={"capture": True})
    ref = reference_run(s)
    assert_matches_reference(s, result, ref, float_bound)
    assert result.routing.routed.shape == (3, 4, 4, 8)  # [steps, 2 + 2 MTP layers, ranks, experts]
    assert ref[2]["balance_bias"][2:].std() > 0  # the MTP layers' bias moved too
    assert {"mtp0.proj", "mtp1.attention.wkv_a", "router3.w", "shared3.0.w1"} <= result.captured[0]["named_grads"].keys()
    assert ("wq_a" in str(sorted(ref[0]["named_grads"]))) == bool(q_lora_rank)


@pytest.mark.slow
def test_tensor_parallel_features_compute_what_whole_ranks_do(tmp_path, float_bound):
    """TP 2 (groups {0, 1} and {2, 3}) with sequence parallelism: Q, K, V and their biases
    split by heads of head_dim 12, SwiGLU dense FFNs by columns (gate and up) and rows,
    and a dense-first layer: the same losses as TP 1, to float rounding (shared experts split
    under TP: tests/real/rank/test_shared_experts_tensor_parallel.py)."""
    base = scenario(tmp_path, world=4, model={"ffn_activation": "swiglu"},
                    transformer=transformer(head_dim=12, attention_bias="qkv", first_dense_layers=1, moe_every=2,
                                            dense_ffn_hidden_size=40),
                    pager={"enabled": False}, comm={"expert_sync": "allreduce"})
    whole = RealBackend().run(base)
    split = RealBackend().run(base.replace(parallelism={"tp_size": 2}))
    n = float_bound.chain(base)
    for a, b in zip(whole.records, split.records, strict=True):
        assert b.loss == float_bound.approx(a.loss, n)
    assert split.records[0].bytes_by_stage["dense"] > 0


def test_tokens_ahead_stay_inside_their_sequence():
    ids = torch.arange(10, 20)
    ahead, valid = tokens_ahead(ids, 2, seq_len=5)
    assert valid.tolist() == [True, True, True, False, False] * 2
    assert ahead.tolist() == [12, 13, 14, 0, 0, 17, 18, 19, 0, 0]


@pytest.mark.parametrize("over, field", [
    ({"transformer": transformer(attention="mla", qk_rope_head_dim=4), "parallelism": {"tp_size": 2}},
     "transformer.attention"),
    ({"transformer": transformer(attention_bias="all"), "parallelism": {"tp_size": 2}}, "transformer.attention_bias"),
    ({"transformer": transformer(mtp_layers=1), "parallelism": {"tp_size": 2}}, "transformer.mtp_layers"),
    ({"transformer": transformer(), "model": {"shared_experts": 1, "shared_expert_gate": True},
      "parallelism": {"tp_size": 2}}, "model.shared_expert_gate"),
    ({"transformer": transformer(mtp_layers=1), "parallelism": {"pp_size": 2}, "pager": {"enabled": False},
      "comm": {"expert_sync": "allreduce"}}, "transformer.mtp_layers"),
    ({"transformer": transformer(first_dense_layers=1), "parallelism": {"pp_size": 2}, "pager": {"enabled": False},
      "comm": {"expert_sync": "allreduce"}}, "transformer.first_dense_layers"),
    ({"transformer": transformer(attention="mla", qk_rope_head_dim=5)}, "transformer.qk_rope_head_dim"),
])
def test_what_the_real_backend_does_not_run_is_refused(tmp_path, over, field):
    s = scenario(tmp_path, world=4, **over)
    with pytest.raises(ScenarioError) as err:
        RealBackend().check(s)
    assert field in str(err.value)
