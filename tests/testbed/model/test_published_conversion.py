"""Published throughput figures converted to step times and back in Megatron-LM's unit
(testbed/model/published_conversion.py), checked by hand on the figures of
docs/published.md: the MoE Parallel Folding paper's Mixtral-8x22B (arXiv 2504.14960,
Tables 2 and 3) and Megatron-Bridge's Qwen3-30B-A3B (docs/performance-summary.md, 25.09)."""

import pytest

from testbed.model.megatron_flops import megatron_flops_per_token
from testbed.model.published_conversion import (
    implied_flops_per_token,
    mfu_from_tflops,
    step_time_from_mfu,
    step_time_from_tflops,
    step_time_from_tokens_per_s,
    tflops_from_mfu,
    tflops_per_gpu,
    tokens_per_s_per_gpu,
)
from testbed.model.whole_model import shape_of
from testbed.scenario.scenario import Scenario

#: the H100's dense bf16 peak the folding paper's MFU divides by (TFLOP/s)
H100_BF16_SPEC = 989.5
#: the folding paper's Table 3 setting: global batch 256 sequences of 4,096 tokens on 128 H100
BATCH, SEQ, GPUS = 256, 4096, 128


def preset_shape(name: str):
    return shape_of(Scenario.from_dict({"model": {"preset": name}, "transformer": {"seq_len": SEQ}}))


def test_mixtral_8x22b_at_458_tflops_on_128_h100_is_a_4_33_s_step():
    """Table 2: Megatron-Core 458.3 TFLOP/s per GPU (bf16). The preset's Megatron FLOPs
    per token at 4,096 are 242.17 GFLOP (printed by ``testbed model mixtral-8x22b``), so
    by hand 256 x 4096 x 242.17e9 / (458.3e12 x 128) = 4.3287 s (4.32873 with the rounded
    242.17; 4.32869 with the exact count: both within 1e-4 s of 4.3287)."""
    shape = preset_shape("mixtral-8x22b")
    assert megatron_flops_per_token(shape, SEQ) / 1e9 == pytest.approx(242.17, abs=0.005)
    t = step_time_from_tflops(458.3, BATCH, SEQ, GPUS, shape)
    assert t == pytest.approx(4.3287, abs=1e-4)
    # back again: the same TFLOP/s, and 256 x 4096 / (4.3287 x 128) = 1,892.5 tokens/s per GPU
    assert tflops_per_gpu(t, BATCH, SEQ, GPUS, shape) == pytest.approx(458.3, rel=1e-12)
    assert tokens_per_s_per_gpu(t, BATCH, SEQ, GPUS) == pytest.approx(1892.5, abs=0.05)
    assert step_time_from_tokens_per_s(tokens_per_s_per_gpu(t, BATCH, SEQ, GPUS), BATCH, SEQ, GPUS) == (
        pytest.approx(t, rel=1e-12))


@pytest.mark.parametrize("mfu, tflops", [(0.463, 458.3), (0.493, 487.7)])  # Megatron-Core; with folding
def test_table_3s_mfu_times_989_5_is_table_2s_tflops_to_the_mfus_rounding(mfu, tflops):
    """Table 3 gives MFU to 0.1 percentage point, so MFU x 989.5 is known to +-0.05% x 989.5
    = +-0.495 TFLOP/s: 46.3% gives 458.14 against Table 2's 458.3 (0.16 off), 49.3% 487.82
    against 487.7 (0.12 off). The step times the two imply differ by as little: within
    0.05 / 46.25 = 0.108% (0.035% and 0.025%)."""
    half_unit = 0.0005 * H100_BF16_SPEC
    assert tflops_from_mfu(mfu, H100_BF16_SPEC) == pytest.approx(tflops, abs=half_unit)
    assert abs(mfu_from_tflops(tflops, H100_BF16_SPEC) - mfu) <= 0.0005
    shape = preset_shape("mixtral-8x22b")
    from_mfu = step_time_from_mfu(mfu, H100_BF16_SPEC, BATCH, SEQ, GPUS, shape)
    from_tflops = step_time_from_tflops(tflops, BATCH, SEQ, GPUS, shape)
    assert from_mfu == pytest.approx(from_tflops, rel=0.05 / 46.25)
    assert from_mfu == pytest.approx(tflops / (mfu * H100_BF16_SPEC) * from_tflops, rel=1e-12)


def test_qwen3_30b_bridges_241_tflops_at_10494_tokens_is_the_presets_megatron_count():
    """Megatron-Bridge 25.09, DGX-H100: 241 TFLOP/s and 10,494 tokens/s per GPU imply
    241e12 / 10,494 = 22.97 GFLOP a token; the preset's Megatron count at 4,096 is 23.01
    (+0.2%). The 241 is given to 3 digits, so the implied count is known to +-0.5 / 241 =
    +-0.21% (22.92 .. 23.01; 10,494's +-0.5 adds 0.005%): the preset lies inside."""
    implied = implied_flops_per_token(241, 10_494)
    assert implied / 1e9 == pytest.approx(22.97, abs=0.005)
    preset = megatron_flops_per_token(preset_shape("qwen3-30b-a3b"), SEQ)
    assert preset / 1e9 == pytest.approx(23.01, abs=0.005)
    assert round(100 * (preset / implied - 1), 1) == 0.2
    assert implied_flops_per_token(240.5, 10_494.5) <= preset <= implied_flops_per_token(241.5, 10_493.5)


@pytest.mark.parametrize("call", [
    lambda s: step_time_from_tflops(0, BATCH, SEQ, GPUS, s),
    lambda s: step_time_from_mfu(0.4, 0, BATCH, SEQ, GPUS, s),
    lambda s: tflops_per_gpu(0, BATCH, SEQ, GPUS, s),
    lambda s: tokens_per_s_per_gpu(1.0, BATCH, SEQ, 0),
    lambda s: implied_flops_per_token(241, -1),
])
def test_figures_that_are_not_positive_are_refused(call):
    with pytest.raises(ValueError, match="must be > 0"):
        call(preset_shape("qwen3-30b-a3b"))
