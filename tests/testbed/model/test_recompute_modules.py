"""Megatron-Core's recompute by module (testbed/model/recompute_modules.py) with hand
numbers: the bytes per token each tensor of a layer takes (bf16: 2 bytes an element, masks
1, fp32 statistics 4), what each module's recompute saves, what is left with every module,
the work each runs again, against whole_model's layer_activation_bytes; DeepSeek-V3's shape
with its Megatron recipe (mlp, mla_up_proj, moe_act, layernorm); the refusals."""

from dataclasses import replace

import pytest

from testbed.core.errors import ScenarioError
from testbed.model.recompute_modules import RECOMPUTE_MODULES, LayerRecompute, check_recompute_modules
from testbed.model.transformer_shape import TransformerShape
from testbed.model.whole_model import layer_activation_bytes, shape_of
from testbed.scenario.scenario import Scenario

#: H 64, 4 heads of 16, SwiGLU dense FFN of 128; layer 0 dense, layer 1 MoE: 8 experts of 32, top 2,
#: one shared expert of 48
SMALL = TransformerShape(layers=2, hidden=64, heads=4, kv_heads=4, dense_ffn=128, vocab=10, ffn_matrices=3,
                         experts=8, expert_ffn=32, top_k=2, moe_every=2, shared_experts=1, shared_ffn=48)
#: the same with MLA: query latent 32, key-value latent 16, d_nope 8, d_rope 4, d_v 8
SMALL_MLA = replace(SMALL, attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8)
SEQ = 32
V3_RECIPE = ("mlp", "mla_up_proj", "moe_act", "layernorm")  # issue 25: DeepSeek-V3 on 1,024 H100


def sizes(layer: LayerRecompute) -> dict[str, int]:
    return {t.name: t.bytes(2) for t in layer.tensors}


def test_a_dense_gqa_layer_keeps_these_bytes_per_token():
    """Per token, bf16: the layer's input, the input norm's output (inside linear_qkv, the
    fused norm: nothing frees it), Q, K, V (64 each), the softmax statistics (4 heads fp32),
    the output projection's input, the residual and the pre-MLP norm's output (inside
    linear_fc1: mlp frees it), SwiGLU's 256 and 128, two dropout masks of 64 bytes."""
    layer = LayerRecompute(SMALL, moe=False, seq_len=SEQ)
    assert sizes(layer) == {"layer_input": 128, "input_norm_output": 128, "query": 128, "key": 128, "value": 128,
                            "softmax_stats": 16, "attention_output": 128, "attention_bda_mask": 64,
                            "pre_mlp_input": 128, "pre_mlp_norm_output": 128, "ffn_first_output": 512,
                            "ffn_activation": 256, "mlp_bda_mask": 64}
    assert layer.kept_bytes() == 1936
    assert layer.saved_bytes("mlp") == 128 + 512 + 256
    assert layer.saved_bytes("core_attn") == 16
    for nothing_here in ("layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj"):
        assert layer.saved_bytes(nothing_here) == 0
    # every module: the input, what attention keeps for its GEMMs and the core, the residual, the masks
    assert layer.kept_bytes(RECOMPUTE_MODULES) == 128 + 128 + 3 * 128 + 128 + 64 + 128 + 64 == 1024


def test_the_local_spec_s_norms_are_their_own_and_layernorm_frees_them():
    layer = LayerRecompute(SMALL, moe=False, seq_len=SEQ, norms_fused=False)
    assert layer.saved_bytes("layernorm") == 128 + 128  # both norms' outputs
    assert layer.saved_bytes("mlp") == 512 + 256  # its input is the norm's output, the checkpoint's
    assert layer.work("layernorm").token_kernel_elements == 2 * (64 + 64)
    assert layer.work("mlp").token_kernel_elements == 3 * 128  # no norm inside it


