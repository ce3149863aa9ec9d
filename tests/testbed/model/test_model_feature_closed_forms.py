"""The closed forms the simulator reads for the models people train (issue 24), with hand
numbers: the GEMMs' shapes, the activations a layer keeps (Korthikanti et al.'s standard
layer with SwiGLU's, head_dim's and MLA's terms; Megatron-LM's 18 + 4 F / H and its
SwiGLU 18 + 6 F / H), MLA's up projections Megatron can recompute, the expert rows'
activations, fp8's casts and copies, and the gradients the dense sync sums."""

import numpy as np
import pytest

from testbed.model import fp8_casts
from testbed.model.mtp_layers import controller_scenario, mtp_block_params
from testbed.model.transformer_shape import TransformerShape
from testbed.model.whole_model import (
    activation_bytes_per_layer,
    block_grad_bytes,
    expert_row_elements,
    layer_activation_bytes,
    shape_of,
    shared_expert_grad_bytes,
)
from testbed.scenario.scenario import Scenario

STANDARD = TransformerShape(layers=2, hidden=1024, heads=16, kv_heads=4, dense_ffn=4096, vocab=1000)
V3_MLA = {"attention": "mla", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "v_head_dim": 128}


def test_the_gemm_shapes_add_up_to_the_matrix_parameters():
    gqa = TransformerShape(layers=1, hidden=2880, heads=64, kv_heads=8, dense_ffn=2880, vocab=1, head_size=64)
    assert gqa.attention_linears == [(2880, (64 + 16) * 64), (64 * 64, 2880)]  # fused QKV, O
    mla = TransformerShape(layers=1, hidden=7168, heads=128, kv_heads=128, dense_ffn=1, vocab=1, **V3_MLA)
    assert mla.attention_linears == [(7168, 1536), (1536, 128 * 192), (7168, 512 + 64), (512, 128 * 256),
                                     (128 * 128, 7168)]
    for shape in (gqa, mla, STANDARD):
        assert sum(k * n for k, n in shape.attention_linears) == shape.attention_matrix_params
    swiglu = TransformerShape(layers=1, hidden=64, heads=1, kv_heads=1, dense_ffn=96, vocab=1, ffn_matrices=3)
    assert swiglu.ffn_linears(96) == [(64, 192), (96, 64)]  # gate and up fused, as linear_fc1
    assert sum(k * n for k, n in swiglu.ffn_linears(96)) == swiglu.dense_ffn_matrix_params == 3 * 64 * 96


