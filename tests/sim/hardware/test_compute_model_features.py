"""The roofline's model features, with hand numbers: SwiGLU experts of three matrices
(grouped and loop kernels, launches unchanged, page blocks over three matrices), fp8
GEMMs at the fp8 ceiling reading 1-byte weights plus their casts at the memory
bandwidth (blockwise and tensor scales), the shared experts' split, and the profiles'
fp8 ceilings."""

import pytest

from sim.hardware.compute import ComputeModel
from sim.hardware.shared_experts import SharedExperts
from testbed.core.errors import ScenarioError
from testbed.scenario.profile import load_profile, profile_from_dict
from testbed.scenario.scenario import Scenario


def profile(fp8=200.0, launch_us=0.0, memory=1000.0):
    d = load_profile("h200").to_dict()
    d["compute"].pop("gemm")  # the curves alone: the hand figures below (GEMM shapes: test_gemm_efficiency.py)
    d["compute"].update(memory_GBps=memory, launch_us=launch_us)
    d["compute"]["peak_tflops"].update(bf16=100.0, fp8=fp8)
    flat = [[1, 0.5], [1e6, 0.5]]
    d["compute"]["efficiency"] = {"grouped": flat, "loop": flat, "dense": flat, "attention": flat}
    return profile_from_dict(d, "test")


def test_swiglu_experts_are_three_matrices_in_two_launches():
    c = ComputeModel(profile(), "bf16")
    # 400 tokens x 2 x 3 x 1000 x 2000 = 4.8 GFLOP at 100 TFLOP/s x 0.5 = 96 us
    assert c.expert_time([100, 300], 1000, 2000, matrices=3) == pytest.approx(96e-6)
    assert c.expert_time([100, 300], 1000, 2000, kernel="loop", matrices=3) == pytest.approx(96e-6)
    assert c.expert_time([100, 300], 1000, 2000, backward=True, matrices=3) == pytest.approx(192e-6)
    slow = ComputeModel(profile(launch_us=500.0), "bf16")  # gate and up fused: still 2 GEMMs forward, 4 backward
    assert slow.expert_time([100, 300], 1000, 2000, matrices=3) == pytest.approx(2 * 500e-6)
    assert slow.expert_time([100, 300], 1000, 2000, backward=True, matrices=3) == pytest.approx(4 * 500e-6)
    starved = ComputeModel(profile(memory=1.0), "bf16")  # memory-bound: 3 x 1000 x 2000 x 2 bytes an expert
    assert starved.expert_time([1, 1], 1000, 2000, matrices=3) == pytest.approx(2 * 12e6 / 1e9)


def test_page_blocks_of_swiglu_average_over_its_three_matrices():
    c = ComputeModel(profile(), "bf16")
    k = c.profile.compute.block_half_width
    slower = lambda full, width: (width + k) / width * full / (full + k)  # noqa: E731
    # a page of 64 KiB in bf16 holds 32768 elements: 16 rows of w1 / w3 (F 2048 each), 32 of w2 (H 1024)
    two = 0.5 * (slower(1024, 16) + slower(2048, 32))
    assert c.block_slowdown(1024, 2048, 65536) == pytest.approx(two, rel=1e-12)
    assert c.block_slowdown(1024, 2048, 65536, matrices=3) == pytest.approx(
        (2 * slower(1024, 16) + slower(2048, 32)) / 3, rel=1e-12)


def test_fp8_experts_run_at_the_fp8_ceiling_and_pay_their_casts():
    c = ComputeModel(profile(), "bf16", gemm_dtype="fp8", fp8_scaling="tensor")
    # 4 x 256 rows x 128 x 256 = 33.6 MFLOP at 200 TFLOP/s x 0.5; casts of one expert of 256 rows from bf16:
    # its input (256 x 128) and w1 (128 x 256), the activation (256 x 256) and w2 (256 x 128), 3 bytes an
    # element, one 4-byte scale each
    gemm = 4 * 256 * 128 * 256 / 100e12
    casts = (256 * 128 + 128 * 256 + 256 * 256 + 256 * 128) * 3 + 4 * 4
    assert c.expert_time([256], 128, 256) == pytest.approx(gemm + casts / 1e12, rel=1e-12)
    blockwise = ComputeModel(profile(), "bf16", gemm_dtype="fp8")
    scales = 256 * 1 + 1 * 2 + 256 * 2 + 2 * 1  # input tiles, w1 blocks, activation tiles, w2 blocks
    assert blockwise.expert_time([256], 128, 256) == pytest.approx(gemm + (casts - 16 + 4 * scales) / 1e12, rel=1e-12)
    starved = ComputeModel(profile(memory=1.0), "bf16", gemm_dtype="fp8", fp8_scaling="tensor")
    assert starved.expert_time([1], 128, 256) > 2 * 128 * 256 / 1e9  # reads 1-byte weights, then the casts
    assert c.gemm_time(1e9, 4096, "dense") == pytest.approx(1e9 / 50e12)  # not a linear layer: bf16
    assert c.gemm_time(1e9, 4096, "dense", fp8=True) == pytest.approx(1e9 / 100e12)


def test_an_fp8_ceiling_is_needed_and_only_the_hopper_profiles_have_one():
    with pytest.raises(ScenarioError, match="compute.peak_tflops.fp8"):
        ComputeModel(profile(fp8=0.0), "bf16", gemm_dtype="fp8")
    for name in ("h200", "h100", "h800"):  # DeepGEMM's fp8 rate at 8192^3 (test_gemm_efficiency.py derives it)
        assert load_profile(name).compute.peak("fp8") == pytest.approx(1390.9e12, rel=1e-9)
        assert load_profile(name).source_of("compute.peak_tflops.fp8").startswith("published: a kernel figure")
    assert load_profile("a100-seed").compute.peak("fp8") == 0.0
    assert load_profile("local-cpu").compute.peak("fp8") == 0.0


def test_the_shared_experts_split_as_megatron_overlaps_them():
    """The first GEMM (gate and up, SwiGLU) and the activation beside the dispatch, the second
    and the gate beside the combine; backward the second's first, then the first's with the
    activation's backward."""
    s = Scenario.from_dict({"model": {"hidden_size": 64, "ffn_hidden_size": 128, "ffn_activation": "swiglu",
                                      "shared_experts": 2, "shared_ffn_hidden_size": 96, "shared_expert_gate": True,
                                      "dtype": "bf16"}, "workload": {"tokens_per_rank": 256}})
    sh = SharedExperts(s, ComputeModel(profile(), "bf16"))
    per = lambda flops: flops / 50e12  # noqa: E731
    # the SwiGLU activation of S F_s = 192 columns, a memory-bound kernel at 1,000 GB/s: forward
    # reads 2 x 192 and writes 192 bf16 values a token, backward reads 3 x 192 and writes 2 x 192
    act_f, act_b = 256 * 3 * 192 * 2 / 1e12, 256 * 5 * 192 * 2 / 1e12
    first, second = per(2 * 256 * 2 * 64 * 192), per(2 * 256 * 2 * 96 * 64) + per(2 * 256 * 64)
    assert sh.forward_s == pytest.approx((first + act_f, second))
    assert sh.backward_s == pytest.approx((2 * second, 2 * first + act_b))
    assert sh.params == 2 * 3 * 64 * 96 + 64
    assert sh.activation_bytes == 256 * 2 * (2 * 96 + 64) * 2
