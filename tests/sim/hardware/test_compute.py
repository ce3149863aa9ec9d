"""Roofline compute and copy times, with hand numbers."""

import numpy as np
import pytest

from sim.hardware.compute import ComputeModel
from testbed.scenario.profile import MiB, load_profile, profile_from_dict


def profile(grouped=((1, 0.5), (10_000, 0.5)), loop=((10, 0.1), (1000, 0.9)), dense=((1, 0.5), (10_000, 0.5)),
            attention=((512, 0.35), (8192, 0.55)), bf16=100.0, memory=1000.0, launch_us=1.0):
    d = load_profile("h200").to_dict()
    d["compute"].pop("gemm")  # the curves alone: the hand figures below (GEMM shapes: test_gemm_efficiency.py)
    d["compute"].update(memory_GBps=memory, launch_us=launch_us)
    d["compute"]["peak_tflops"]["bf16"] = bf16
    d["compute"]["efficiency"] = {k: [list(p) for p in v] for k, v in
                                  {"grouped": grouped, "loop": loop, "dense": dense, "attention": attention}.items()}
    d["copy"].update(table=[[1, 10.0], [4, 20.0]], latency_us=3.0)
    d["overheads"]["router_us"] = 30.0
    return profile_from_dict(d, "test")


def test_grouped_forward_by_hand():
    c = ComputeModel(profile(), "bf16")
    # 400 tokens x 4 x 1000 x 2000 = 3.2 GFLOP at 100 TFLOP/s x 0.5 = 64 us
    assert c.expert_time([100, 300], 1000, 2000) == pytest.approx(64e-6)


def test_backward_is_twice_the_flops_and_four_gemms():
    c = ComputeModel(profile(), "bf16")
    assert c.expert_time([100, 300], 1000, 2000, backward=True) == pytest.approx(128e-6)
    slow_launch = ComputeModel(profile(launch_us=50.0), "bf16")  # launches are a floor
    assert slow_launch.expert_time([100, 300], 1000, 2000) == pytest.approx(2 * 50e-6)
    assert slow_launch.expert_time([100, 300], 1000, 2000, backward=True) == pytest.approx(4 * 50e-6)
    assert slow_launch.expert_time([100, 300], 1000, 2000, kernel="loop") == pytest.approx(2 * 2 * 50e-6)


def test_loop_sums_experts_at_their_own_efficiency():
    c = ComputeModel(profile(), "bf16")
    # 100 tokens sits halfway (in log) between 10 and 1000: efficiency 0.5
    t100 = 4 * 100 * 1000 * 2000 / (100e12 * 0.5)  # 16 us
    t1000 = 4 * 1000 * 1000 * 2000 / (100e12 * 0.9)
    assert c.expert_time([100, 0, 1000], 1000, 2000, kernel="loop") == pytest.approx(t100 + t1000)


def test_few_tokens_are_memory_bound():
    c = ComputeModel(profile(), "bf16")
    # 1 token: 8 MFLOP is 0.16 us of compute; reading 2 x 1000 x 2000 x 2 bytes = 8 MB takes 8 us
    assert c.expert_time([1], 1000, 2000) == pytest.approx(8e-6)
    assert c.expert_time([1, 1], 1000, 2000) == pytest.approx(16e-6)
    assert c.expert_time([1, 1], 1000, 2000, kernel="loop") == pytest.approx(16e-6)
    assert c.expert_time([1, 1], 1000, 2000, backward=True) == pytest.approx(32e-6)
    assert c.expert_time([0, 0], 1000, 2000) == 0.0


def test_grouped_beats_loop_where_the_h200_says_so():
    c = ComputeModel(load_profile("h200"), "bf16")
    tokens = np.full(64, 512)  # grouped_E64_T512 vs loop_E64_T512
    flops = 4 * 512 * 4096 * 1408 * 64
    assert flops / c.expert_time(tokens, 4096, 1408) / 1e12 == pytest.approx(595.2, rel=0.01)
    assert flops / c.expert_time(tokens, 4096, 1408, kernel="loop") / 1e12 == pytest.approx(352.5, rel=0.01)