def test_a_dense_layer_s_tensors_sum_to_layer_activation_bytes_but_the_softmax_statistics():
    """whole_model leaves flash attention's statistics (4 bytes a head) out; the rest is the
    same, whole and split parts alike (tp 2 without and with sequence parallelism)."""
    for shape in (SMALL, SMALL_MLA):
        layer = LayerRecompute(shape, moe=False, seq_len=SEQ)
        for tp, sp in ((1, False), (2, False), (2, True)):
            whole_model = layer_activation_bytes(shape, SEQ, 1, moe=False, tp=tp, sequence_parallel=sp) / SEQ
            assert layer.kept_bytes(tp=tp, sequence_parallel=sp) - 16 / tp == whole_model
    assert layer_activation_bytes(SMALL, SEQ, 1, moe=False, tp=2) / SEQ == 1280  # 640 whole + 1280 / 2
    assert LayerRecompute(SMALL, moe=False, seq_len=SEQ).kept_bytes(tp=2) == 640 + (384 + 16 + 128 + 768) / 2


def test_an_moe_layer_keeps_its_router_rows_and_shared_expert():
    """Per token: the attention part as the dense layer's (976), the pre-MLP norm's output
    (its own norm: layernorm frees it), the router's fp32 scores and byte map over 8 experts,
    2 rows of input 128, gate and up 128, activation 64 and a 4-byte prob, the shared
    expert's 192 and 96, the MLP's mask."""
    layer = LayerRecompute(SMALL, moe=True, seq_len=SEQ)
    s = sizes(layer)
    assert (s["router_scores"], s["routing_map"]) == (32, 8)
    assert (s["expert_input"], s["expert_first_output"], s["expert_activation"], s["expert_prob"]) == (128, 128, 64, 4)
    assert (s["shared_first_output"], s["shared_activation"]) == (192, 96)
    assert layer.kept_bytes() == 976 + 128 + 32 + 8 + 2 * (128 + 128 + 64 + 4) + 192 + 96 + 64 == 2144
    assert layer.saved_bytes("layernorm") == 128
    assert layer.saved_bytes("moe_act") == 2 * 64
    assert layer.saved_bytes("shared_experts") == 192 + 96
    assert layer.saved_bytes("moe") == 32 + 8 + 2 * 324 + 192 + 96 == 976  # all but its input
    assert layer.saved_bytes("mlp") == 0  # Megatron's mlp is the dense layers' only
    assert layer.kept_bytes(("moe_act", "layernorm")) == 2144 - 128 - 128  # Qwen3-235B's recipe
    assert layer.kept_bytes(("moe", "moe_act")) == 2144 - 976  # moe frees the activations already
    assert layer.kept_bytes(RECOMPUTE_MODULES) == 1024  # the dense layer's never-recomputed tensors
    assert layer.kept_bytes(rows_per_token=5) == 2144 + 3 * 324  # the rows a GPU holds per token


def test_an_moe_layer_against_layer_activation_bytes():
    """whole_model's MoE layer keeps Megatron-Core's tensors of the layer but flash attention's
    softmax statistics (16 bytes), the pre-MLP norm's output (128, the MoE layer's input, the
    phase builder's), the rows' (2 x 324) and the shared experts' (192 + 96)."""
    layer = LayerRecompute(SMALL, moe=True, seq_len=SEQ)
    own = 128 + 2 * 324 + 192 + 96
    assert layer.kept_bytes() - 16 - own == layer_activation_bytes(SMALL, SEQ, 1, moe=True) / SEQ == 1064


def test_a_shared_expert_gate_keeps_the_product_s_inputs():
    layer = LayerRecompute(replace(SMALL, shared_gate=True), moe=True, seq_len=SEQ)
    assert layer.saved_bytes("shared_experts") == 192 + 96 + 128 + 2  # its output H and the score
    work = layer.work("shared_experts")
    assert work.token_linears == ((64, 96), (48, 64), (64, 1))
    assert work.token_kernel_elements == 3 * 48 + 2 * 64


def test_mla_up_proj_frees_q_k_v_and_the_fused_latent_norms_outputs():
    """MLA, per token: latents 32 + 16 + 4 (104 bytes) kept always; their normed 32 + 16
    (96) inside the LN-fused up projections and Q, K (4 x 12 each), V (4 x 8): mla_up_proj.
    whole_model's recompute_mla_up_proj takes Q, K and V only (256 bytes)."""
    layer = LayerRecompute(SMALL_MLA, moe=False, seq_len=SEQ)
    s = sizes(layer)
    assert (s["latents"], s["normed_latents"], s["query"], s["key"], s["value"]) == (104, 96, 96, 96, 64)
    assert layer.kept_bytes() == 1944
    assert layer.saved_bytes("mla_up_proj") == 96 + 96 + 96 + 64 == 352
    assert 2 * SMALL_MLA.mla_up_proj_elements == 256
    assert layer.saved_bytes("layernorm") == 128  # MLA's input norm is its own
    assert LayerRecompute(SMALL_MLA, moe=False, seq_len=SEQ, norms_fused=False).saved_bytes("mla_up_proj") == 256
    assert layer.kept_bytes(V3_RECIPE) == 128 + 104 + 16 + 64 + 64 + 128 + 64 == 568


