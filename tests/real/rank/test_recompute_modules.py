"""Megatron-Core's recompute by module on the real ranks (``transformer.recompute_modules``,
``real.rank.recompute``; issue 25 item 6): each module leaves the forward and the
gradients as they are (fp32, within the dtype's error bound, ``tests/conftest.py``), frees
what it should of the tensors autograd keeps for the backward (counted as a rank counts
them, ``ActivationMeter``: storages once each, weights left out), measured against the
closed form (``testbed.model.recompute_modules.LayerRecompute``), and a multi-rank run with
DeepSeek-V3's and Qwen3's recipes matches the run without and moves the bytes the
simulator's replay of its trace moves.

The scenario: H 32, 4 heads of 8 (GQA: 2 key-value heads) or MLA (r_q 24, r_kv 16, d_nope
8, d_rope 4, d_v 6), sequences of 16, 32 tokens, dense FFNs of 40, two gated shared experts
of 48. Where the real layer keeps other tensors than Transformer Engine's, the test says
which and counts the real figure by hand.
"""

import pytest
import torch

from real.backend import RealBackend
from real.kernels.experts import FlatWeights, PagedExpertFFN
from real.rank.dense_model import DenseModel
from real.rank.memory_meter import ActivationMeter
from real.rank.shared_experts import SharedExperts
from testbed.core.errors import ScenarioError
from testbed.model.recompute_modules import LayerRecompute
from testbed.model.whole_model import shape_of
from testbed.run.routing_trace import RoutingTrace
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

