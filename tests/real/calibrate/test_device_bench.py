"""``testbed calibrate --device cuda``'s measurements and the profile it writes.

The device-generic measurements run here on the CPU at small shapes (they must give a
finite positive rate; no speed is asserted); the profile is assembled from given
measurements, so every figure it must carry is checked with known numbers. What needs
CUDA (pinned copies, side streams, NCCL, the whole calibration) is marked ``cuda``.
"""

import math

import pytest
import torch

from real.calibrate.device_bench import (
    attention_rate,
    copy_latency,
    copy_overlap,
    dense_rate,
    expert_rate,
    launch_seconds,
    memory_rate,
    pinned_copies,
)
from real.calibrate.gpu import QUICK_GPU_SHAPES, DeviceShapes, device_profile, measure_compute
from testbed.core.errors import ScenarioError
from testbed.run.sources import check_calibration
from testbed.scenario.profile import MiB, load_profile, save_profile

CPU = torch.device("cpu")
TINY = DeviceShapes(dense_rows=(16, 64), dense_k=32, expert_tokens=(8, 32), experts=2, hidden=32, ffn=48,
                    seq_lens=(16, 32), attention_tokens=64, attention_hidden=32, heads=2, memory_bytes=MiB)


def finite_positive(x) -> bool:
    return math.isfinite(x) and x > 0


def test_the_device_generic_measurements_run_on_the_cpu():
    assert finite_positive(dense_rate(CPU, torch.float32, 16, 32, 48, reps=2))
    assert finite_positive(dense_rate(CPU, torch.float32, 16, 32, 48, reps=2, backward=True))
    for kernel in ("grouped", "loop"):
        assert finite_positive(expert_rate(CPU, torch.float32, kernel, 2, 16, 32, 48, reps=2))
    with pytest.raises(ValueError):
        expert_rate(CPU, torch.float32, "bmm", 2, 16, 32, 48)
    assert finite_positive(attention_rate(CPU, torch.float32, 64, 16, 32, 2, reps=2))
    assert finite_positive(memory_rate(CPU, MiB, reps=2))
    assert finite_positive(launch_seconds(CPU, ops=10, reps=2))
    got = measure_compute(CPU, torch.float32, TINY, reps=1)
    assert set(got["dense"]) == {16, 64} and set(got["grouped"]) == set(got["loop"]) == {8, 32}
    assert set(got["attention"]) == {16, 32}
    assert all(finite_positive(r) for k in ("dense", "grouped", "loop", "attention") for r in got[k].values())
    assert all(finite_positive(got[k]) for k in ("fp32", "fp16", "memory_Bps", "launch_s"))


def test_pinned_copies_and_overlap_refuse_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA"):
        pinned_copies(CPU, (1,), MiB)
    with pytest.raises(ValueError, match="CUDA"):
        copy_overlap(CPU, MiB, 64)


def test_copy_latency_is_the_intercept_of_single_page_times():
    rows = [{"page_MiB": mb, "GBps": 50.0, "single_s": 7e-6 + mb * MiB / 50e9} for mb in (1, 4, 16)]
    assert copy_latency(rows) == pytest.approx(7e-6, rel=1e-6)
    assert copy_latency([dict(rows[0], single_s=1e-6)]) == 0.0  # never below 0


def measurements():
    """Known rates: the best bf16 rate is the grouped kernel's 800 TFLOP/s at 4096 tokens."""
    compute = {"dense": {2048: 600e12, 8192: 700e12}, "grouped": {128: 200e12, 512: 600e12, 4096: 800e12},
               "loop": {128: 100e12, 512: 300e12, 4096: 650e12}, "attention": {512: 250e12, 4096: 400e12},
               "fp32": 60e12, "fp16": 700e12, "memory_Bps": 4.2e12, "launch_s": 5e-6}
    copies = {"table": [(1, 45.0), (4, 52.0), (16, 54.0), (64, 55.0)], "latency_s": 6e-6, "overlap": 0.9}
    return compute, copies