def test_without_flash_core_attn_frees_the_scores():
    """The unfused attention keeps its softmax output (n s), the dropout's mask (n s bytes)
    and output (n s): Korthikanti's 5 n s bytes per token, what whole_model adds without flash."""
    layer = LayerRecompute(SMALL, moe=False, seq_len=SEQ, flash=False)
    assert layer.saved_bytes("core_attn") == 5 * 4 * SEQ == 640
    assert layer.kept_bytes() == layer_activation_bytes(SMALL, SEQ, 1, moe=False, flash=False) / SEQ
    no_dropout = LayerRecompute(SMALL, moe=False, seq_len=SEQ, flash=False, dropout=False)
    assert no_dropout.saved_bytes("core_attn") == 2 * 4 * SEQ
    assert no_dropout.work("core_attn").token_kernel_elements == 2 * 4 * SEQ  # the softmax reads and writes
    assert layer.work("core_attn").token_kernel_elements == 4 * 4 * SEQ  # and the dropout
    assert layer.work("core_attn").attention_flops == 2 * 2 * SEQ * 64  # the whole s x s, masked


def test_each_module_s_work_by_hand():
    dense, moe = LayerRecompute(SMALL, moe=False, seq_len=SEQ), LayerRecompute(SMALL, moe=True, seq_len=SEQ)
    assert dense.work("core_attn").attention_flops == 2 * 2 * (SEQ / 2) * 64  # causal: half the keys
    mlp = dense.work("mlp")
    assert mlp.token_linears == ((64, 256), (128, 64))
    assert mlp.flops_per_token(0) == 2 * 3 * 64 * 128 == SMALL.ffn_forward_flops(moe=False)
    assert mlp.token_kernel_elements == 3 * 128 + 2 * 64  # SwiGLU reads 2F, writes F; the fused norm H, H
    assert moe.work("moe_act").row_kernel_elements == 3 * 32
    full = moe.work("moe")
    assert full.token_linears == ((64, 96), (48, 64), (64, 8))  # the shared expert, the router
    assert full.row_linears == ((64, 64), (32, 64))
    assert full.dispatches == 1
    assert full.flops_per_token(2) == 2 * (64 * 8 + 3 * 64 * 48) + 2 * 2 * 3 * 64 * 32 == 44032
    assert full.flops_per_token(2) == SMALL.ffn_forward_flops(moe=True)
    assert full.row_kernel_elements == 3 * 32 + 4 * 64
    assert moe.work("layernorm").token_kernel_elements == 2 * 64  # the pre-MLP norm, its own
    assert dense.work("layernorm").token_kernel_elements == 0
    assert dense.work("moe").flops_per_token(2) == 0
    nested = moe.total_work(("moe", "moe_act"))
    assert nested.row_kernel_elements == 2 * 3 * 32 + 4 * 64  # the activation twice more
    up = LayerRecompute(SMALL_MLA, moe=False, seq_len=SEQ).work("mla_up_proj")
    assert up.token_linears == ((32, 48), (16, 64))
    assert up.flops_per_token(0) == 2 * (32 * 48 + 16 * 64)
    assert up.token_kernel_elements == (48 + 64 + 4) + (48 + 48 + 32) + 2 * (32 + 16)  # RoPE in, out; norms
    with pytest.raises(ValueError, match="'attn'"):
        dense.work("attn")


def v3_shape() -> TransformerShape:
    return shape_of(Scenario.from_dict({"model": {"preset": "deepseek-v3"}}))