H, T, SEQ, F_DENSE, F_SHARED, SHARED = 32, 32, 16, 40, 48, 2
MLA = {"attention": "mla", "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 6, "num_kv_heads": 4}
DEEPSEEK_V3 = "mlp,mla_up_proj,moe_act,layernorm"  # Megatron-LM's DeepSeek-V3 recipe on H100
QWEN3 = "moe_act,layernorm"  # its Qwen3 recipe
FP32 = 4  # bytes


#: MLA with d_v = d_nope + d_rope: torch's CPU attention then runs its flash kernel, which keeps Q, K, V
MLA_FLASH = {**MLA, "v_head_dim": 12}


def scenario(tmp_path, modules="", mla=False, swiglu=True, **sections):
    """2 CPU ranks, EP 2; 4 experts of F 48 in 2 MoE layers, each block an attention, a dense
    FFN and a second attention (moe_every 2) after one dense-first layer; plain SGD. ``mla``:
    False (GQA), True (MLA) or "flash" (MLA of d_v 12)."""
    t = {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": SEQ, "vocab_size": 128, "optimizer": "sgd",
         "moe_every": 2, "dense_ffn_hidden_size": F_DENSE, "first_dense_layers": 1, "recompute_modules": modules,
         **(MLA_FLASH if mla == "flash" else MLA if mla else {})}
    d = {"model": {"hidden_size": H, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2,
                   "ffn_activation": "swiglu" if swiglu else "gelu", "shared_experts": SHARED,
                   "shared_ffn_hidden_size": F_SHARED, "shared_expert_gate": True},
         "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
         "parallelism": {"ep_size": 2}, "router": {"capacity_factor": 1.0},
         "overlap": {"shared_experts": False},  # Megatron refuses shared_experts recompute beside it
         "pager": {"page_size_bytes": 4000, "gpu_budget_bytes": 40000}, "comm": {"expert_sync": "two_stage"},
         "workload": {"tokens_per_rank": T}, "transformer": t,
         "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path), "learning_rate": 0.05}}
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return Scenario.from_dict(d)


def rows(seed=1, n=T, width=H):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def dense_layer(s):
    """(saved bytes, output, gradients by name) of one forward and backward of the dense-first
    layer (attention sublayer, then dense FFN sublayer) on 32 rows."""
    dm = DenseModel(s, torch.float32, torch.device("cpu"))
    att, ffn = dm.first_dense[0]
    x = rows()
    with ActivationMeter(exclude=dm.params()) as meter:
        h = dm._attention_sublayer(x, att)
        y = h + dm._sublayer(h, lambda z: dm._dense_ffn(z, ffn))
    y.square().sum().backward()
    grads = {"x": x.grad, **{f"att.{k}": p.grad for k, p in att.items()}, **{f"ffn.{k}": p.grad for k, p in ffn.items()}}
    return meter.peak_bytes, y.detach(), grads


def shared_layer(s):
    """(saved bytes, output, gradients) of MoE layer 0's shared experts on 32 rows."""
    se = SharedExperts(s, 1, torch.float32, torch.device("cpu"))
    x = rows(2)
    with ActivationMeter(exclude=list(se.weights[0].values())) as meter:
        y = se.forward(0, x)
    y.square().sum().backward()
    return meter.peak_bytes, y.detach(), {"x": x.grad, **{k: w.grad for k, w in se.weights[0].items()}}


def assert_same(with_, without, n, float_bound):
    float_bound.assert_close(with_[1], without[1], n, msg="output")
    assert with_[2].keys() == without[2].keys()
    for name, grad in without[2].items():
        float_bound.assert_close(with_[2][name], grad, n, msg=name)


@pytest.mark.parametrize("module, mla", [("core_attn", False), ("core_attn", True), ("mlp", False),
                                         ("layernorm", False), ("layernorm", True), ("mla_up_proj", True),
                                         ("mla_up_proj", "flash"), ("mla_up_proj,core_attn,layernorm", "flash"),
                                         (DEEPSEEK_V3, True), (DEEPSEEK_V3, "flash"), (QWEN3, False)])
def test_a_module_leaves_the_dense_layer_and_its_gradients_as_they_are(tmp_path, module, mla, float_bound):
    n = T * (H + F_DENSE) * 2
    assert_same(dense_layer(scenario(tmp_path, module, mla)), dense_layer(scenario(tmp_path, "", mla)), n, float_bound)


def test_shared_experts_recompute_leaves_them_and_their_gradients_as_they_are(tmp_path, float_bound):
    n = T * (H + F_SHARED) * SHARED
    assert_same(shared_layer(scenario(tmp_path, "shared_experts")), shared_layer(scenario(tmp_path)), n, float_bound)


def closed_form(s, module, moe=False, **kw):
    """``LayerRecompute.saved_bytes`` of ``module`` for the 32 rows, fp32: no dropout (the
    real model has none), each norm its own (``norms_fused=False``: the real model's)."""
    kw = {"dropout": False, "norms_fused": False, **kw}
    return LayerRecompute(shape_of(s), moe, SEQ, **kw).saved_bytes(module, dtype_bytes=FP32) * T


def saved(tmp_path, module, mla=False, swiglu=True, layer=dense_layer):
    return layer(scenario(tmp_path, "", mla, swiglu))[0] - layer(scenario(tmp_path, module, mla, swiglu))[0]


def test_core_attn_frees_the_flash_cores_softmax_statistics(tmp_path):
    """GQA (equal head dimensions: torch's CPU flash kernel): the core keeps Q, K, V (K and V
    repeated over the query heads, n d as the closed form counts them), its output and the
    fp32 log-sum-exp per head; the checkpoint frees the statistics, as the closed form says."""
    s = scenario(tmp_path, mla=False)
    assert saved(tmp_path, "core_attn") == closed_form(s, "core_attn") == T * 4 * FP32 == 512


def test_core_attn_with_mla_frees_the_unfused_cores_scores(tmp_path):
    """MLA (d_v 6 against d_qk 12: torch's CPU attention takes the unfused path, which keeps
    the scaled Q, K, the probabilities n s and a contiguous V of its own). Checkpointed, the
    core keeps Q and K (the same sizes) and V, a view of the up projection's whole
    [k_nope, v] output: n (d_nope + d_v) where its copy was n d_v. So it frees the closed
    form's unfused figure (``flash=False``: the probabilities) less n d_nope."""
    s = scenario(tmp_path, mla=True)
    probs, nope = 4 * SEQ * FP32, 4 * 8 * FP32
    assert closed_form(s, "core_attn", flash=False) == T * probs
    assert saved(tmp_path, "core_attn", mla=True) == T * (probs - nope) == 4096


@pytest.mark.parametrize("swiglu", [False, True])
def test_mlp_frees_the_dense_ffns_tensors(tmp_path, swiglu):
    """gelu: the first GEMM's output and the activation, F_d each: the closed form. SwiGLU:
    also silu(gate), F_d, which the real product keeps for its backward (Megatron-Core's
    fused SwiGLU keeps only its input): the closed form's 3 F_d and F_d more."""
    s = scenario(tmp_path, swiglu=swiglu)
    extra = T * F_DENSE * FP32 if swiglu else 0
    assert saved(tmp_path, "mlp", swiglu=swiglu) == closed_form(s, "mlp") + extra == T * F_DENSE * FP32 * (4 if swiglu else 2)


@pytest.mark.parametrize("mla", [False, True])
def test_layernorm_frees_each_norms_output_and_statistics(tmp_path, mla):
    """The attention's input norm and the dense FFN's, H each (the closed form's
    ``input_norm_output`` and ``pre_mlp_norm_output``), and their fp32 statistics, one per
    token and norm, which the closed form leaves out."""
    s = scenario(tmp_path, mla=mla)
    assert closed_form(s, "layernorm") == T * 2 * H * FP32
    assert saved(tmp_path, "layernorm", mla=mla) == closed_form(s, "layernorm") + T * 2 * FP32 == 8448


def test_mla_up_proj_frees_the_normed_latents_and_ropes_tables(tmp_path):
    """The up projections' own saves: the normed latents (the closed form's
    ``normed_latents``, r_q + r_kv, as with fused norms), the two latent norms' fp32
    statistics and RoPE's cos and sin tables of the query and the key (4 of s x d_rope,
    fp32). Not Q, K, V: the unfused core (see above) keeps copies of its own, not the up
    projections' outputs, so nothing of theirs is left to free (the closed form's flash core
    keeps them: 480 bytes a token more)."""
    s = scenario(tmp_path, mla=True)
    latents = {t.name: t for t in LayerRecompute(shape_of(s), False, SEQ).tensors}["normed_latents"]
    assert latents.elements == 24 + 16
    qkv = closed_form(s, "mla_up_proj", norms_fused=True) - T * latents.bytes(FP32)
    assert qkv == T * 4 * (12 + 12 + 6) * FP32
    assert saved(tmp_path, "mla_up_proj", mla=True) == T * (latents.bytes(FP32) + 2 * FP32) + 4 * SEQ * 4 * FP32 == 6400


def test_mla_up_proj_before_a_flash_core_frees_q_k_v_too(tmp_path):
    """MLA of d_v 12: the flash core keeps the up projections' Q and K and V, a view of
    their whole [k_nope, v] output (n (d_nope + d_v)); ``mla_up_proj`` frees them (refilled
    in the backward) with the unfused case's normed latents, statistics and RoPE tables:
    the closed form (fused norms) and n d_nope more, the k_nope that V's storage holds."""
    s = scenario(tmp_path, mla="flash")
    closed = closed_form(s, "mla_up_proj", norms_fused=True)
    assert closed == T * (24 + 16 + 4 * (12 + 12 + 12)) * FP32  # normed latents, Q, K, V
    own = T * ((24 + 16) * FP32 + 2 * FP32) + 4 * SEQ * 4 * FP32  # as in the unfused case
    qkv = T * 4 * (12 + 12 + (8 + 12)) * FP32  # Q, K and V's storage [k_nope, v]
    assert saved(tmp_path, "mla_up_proj", mla="flash") == own + qkv \
        == closed + T * 4 * 8 * FP32 + T * 2 * FP32 + 4 * SEQ * 4 * FP32 == 28928


@pytest.mark.parametrize("swiglu", [False, True])
def test_shared_experts_recompute_frees_their_tensors(tmp_path, swiglu):
    """Their first GEMMs' outputs and activations, the gated output and the gate's score (the
    closed form's ``shared_*``); with SwiGLU also each silu(gate), S F_s (as ``mlp``'s)."""
    s = scenario(tmp_path, swiglu=swiglu)
    extra = T * SHARED * F_SHARED * FP32 if swiglu else 0
    got = saved(tmp_path, "shared_experts", swiglu=swiglu, layer=shared_layer)
    assert got == closed_form(s, "shared_experts", moe=True) + extra
    assert got == T * (SHARED * F_SHARED * (4 if swiglu else 2) + H + 1) * FP32


def test_the_experts_never_keep_their_activation_so_moe_act_frees_nothing_more(tmp_path):
    """``PagedExpertFFN`` keeps each row's input (H) and its first GEMM's output (2 F with
    SwiGLU), and computes the activation again in its backward: the closed form's rows less
    the ``expert_activation`` that ``moe_act`` frees (F)."""
    s = scenario(tmp_path, "moe_act")
    f, counts = s.model.ffn_hidden_size, [5, 0, 7]
    flats = {i: torch.randn(H * 2 * f + f * H, generator=torch.Generator().manual_seed(i)) for i in range(3)}
    x = rows(3, n=sum(counts))
    with ActivationMeter(exclude=list(flats.values())) as meter:
        y = PagedExpertFFN.apply(x, FlatWeights(flats), [0, 1, 2], counts, H, f, {}, None, False, True)
    y.sum().backward()
    row = {t.name: t.bytes(FP32) for t in LayerRecompute(shape_of(s), True, SEQ).tensors if t.per_row}
    assert meter.peak_bytes == sum(counts) * (row["expert_input"] + row["expert_first_output"])
    assert LayerRecompute(shape_of(s), True, SEQ).saved_bytes("moe_act", dtype_bytes=FP32, rows_per_token=1) \
        == row["expert_activation"] == f * FP32


@pytest.mark.parametrize("modules, reason", [
    ("moe", "controller plans each layer once"),
    ("layernorm,moe", "controller plans each layer once"),
    ("mla_up_proj", "only supported with multi_latent_attention"),
])
def test_what_the_real_backend_does_not_recompute_is_refused(tmp_path, modules, reason):
    with pytest.raises(ScenarioError) as err:
        RealBackend().check(scenario(tmp_path, modules))
    assert "transformer.recompute_modules" in str(err.value) and reason in str(err.value)


def test_shared_experts_recompute_is_refused_beside_their_overlap(tmp_path):
    with pytest.raises(ScenarioError, match="shared-expert overlap"):
        RealBackend().check(scenario(tmp_path, "shared_experts", overlap={"shared_experts": True}))


@pytest.mark.slow
@pytest.mark.parametrize("modules, mla", [(DEEPSEEK_V3, True), (QWEN3, False)], ids=["deepseek-v3", "qwen3"])
def test_a_recipe_on_two_ranks_matches_the_run_without(tmp_path, modules, mla, float_bound):
    """One step on 2 ranks: the loss, every rank's outputs and first-step gradients (experts,
    routers, shared experts, dense weights by name) as without recompute."""
    runs = [RealBackend().run(scenario(tmp_path / m, m, mla), debug={"capture": True}) for m in ("", modules)]
    without, with_ = runs
    s = scenario(tmp_path, modules, mla)
    n = float_bound.chain(s)
    assert with_.records[0].loss == float_bound.approx(without.records[0].loss, n)
    assert with_.records[0].bytes_by_stage == without.records[0].bytes_by_stage
    for cap, ref in zip(with_.captured, without.captured, strict=True):
        float_bound.assert_close(cap["outputs"][0], ref["outputs"][0], n)
        for key in ("expert_grads", "named_grads"):
            assert cap[key].keys() == ref[key].keys()
            for name, grad in ref[key].items():
                float_bound.assert_close(cap[key][name], grad, n, msg=name)
    assert {"dense0.ffn.w3", "layer0.attention0.wkv_b" if mla else "layer0.attention0.wq",
            "shared0.gate"} <= with_.captured[0]["named_grads"].keys()


@pytest.mark.slow
def test_a_run_with_recompute_and_its_replay_move_the_same_bytes(tmp_path):
    """Every module the real ranks recompute, MLA: the real run and the simulator's replay
    of its routing trace count the same bytes per stage and per link level (the modules
    recompute no collective here)."""
    s = scenario(tmp_path, "core_attn,mlp,moe_act,layernorm,mla_up_proj,shared_experts", mla=True,
                 run={"steps": 2})
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    assert RoutingTrace.load(real["run_dir"]).routed.shape[0] == 2
    for key in ("bytes_by_stage", "bytes_by_level", "page_moves_per_step", "dropped_token_fraction"):
        assert real[key] == replay[key], key
    assert real["bytes_by_stage"]["dense_sync"] > 0