def test_router_optimizer_copy_and_heat():
    c = ComputeModel(profile(), "bf16")
    # gate GEMM: 2 x 1000 tokens x 1000 x 8 = 16 MFLOP at 50 TFLOP/s = 0.32 us; reading the
    # 1000 x 1000 x 2-byte activations at 1000 GB/s = 2 us: memory bound; + 30 us
    assert c.router_time(1000, 1000, 8) == pytest.approx(2e-6 + 30e-6)
    assert c.optimizer_time(1e9) == pytest.approx(3e-3)  # read w, g; write w at 1000 GB/s
    assert c.optimizer_time(1) == pytest.approx(1e-6)  # one launch
    assert c.copy_time(2 * MiB) == pytest.approx(3e-6 + 2 * MiB / 15e9)  # 2 MiB: halfway in log
    np.testing.assert_allclose(c.copy_time(np.array([1, 4]) * MiB), 3e-6 + np.array([1, 4]) * MiB / np.array([10e9, 20e9]))
    h200 = ComputeModel(load_profile("h200"), "bf16")
    assert h200.copy_time(16 * MiB) == pytest.approx(7e-6 + 16 * MiB / 54.71e9)
    assert h200.heat_update_time(128) == pytest.approx(128 * 0.1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError):
        ComputeModel(profile(), "fp8")
    with pytest.raises(ValueError):
        ComputeModel(profile(), "bf16").expert_time([4], 8, 8, kernel="bmm")


def test_dense_gemms_and_the_router_gate_are_timed_at_the_dense_curve(tmp_path):
    """Dense GEMMs (attention projections, dense FFNs, the head) and the router's gate are
    timed at compute.efficiency.dense, not at the expert grouped-GEMM curve."""
    from sim.hardware.dense_layers import DenseLayers
    from testbed.model.whole_model import attention_core_flops, shape_of
    from testbed.scenario.profile import save_profile
    from testbed.scenario.scenario import Scenario

    p = profile(grouped=((1, 0.5), (10_000, 0.5)), dense=((1, 0.25), (10_000, 0.25)),
                attention=((1, 0.1), (10_000, 0.1)), launch_us=0.0)
    c = ComputeModel(p, "bf16")
    assert c.gemm_time(1e12, 4096, "dense") == pytest.approx(1e12 / (100e12 * 0.25))
    assert c.gemm_time(1e12, 4096, "grouped") == pytest.approx(1e12 / (100e12 * 0.5))
    # the gate: 2 x 4096 tokens x 8192 x 64 = 4.3 GFLOP at 25 TFLOP/s = 171.8 us (memory: 67 MB at 1000 GB/s = 67 us)
    assert c.router_time(4096, 8192, 64) == pytest.approx(2 * 4096 * 8192 * 64 / 25e12 + 30e-6)
    s = Scenario.from_dict({
        "model": {"hidden_size": 256, "ffn_hidden_size": 512, "num_experts": 8, "dtype": "bf16"},
        "cluster": {"profile": str(save_profile(p, tmp_path / "p.toml"))},
        "workload": {"tokens_per_rank": 512},
        "transformer": {"enabled": True, "num_heads": 4, "seq_len": 128, "vocab_size": 1000, "moe_every": 2}})
    # the blocks' and the head's memory-bound kernels (norms, residual adds, the activation, the
    # loss: testbed.model.memory_bound_kernels) cost nothing at this bandwidth, so only the GEMMs'
    # curves are left; the GEMMs here are compute-bound (bf16, no fp8 casts), the bandwidth plays no part
    free_kernels = ComputeModel(profile(grouped=((1, 0.5), (10_000, 0.5)), dense=((1, 0.25), (10_000, 0.25)),
                                        attention=((1, 0.1), (10_000, 0.1)), launch_us=0.0, memory=1e12), "bf16")
    d, shape = DenseLayers(s, free_kernels), shape_of(s)
    dense = 100e12 * 0.25
    attention = 2 * 512 * shape.attention_params / dense + attention_core_flops(512, 128, 256) / (100e12 * 0.1)
    assert d.block_forward_s == pytest.approx(2 * attention + 2 * 512 * shape.dense_ffn_params / dense)
    assert d.head_forward_s == pytest.approx(2 * 512 * 256 * 1000 / dense)