def test_deepseek_v3_with_its_megatron_recipe_by_hand():
    """DeepSeek-V3 (H 7168; MLA of 128 heads, Q and K 128 x 192, V 128 x 128, latents 1536
    and 512 + 64; dense FFN 18432; 256 experts of 2048, top 8, one shared of 2048; SwiGLU),
    bf16, flash, no dropout (the recipe's --hidden-dropout 0 --attention-dropout 0:
    Megatron-MoE-ModelZoo model_configs/benchmarking/DeepSeek-V3.yaml), per token."""
    shape = v3_shape()
    check_recompute_modules(list(V3_RECIPE), shape, shared_expert_overlap=True)
    dense = LayerRecompute(shape, moe=shape.is_moe_layer(0), seq_len=4096, dropout=False)
    moe = LayerRecompute(shape, moe=shape.is_moe_layer(3), seq_len=4096, dropout=False)
    h2 = 2 * 7168
    qkv = 2 * (2 * 128 * 192 + 128 * 128)
    assert dense.kept_bytes() == 4 * h2 + 2 * 2112 + 2 * 2048 + qkv + 4 * 128 + 2 * 16384 + 2 * 3 * 18432 == 340608
    assert dense.saved_bytes("layernorm") == h2  # the input norm; the pre-MLP norm is inside linear_fc1
    assert dense.saved_bytes("mla_up_proj") == 2 * 2048 + qkv == 135168
    assert dense.saved_bytes("mlp") == h2 + 2 * 3 * 18432 == 124928
    assert dense.saved_bytes("moe_act") == 0
    assert dense.kept_bytes(V3_RECIPE) == h2 + 2 * 2112 + 512 + 2 * 16384 + h2 == 66176
    row = h2 + 2 * 2 * 2048 + 2 * 2048 + 4
    assert moe.kept_bytes() == 4 * h2 + 4224 + 4096 + qkv + 512 + 32768 + 256 * 5 + 8 * row + 2 * 3 * 2048 == 456608
    assert moe.saved_bytes("layernorm") == 2 * h2  # MLA's input norm and the MoE layer's pre-MLP norm
    assert moe.saved_bytes("moe_act") == 8 * 2 * 2048
    assert moe.saved_bytes("mla_up_proj") == 135168
    assert moe.kept_bytes(V3_RECIPE) == h2 + 4224 + 512 + 32768 + h2 + 1280 + 8 * (h2 + 4 * 2048 + 4) + 12288 \
        == 260000
    up = moe.work("mla_up_proj")
    assert up.token_linears == (shape.attention_linears[1], shape.attention_linears[3])  # q_b, kv_b
    assert moe.total_work(V3_RECIPE).flops_per_token(8) == 2 * (1536 * 128 * 192 + 512 * 128 * 256)
    assert moe.total_work(V3_RECIPE).row_kernel_elements == 3 * 2048
    assert dense.total_work(V3_RECIPE).flops_per_token(0) == up.flops_per_token(0) + 2 * 3 * 7168 * 18432


def test_the_refusals_name_the_field():
    gqa, mla = SMALL, SMALL_MLA
    assert check_recompute_modules(["moe", "moe_act", "moe"], gqa) == ("moe", "moe_act")
    assert check_recompute_modules([], gqa, full_recompute=True) == ()
    cases = [
        (["attn"], gqa, {}, "'attn' is not a module"),
        (["mhc"], gqa, {}, "hyper-connections, a layer the testbed does not model"),
        ("moe", gqa, {}, "a list of module names"),
        (["mla_up_proj"], gqa, {}, "only supported with multi_latent_attention"),
        (["moe_act"], gqa, {"grouped_experts": False}, "only supported with grouped expert GEMMs"),
        (["shared_experts"], gqa, {"shared_expert_overlap": True}, "shared-expert overlap"),
        (["moe"], gqa, {"moe_a2a_overlap": True}, "EP all-to-all overlap"),
        (["layernorm"], mla, {"fp8_delayed_scaling": True}, "delayed scaling"),
        (["moe_act"], mla, {"fp8_delayed_scaling": True}, "delayed scaling"),
        (["core_attn"], gqa, {"full_recompute": True}, "recompute = 'full'"),
    ]
    for modules, shape, flags, reason in cases:
        with pytest.raises(ScenarioError, match=reason) as e:
            check_recompute_modules(modules, shape, **flags)
        assert str(e.value).startswith(f"transformer.recompute_modules = {modules!r}: ")
    # a model without shared experts: Megatron checks the overlap only where there are some
    assert check_recompute_modules(["shared_experts"], replace(gqa, shared_experts=0), shared_expert_overlap=True) \
        == ("shared_experts",)
