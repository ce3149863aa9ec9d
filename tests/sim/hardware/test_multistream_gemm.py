"""Transformer Engine's multi-stream grouped GEMM (``sim.expert_kernel = multistream``,
sim.hardware.compute): its fixed time a call recomputed from the published TE v2.2 figures it
is fitted to (docs/published.md section 9), the figures' fit, one expert a GPU against the
grouped launch, fine-grained experts' waves, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from sim.hardware.compute import GEMMS_BACKWARD, GEMMS_FORWARD, ComputeModel
from testbed.core.errors import ScenarioError
from testbed.model.recompute_modules import GROUPED_EXPERT_KERNELS
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.study.published_runs import TE_GROUPED_GEMM_FIGURES

GPU = ("h100", "h800", "h200")


def figures(implementation: str):
    return [f for f in TE_GROUPED_GEMM_FIGURES if f.implementation == implementation]


def model_seconds(compute: ComputeModel, f, kernel: str) -> float:
    """The model's seconds of one published call: ``groups`` GEMMs of (m, n, k) at m tokens an expert."""
    m = np.full((1, f.groups), float(f.m))
    if kernel == "multistream":
        return float(compute.multistream_call_seconds(m, f.n, f.k, [f.m])[0])
    return float(compute.grouped_call_seconds(m, f.n, f.k, [f.m])[0])


def tflops(f, seconds: float) -> float:
    return 2.0 * f.groups * f.m * f.n * f.k / seconds / 1e12


def test_call_time_is_the_mean_residual_of_the_te_2_2_figures():
    """The profiles' 40 us is the mean of the two TE v2.2 figures' times less the model's GEMMs
    alone (34.0 and 46.5 us), rounded to the microsecond."""
    compute = ComputeModel(load_profile("h100"), "bf16")
    call = load_profile("h100").compute.gemm.multistream_call_us
    residuals = [2.0 * f.groups * f.m * f.n * f.k / (f.tflops * 1e12) - (model_seconds(compute, f, "multistream")
                 - call * 1e-6) for f in figures("te-2.2")]
    assert np.round(np.array(residuals) * 1e6, 1).tolist() == [34.0, 46.5]
    assert call == round(float(np.mean(residuals)) * 1e6)
    for name in GPU:
        assert load_profile(name).compute.gemm.multistream_call_us == call  # the same GH100


def test_te_2_2_figures_within_3_percent_of_the_fit():
    """A fit's quality on the points it is fitted to (no TE v2.2 figure is held out)."""
    compute = ComputeModel(load_profile("h100"), "bf16")
    got = [tflops(f, model_seconds(compute, f, "multistream")) / f.tflops - 1 for f in figures("te-2.2")]
    assert np.round(got, 3).tolist() == [-0.029, 0.026]


def test_te_2_7_figures_lie_nearer_the_grouped_model():
    """What the Bridge row's kernel choice rests on (configs/published/qwen3-30b-16-h100.toml): TE
    v2.7's multi-stream figures are within 17% of the grouped launch and 21-26% above multistream."""
    compute = ComputeModel(load_profile("h100"), "bf16")
    grouped = [tflops(f, model_seconds(compute, f, "grouped")) / f.tflops - 1 for f in figures("te-2.7")]
    multistream = [tflops(f, model_seconds(compute, f, "multistream")) / f.tflops - 1 for f in figures("te-2.7")]
    assert np.round(grouped, 2).tolist() == [-0.03, 0.17]
    assert np.round(multistream, 2).tolist() == [-0.21, -0.26]


def test_one_expert_a_gpu_is_the_grouped_launch_plus_the_calls():
    """One expert alone fills the same waves in either kernel, so multistream differs from the
    grouped launch by its calls' fixed time only: 2 forward, 4 backward."""
    compute = ComputeModel(load_profile("h100"), "bf16")
    call = compute.profile.compute.gemm.multistream_call_us * 1e-6
    tokens = np.array([[16384.0]])
    for backward, calls in ((False, GEMMS_FORWARD), (True, GEMMS_BACKWARD)):
        grouped = compute.expert_times(tokens, 6144, 8192, "grouped", backward, matrices=3)[0]
        multi = compute.expert_times(tokens, 6144, 8192, "multistream", backward, matrices=3)[0]
        assert multi - grouped == pytest.approx(calls * call, rel=1e-9)


def test_fine_grained_experts_pay_their_own_waves():
    """16 experts of 2,048 rows, H 3,584, F 1,280 (Qwen2-57B-A14B's on an EP rank at expert TP 2):
    fc1's 2,048 x 2,560 outputs are 160 tiles of 128 x 256, two waves of 132 SMs at 160 / 264 =
    0.606, where one grouped launch fills 2,560 tiles at 0.970; the forward is at least that
    slower than the grouped launch's, and at most with its fc2 (2,048 x 3,584: 224 tiles, 0.848)."""
    compute = ComputeModel(load_profile("h100"), "bf16")
    call = compute.profile.compute.gemm.multistream_call_us * 1e-6
    tokens = np.full((1, 16), 2048.0)
    grouped = compute.expert_times(tokens, 3584, 1280, "grouped", False, matrices=3)[0]
    multi = compute.expert_times(tokens, 3584, 1280, "multistream", False, matrices=3)[0] - GEMMS_FORWARD * call
    assert 0.970 / 0.848 <= multi / grouped <= 0.970 / 0.606


def test_multistream_needs_the_shape_model():
    with pytest.raises(ScenarioError) as e:
        ComputeModel(load_profile("local-cpu"), "fp32").expert_times(np.array([[64.0]]), 64, 128, "multistream")
    assert e.value.field == "sim.expert_kernel" and e.value.value == "multistream"


def test_multistream_is_megatrons_grouped_gemm():
    """moe_act recompute (Megatron-Core needs --moe-grouped-gemm) is allowed with it, not with loop."""
    assert "multistream" in GROUPED_EXPERT_KERNELS and "loop" not in GROUPED_EXPERT_KERNELS
    assert Scenario.from_dict({"sim": {"expert_kernel": "multistream"}}).sim.expert_kernel == "multistream"
    with pytest.raises(ScenarioError) as e:
        Scenario.from_dict({"sim": {"expert_kernel": "streams"}})
    assert e.value.field == "sim.expert_kernel"