def test_a_device_calibration_profile_carries_what_was_measured_and_says_so(tmp_path):
    compute, copies = measurements()
    base = load_profile("h200")
    p = device_profile(base, "gpu-here", compute, copies, [], QUICK_GPU_SHAPES, "NVIDIA H200", 1, 143.8, True,
                       {"torch": "x", "host": "h"})
    c = p.compute
    assert c.peak_tflops.bf16 == pytest.approx(800.0) and c.peak_tflops.fp32 == pytest.approx(60.0)
    assert c.peak_tflops.fp16 == pytest.approx(700.0)
    assert c.efficiency.dense == ((2048.0, 0.75), (8192.0, 0.875))
    assert c.efficiency.grouped == ((128.0, 0.25), (512.0, 0.75), (4096.0, 1.0))
    assert c.efficiency.loop[-1] == (4096.0, 650 / 800) and c.efficiency.attention == ((512.0, 0.3125), (4096.0, 0.5))
    assert (c.memory_GBps, c.launch_us, c.device_memory_GB) == (pytest.approx(4200.0), pytest.approx(5.0), 143.8)
    assert p.copy.table == ((1.0, 45.0), (4.0, 52.0), (16.0, 54.0), (64.0, 55.0))
    assert p.copy.latency_us == pytest.approx(6.0) and p.copy.overlap == 0.9
    assert p.links.pcie.bandwidth_GBps == 55.0 and p.links.pcie.latency_us == pytest.approx(6.0)
    assert p.links.nvlink == base.links.nvlink and p.collectives == base.collectives  # not measured: the base's
    cal = p.calibration
    assert (cal.made_by_calibrate, cal.device, cal.fabric, cal.gpu, cal.quick, cal.scenarios) == (
        True, "cuda", "device", "NVIDIA H200", True, ())
    for key in ("compute.peak_tflops.bf16", "compute.efficiency.dense", "compute.efficiency.grouped",
                "compute.efficiency.attention", "compute.memory_GBps", "copy.table", "copy.overlap", "links.pcie"):
        assert p.source_of(key).startswith("measured by testbed calibrate --device cuda on NVIDIA H200"), key
    assert p.source_of("links.nic.bandwidth_GBps") == base.source_of("links.nic.bandwidth_GBps")
    assert "not measured: this machine has 1 GPU" in p.source_of("collectives.latency_us")
    assert load_profile(save_profile(p, tmp_path / "gpu-here.toml")) == p
    # the GPU grid accepts it on the same GPU; a CPU grid, or another GPU, refuses it
    assert "made by testbed calibrate on NVIDIA H200" in check_calibration(p, "cuda", "device", gpu="NVIDIA H200")
    with pytest.raises(ScenarioError, match="calibrated on cuda"):
        check_calibration(p, "cpu", "loopback")
    with pytest.raises(ScenarioError, match="NVIDIA A100"):
        check_calibration(p, "cuda", "device", gpu="NVIDIA A100")


def test_measured_nccl_latency_rows_go_into_the_profile():
    compute, copies = measurements()
    rows = [{"world": 2, "call_us": 12.0, "step_us": 3.0}]
    p = device_profile(load_profile("h200"), "g", compute, copies, rows, QUICK_GPU_SHAPES, "NVIDIA H200", 2, 143.8,
                       False, {})
    assert p.measured.collective_latency == tuple(rows)
    assert p.source_of("measured.collective_latency").startswith("measured by testbed calibrate --device cuda")
    assert "not measured" not in p.source_of("collectives.latency_us")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_calibrate_cuda_quick_writes_a_profile_the_gpu_grid_accepts(tmp_path):
    from real.calibrate.tool import calibrate

    path = calibrate("gpu-quick", device="cuda", out_dir=tmp_path, quick=True, log=lambda line: None)
    p = load_profile(path)
    assert p.calibration.device == "cuda" and p.calibration.gpu == torch.cuda.get_device_name(0)
    check_calibration(p, "cuda", "device", gpu=torch.cuda.get_device_name())
    assert all(0 < e <= 1 for curve in (p.compute.efficiency.dense, p.compute.efficiency.grouped)
               for _, e in curve)
    assert 0 <= p.copy.overlap <= 1 and p.copy.table[-1][1] > 0
    assert (len(p.measured.collective_latency) > 0) == (torch.cuda.device_count() >= 2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_copies_and_overlap_on_cuda():
    dev = torch.device("cuda", 0)
    rows = pinned_copies(dev, (1, 4), 16 * MiB, reps=2)
    assert [r["page_MiB"] for r in rows] == [1.0, 4.0] and all(r["GBps"] > 0 and r["single_s"] > 0 for r in rows)
    got = copy_overlap(dev, 16 * MiB, 1024, reps=2)
    assert 0 <= got["hidden"] <= 1 and got["copy_s"] > 0
