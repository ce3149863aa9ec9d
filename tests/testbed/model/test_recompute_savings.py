"""What the simulator's activation figures lose under Megatron-Core's recompute modules
(testbed/model/whole_model.py: ``recompute_savings``, ``layer_activation_bytes``'
``recompute_modules``, ``expert_row_bytes``, ``recompute_modules_of``), by hand on
tests/testbed/policy/test_recompute_modules.py's small shape and DeepSeek-V3's MLA."""

from dataclasses import replace

import pytest

from testbed.model.recompute_modules import RECOMPUTE_MODULES, LayerRecompute
from testbed.model.transformer_shape import TransformerShape
from testbed.model.whole_model import (
    expert_row_bytes,
    layer_activation_bytes,
    recompute_modules_of,
    recompute_savings,
)
from testbed.scenario.scenario import Scenario

SMALL = TransformerShape(layers=2, hidden=64, heads=4, kv_heads=4, dense_ffn=128, vocab=10, ffn_matrices=3,
                         experts=8, expert_ffn=32, top_k=2, moe_every=2, shared_experts=1, shared_ffn=48)
SMALL_MLA = replace(SMALL, attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8)
SEQ = 32
V3_RECIPE = ("mlp", "mla_up_proj", "moe_act", "layernorm")


def test_the_three_parts_sum_to_what_the_layer_saves():
    """The layer's own tensors, top_k rows and the shared experts' add up to
    ``kept_bytes`` without the modules less with them, split or not, at 2 and 4 bytes."""
    for shape in (SMALL, SMALL_MLA):
        for moe in (False, True):
            layer = LayerRecompute(shape, moe, SEQ)
            for modules in [(m,) for m in RECOMPUTE_MODULES] + [V3_RECIPE, RECOMPUTE_MODULES]:
                for kw in ({}, {"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"dtype_bytes": 4}):
                    parts = recompute_savings(shape, moe, modules, SEQ, **kw)
                    whole = layer.kept_bytes((), **kw) - layer.kept_bytes(modules, **kw)
                    assert parts.layer + shape.top_k * moe * parts.row + parts.shared == whole


def test_an_moe_layer_s_savings_by_part():
    """Per token, bf16: moe frees the router's fp32 scores and byte map (32 + 8) of the
    layer, each row's 324 bytes, the shared expert's 192 + 96; moe_act a row's activation
    (64); layernorm the pre-MLP norm's output (128) of the layer."""
    moe = recompute_savings(SMALL, True, ("moe",))
    assert (moe.layer, moe.row, moe.shared) == (40, 324, 288)
    act = recompute_savings(SMALL, True, ("moe_act", "layernorm"))
    assert (act.layer, act.row, act.shared) == (128, 64, 0)


def test_layer_activation_bytes_loses_the_layer_s_part_per_token_at_the_model_dtype():
    """A dense layer, 2 sequences of 32: mlp frees the pre-MLP norm's output (64), SwiGLU's
    256 and 128 elements a token; core_attn the softmax statistics (4 heads, fp32: 16 bytes
    at any dtype). At fp32 the figure is twice the 16-bit one less the fp32 savings."""
    tokens = 2 * SEQ
    base = layer_activation_bytes(SMALL, SEQ, 2, moe=False)
    assert layer_activation_bytes(SMALL, SEQ, 2, moe=False, recompute_modules=("mlp",)) == base - tokens * 2 * 448
    assert layer_activation_bytes(SMALL, SEQ, 2, moe=False, recompute_modules=("core_attn",)) == base - tokens * 16
    fp32 = layer_activation_bytes(SMALL, SEQ, 2, moe=False, dtype_bytes=4, recompute_modules=("mlp", "core_attn"))
    assert fp32 == 2 * base - tokens * (4 * 448 + 16)
    # tensor parallelism 2: SwiGLU's outputs split by columns, the norm's output whole (split with SP)
    tp = layer_activation_bytes(SMALL, SEQ, 2, moe=False, tp=2)
    assert layer_activation_bytes(SMALL, SEQ, 2, moe=False, tp=2, recompute_modules=("mlp",)) == \
        tp - tokens * 2 * (64 + 384 / 2)
    sp = layer_activation_bytes(SMALL, SEQ, 2, moe=False, tp=2, sequence_parallel=True)
    assert layer_activation_bytes(SMALL, SEQ, 2, moe=False, tp=2, sequence_parallel=True,
                                  recompute_modules=("mlp",)) == sp - tokens * 2 * 448 / 2
    with pytest.raises(ValueError, match="not with full recompute"):
        layer_activation_bytes(SMALL, SEQ, 2, moe=False, recompute=True, recompute_modules=("mlp",))


def test_deepseek_v3_s_mla_up_proj_frees_q_k_v_and_the_normed_latents():
    """DeepSeek-V3's MLA (the figures of test_model_feature_closed_forms): mla_up_proj
    frees Q and K (128 x 192 each), V (128 x 128) and the up projections' fused norms'
    outputs (1536 + 512), 67,584 elements a token."""
    shape = TransformerShape(layers=1, hidden=7168, heads=128, kv_heads=128, dense_ffn=18432, vocab=1,
                             attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128)
    s = 4096
    base = layer_activation_bytes(shape, s, 1, moe=True)
    assert layer_activation_bytes(shape, s, 1, moe=True, recompute_modules=("mla_up_proj",)) == \
        base - 2 * s * (65536 + 2048)


def test_an_expert_row_keeps_what_is_left_and_nothing_below():
    assert expert_row_bytes(64, 32, 3, 2) == (64 + 3 * 32) * 2 == 320
    assert expert_row_bytes(64, 32, 3, 2, saved=64) == 256  # moe_act: the activation's 32 x 2 bytes
    assert expert_row_bytes(64, 32, 3, 2, saved=324) == 0  # moe: the row and its fp32 probability, all freed
    assert expert_row_bytes(64, 128, 3, 2, saved=64 * 2 + 3 * 128 * 2 + 4) == 0  # moe with F > H: all freed


def test_the_scenario_s_modules_in_order_and_none_without_the_whole_transformer():
    s = Scenario.from_dict({"transformer": {"enabled": True, "recompute_modules": " moe_act, layernorm ,"}})
    assert recompute_modules_of(s) == ("moe_act", "layernorm")
    assert recompute_modules_of(s.replace(transformer={"enabled": False})) == ()
    assert recompute_modules_of(Scenario()) == ()


def test_fp8_gemms_keep_the_linears_inputs_quantized():
    """Under fp8 GEMMs (1 byte an element and, blockwise, a 4-byte scale per 128: 1.03125) the
    linears' inputs are kept quantized (Transformer Engine's saved quantized input). SMALL (H 64,
    4 heads of 16, SwiGLU) in bf16: a dense layer's input norm output (64), attention output (64),
    pre-MLP norm output (64) and SwiGLU output (128) save 320 x 0.96875 = 310 bytes a token; an
    MoE layer's first two (128: its pre-MLP norm output feeds the router, a bf16 GEMM, and stays),
    a row's input and activation (64 + 32 = 96: 93 bytes), the shared expert's activation (48:
    46.5 bytes). What a module frees is not saved twice: under moe_act a row keeps only its input."""
    fp8 = 1 + 4 / 128
    dense = recompute_savings(SMALL, False, (), SEQ, fp8_input_bytes=fp8)
    assert (dense.layer, dense.row, dense.shared) == (320 * (2 - fp8), 0.0, 0.0) == (310.0, 0.0, 0.0)
    moe = recompute_savings(SMALL, True, (), SEQ, fp8_input_bytes=fp8)
    assert (moe.layer, moe.row, moe.shared) == (124.0, 93.0, 46.5)
    act = recompute_savings(SMALL, True, ("moe_act",), SEQ, fp8_input_bytes=fp8)
    assert act.row == 32 * 2 + 64 * (2 - fp8)  # the activation freed whole, the input quantized
    # layer_activation_bytes takes the layer's part off per token of the micro-batch (split over tp as kept)
    plain = layer_activation_bytes(SMALL, SEQ, 1, moe=False)
    assert plain - layer_activation_bytes(SMALL, SEQ, 1, moe=False, fp8_input_bytes=fp8) == SEQ * 310.0
    assert layer_activation_bytes(SMALL, SEQ, 1, moe=False, recompute=True, fp8_input_bytes=fp8) == \
        layer_activation_bytes(SMALL, SEQ, 1, moe=False, recompute=True)  # full recompute keeps the input only


def test_gqa_keeps_keys_and_values_at_the_key_value_heads():
    """Transformer Engine's attention takes K and V unrepeated: 8 query heads of 16 and 2
    key-value heads keep Q and the output's input 128 wide each, K and V 32 each."""
    gqa = TransformerShape(layers=1, hidden=128, heads=8, kv_heads=2, dense_ffn=256, vocab=10)
    assert gqa.attention_activation_elements == (2 * 128 + 2 * 32, 0)
    kept = {t.name: t.elements for t in LayerRecompute(gqa, False, SEQ).tensors}
    assert (kept["query"], kept["key"], kept["value"], kept["attention_output"]) == (128, 32, 32, 128)
