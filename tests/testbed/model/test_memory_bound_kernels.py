"""The memory-bound kernels' bytes (``testbed.model.memory_bound_kernels``), counted by hand
on small shapes, and the seconds the simulator adds for them: exactly their bytes at the
profile's memory bandwidth (the dense blocks, the route and the experts, against the same
run at a bandwidth so high that they cost nothing)."""

from __future__ import annotations

import pytest

from sim.hardware.compute import ComputeModel
from sim.hardware.dense_layers import DenseLayers
from testbed.model.memory_bound_kernels import (
    KernelBytes,
    attention_sublayer_bytes,
    dense_ffn_sublayer_bytes,
    expert_row_kernel_bytes,
    loss_bytes,
    moe_norm_residual_bytes,
    router_bytes,
    shared_expert_bytes,
    token_slot_bytes,
)
from testbed.model.transformer_shape import TransformerShape
from testbed.scenario.profile import load_profile, profile_from_dict
from testbed.scenario.scenario import Scenario

#: 4 layers of H 64, 8 query and 2 KV heads of 8, a dense FFN of 96, 16 experts of 32, top-4,
#: SwiGLU, vocabulary 1,000; one shared expert of 48
SHAPE = TransformerShape(layers=4, hidden=64, heads=8, kv_heads=2, dense_ffn=96, vocab=1000, experts=16,
                         expert_ffn=32, top_k=4, ffn_matrices=3, shared_experts=1, shared_ffn=48)


def test_the_attention_sublayer_by_hand():
    """GQA, bf16: the norm 2 x 64 forward, 3 x 64 backward; RoPE on (8 + 2) x 8 = 80 values of
    q and k, read and written (160 both ways); the residual add 3 x 64 both ways:
    forward 128 + 160 + 192 = 480 values, backward 192 + 160 + 192 = 544; x 2 bytes."""
    assert attention_sublayer_bytes(SHAPE, 2) == KernelBytes(960, 1088)


def test_mla_rotates_only_its_rope_part_and_norms_its_latents():
    """MLA of 8 heads, RoPE 4 a head and 4 for the shared key, latents 16 + 24: RoPE 2 x 36,
    latent norms 2 x 40 forward and 3 x 40 backward, plus the norm and the residual (5 H, 6 H)."""
    mla = TransformerShape(layers=1, hidden=64, heads=8, kv_heads=8, dense_ffn=96, vocab=10, attention="mla",
                           q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    assert attention_sublayer_bytes(mla, 1) == KernelBytes(5 * 64 + 2 * 40 + 2 * 36, 6 * 64 + 3 * 40 + 2 * 36)


def test_the_ffn_and_moe_kernels_by_hand():
    """bf16. Dense FFN sublayer: norm and residual 5 x 64 forward, 6 x 64 backward, SwiGLU on 96:
    3 x 96 forward, 5 x 96 backward. Router over 16 experts: 9 x 16 bytes forward (fp32 logits
    read, fp32 scores and a byte of map written), 12 x 16 backward. A row of an expert of 32:
    its SwiGLU 3 x 32 / 5 x 32, sorted on its GPU 4 x 64 both ways. A slot: permutation 2 x 64
    and its inverse 64 + 64 / 4 = 80. Shared experts of 48: 3 x 48, 5 x 48. Loss over 1,000
    logits: 2 + 4 + 4 bytes forward, 4 + 2 backward."""
    assert dense_ffn_sublayer_bytes(SHAPE, 2) == KernelBytes((5 * 64 + 3 * 96) * 2, (6 * 64 + 5 * 96) * 2)
    assert moe_norm_residual_bytes(SHAPE, 2) == KernelBytes(5 * 64 * 2, 6 * 64 * 2)
    assert router_bytes(SHAPE) == KernelBytes(forward_token=9 * 16, backward_token=12 * 16)
    assert expert_row_kernel_bytes(SHAPE, 2, True) == KernelBytes(forward_row=(96 + 256) * 2,
                                                                  backward_row=(160 + 256) * 2)
    assert expert_row_kernel_bytes(SHAPE, 2, False, expert_ffn=16) == KernelBytes(forward_row=48 * 2,
                                                                                  backward_row=80 * 2)
    assert token_slot_bytes(SHAPE, 2) == KernelBytes(forward_row=208 * 2, backward_row=208 * 2)
    assert shared_expert_bytes(SHAPE, 2) == KernelBytes(144 * 2, 240 * 2)
    assert loss_bytes(1000, 2) == KernelBytes(10_000, 6_000)


def _compute(memory_GBps: float) -> ComputeModel:
    d = load_profile("h100").to_dict()
    d["compute"].pop("gemm", None)  # the flat curves alone: no GEMM shape model (sim.hardware.gemm_efficiency)
    d["collectives"]["kernel_sms"] = 0  # no SMs taken by NCCL kernels (sim.step.kernel_sms)
    d["compute"].update(memory_GBps=memory_GBps, launch_us=0.0)
    return ComputeModel(profile_from_dict(d, "test"), "bf16")


def test_the_dense_blocks_pay_their_kernels_at_the_memory_bandwidth():
    """A whole transformer of two layers, the first dense, the second MoE (first_dense_layers
    1), 512 tokens a GPU: block 0 holds both layers, so its kernels are two attention
    sublayers, a dense-FFN one and an MoE layer's norm and residual; the head adds the loss.
    Against the same blocks at 1e12 GB/s (kernels free), at 1,000 GB/s."""
    s = Scenario.from_dict({
        "model": {"hidden_size": 64, "ffn_hidden_size": 32, "num_layers": 1, "num_experts": 16, "top_k": 4,
                  "ffn_activation": "swiglu", "dtype": "bf16"},
        "transformer": {"enabled": True, "num_heads": 8, "num_kv_heads": 2, "seq_len": 128, "vocab_size": 1000,
                        "dense_ffn_hidden_size": 96, "first_dense_layers": 1},
        "workload": {"tokens_per_rank": 512}, "pager": {"enabled": False}})
    slow, free = DenseLayers(s, _compute(1000.0)), DenseLayers(s, _compute(1e12))
    shape = slow.shape
    attention, ffn, moe = (attention_sublayer_bytes(shape, 2), dense_ffn_sublayer_bytes(shape, 2),
                           moe_norm_residual_bytes(shape, 2))
    fwd = 512 * (2 * attention.forward_token + ffn.forward_token + moe.forward_token) / 1e12
    bwd = 512 * (2 * attention.backward_token + ffn.backward_token + moe.backward_token) / 1e12
    assert slow.forward_s[0] - free.forward_s[0] == pytest.approx(fwd, rel=1e-6)
    assert slow.backward_s[0] - free.backward_s[0] == pytest.approx(bwd, rel=1e-6)
    assert slow.head_forward_s - free.head_forward_s == pytest.approx(512 * 10_000 / 1e12, rel=1e-6)
    assert slow.head_backward_s - free.head_backward_s == pytest.approx(512 * 6_000 / 1e12, rel=1e-6)