@pytest.mark.parametrize("tp, sp", [(1, False), (4, False), (4, True)])
@pytest.mark.parametrize("moe", [False, True])
def test_the_standard_layer_keeps_korthikantis_bytes(tp, sp, moe):
    args = {"tp": tp, "sequence_parallel": sp}
    # an MoE layer has no dense FFN: less its first GEMM's and gelu's outputs (16 s b H, split) and its input
    # (2 s b H, whole without sequence parallelism; the MoE layer's own), no experts here (no router)
    ffn = 2048 * 4 * 1024 * (18 / tp if sp else 16 / tp + 2) if moe else 0
    # K and V at the 4 key-value heads' width, H / 4 each, where Korthikanti counts H each (bf16, split)
    kv = 2 * 2048 * 4 * (2 * 1024 - 2 * 1024 // 4) / tp
    assert layer_activation_bytes(STANDARD, 2048, 4, moe, **args) == activation_bytes_per_layer(
        2048, 4, 1024, 16, **args) - ffn - kv
    assert layer_activation_bytes(STANDARD, 2048, 4, moe, recompute=True, **args) == 2 * 2048 * 4 * 1024 / (
        tp if sp else 1)


def test_a_dense_ffn_keeps_megatrons_18_plus_4_or_6_f_over_h():
    """Megatron-LM's theoretical_memory_usage: s b H (18 + 4 F / H) for a gelu layer;
    SwiGLU's first GEMM writes 2 F (kept for its backward), so 18 + 6 F / H."""
    s, b, h, f = 2048, 2, 1024, 2816
    gelu = TransformerShape(layers=1, hidden=h, heads=16, kv_heads=16, dense_ffn=f, vocab=1)
    swiglu = TransformerShape(layers=1, hidden=h, heads=16, kv_heads=16, dense_ffn=f, vocab=1, ffn_matrices=3)
    assert layer_activation_bytes(gelu, s, b, moe=False) == s * b * (18 * h + 4 * f)
    assert layer_activation_bytes(swiglu, s, b, moe=False) == s * b * (18 * h + 6 * f)
    # tensor parallel without sequence parallelism: the FFN's inner tensors split, 10 s b H whole
    assert layer_activation_bytes(swiglu, s, b, moe=False, tp=4) == s * b * (10 * h + (8 * h + 6 * f) / 4)
    # an MoE layer keeps the standard layer's figure less its FFN term, 18 of its 34 s b H: its FFN's input and
    # its experts' rows are counted by the MoE layer (issue 25)
    assert layer_activation_bytes(swiglu, s, b, moe=True) == 16 * s * b * h


def test_head_dim_widens_the_attention_tensors():
    shape = TransformerShape(layers=1, hidden=4096, heads=64, kv_heads=4, dense_ffn=16384, vocab=1, head_size=128)
    # Q and O's input at n d = 8192, K and V at the 4 key-value heads' k d = 512
    assert shape.attention_activation_elements == (2 * 64 * 128 + 2 * 4 * 128, 0)
    assert layer_activation_bytes(shape, 1024, 1, moe=True) == 1024 * (16 * 4096 + 2 * (17408 - 4 * 4096))


def test_mla_keeps_its_heads_tensors_and_latents_and_can_recompute_its_up_projections():
    """DeepSeek-V3's MLA: Q and K of 128 x 192, V and the output's input of 128 x 128, split
    by heads; the latents whole: the query's 1536 before and after its norm, the key-value
    latent with the RoPE key (512 + 64) and after its norm (512). mla_up_proj recomputes
    Q, K and V."""
    shape = TransformerShape(layers=1, hidden=7168, heads=128, kv_heads=128, dense_ffn=18432, vocab=1, **V3_MLA)
    split, whole = 2 * 128 * 192 + 2 * 128 * 128, 2 * 1536 + 512 + 64 + 512
    assert shape.attention_activation_elements == (split, whole) == (81920, 4160)
    assert shape.mla_up_proj_elements == 2 * 128 * 192 + 128 * 128 == 65536
    s = 4096
    standard = 16 * s * 7168  # an MoE layer: Korthikanti's 34 s b H less the FFN's 18 (issue 25)
    assert layer_activation_bytes(shape, s, 1, moe=True) == standard + 2 * s * (split - 4 * 7168 + whole)
    # the up projections' outputs and the normed latents (1536 + 512), which Megatron-Core frees too
    assert layer_activation_bytes(shape, s, 1, moe=True, recompute_modules=("mla_up_proj",)) == \
        standard + 2 * s * (split - 65536 - 2048 - 4 * 7168 + whole)
    assert layer_activation_bytes(shape, s, 1, moe=True, tp=8, sequence_parallel=True) == \
        standard / 8 + 2 * s * (split - 4 * 7168 + whole) / 8
    assert STANDARD.mla_up_proj_elements == 0


def test_an_expert_row_keeps_its_input_first_gemms_output_and_activation():
    assert expert_row_elements(64, 128) == 64 + 128 + 128  # gelu: the pre-activation, the activation
    assert expert_row_elements(64, 128, 3) == 64 + 2 * 128 + 128  # SwiGLU: gate and up, the activation


def test_fp8_casts_by_hand():
    """A GEMM of 300 tokens, 256 inputs, 384 outputs from bf16: every cast reads 2 bytes and
    writes 1 an element; blockwise scales (4 bytes) per 1 x 128 tile along the
    contraction (3 x 128 tiles of a row of 384 need 3; 300 rows tiled along the rows need
    3 per column) and per 128 x 128 weight block; tensor scaling one per tensor."""
    rows, k, n = 300, 256, 384
    fwd = rows * k * 3 + rows * 2 * 4 + k * n * 3 + 2 * 3 * 4
    assert float(fp8_casts.gemm_cast_bytes(rows, k, n, 2, "blockwise")) == fwd
    bwd = rows * n * 3 + rows * 3 * 4 + rows * k * 3 + k * 3 * 4 + rows * n * 3 + n * 3 * 4
    assert float(fp8_casts.gemm_cast_bytes(rows, k, n, 2, "blockwise", backward=True)) == bwd
    assert float(fp8_casts.gemm_cast_bytes(rows, k, n, 2, "tensor")) == rows * k * 3 + k * n * 3 + 2 * 4
    assert float(fp8_casts.gemm_cast_bytes(rows, k, n, 2, "tensor", backward=True)) == \
        (2 * rows * n + rows * k) * 3 + 3 * 4
    got = fp8_casts.gemm_cast_bytes(np.array([0, rows]), k, n, 2, "blockwise")
    assert got[0] == 0 and got[1] == fwd  # no tokens, no casts (nor the weight's)
    assert fp8_casts.weight_copy_bytes(k, n, "blockwise") == k * n + 6 * 4
    assert fp8_casts.weight_copy_bytes(k, n, "tensor") == k * n + 4
    with pytest.raises(ValueError, match="scaling"):
        fp8_casts.weight_copy_bytes(k, n, "row")


def whole(**fields):
    data = {"model": {"hidden_size": 64, "ffn_hidden_size": 128, "num_experts": 8, "num_layers": 3,
                      "dtype": "bf16", "ffn_activation": "swiglu", "shared_experts": 2, "shared_ffn_hidden_size": 96,
                      "shared_expert_gate": True},
            "transformer": {"enabled": True, "num_heads": 4, "seq_len": 128, "vocab_size": 1000, "moe_every": 2,
                            "first_dense_layers": 2, "mtp_layers": 1}}
    for section, values in fields.items():
        data.setdefault(section, {}).update(values)
    return Scenario.from_dict(data)


def test_the_dense_sync_sums_the_shared_experts_dense_first_layers_and_mtp():
    s = whole()
    shape = shape_of(s)
    shared = (2 * 3 * 64 * 96 + 64) * 2  # two SwiGLU shared experts and the gate, bf16
    assert shared_expert_grad_bytes(s) == shared
    attention, ffn = 4 * 64 * 64, 3 * 64 * 256  # 4 heads of 16: Q, K, V, O; the dense FFN of 4 H
    embedding = 1000 * 64
    block = (2 * attention + ffn) * 2
    cs = controller_scenario(s)  # MoE layers 0-2 the model's, 3 the MTP module's
    mtp = 2 * 64 * 64 + attention  # its projection and attention; its shared experts are its MoE layer's
    assert mtp_block_params(shape) == mtp
    assert block_grad_bytes(cs, 0) == block + (embedding + 2 * (attention + ffn)) * 2 + shared
    assert block_grad_bytes(cs, 1) == block_grad_bytes(cs, 2) == block + shared
    assert block_grad_bytes(cs, 3) == (embedding + mtp) * 2 + shared
    moe_stack = s.replace(transformer={"enabled": False})
    assert block_grad_bytes(moe_stack, 1) == shared  # the MoE stack's shared experts sync as well
    plain = s.replace(model={"shared_experts": 0}, transformer={"first_dense_layers": 0, "mtp_layers": 0})
    assert block_grad_bytes(plain, 0) == block + embedding * 2
