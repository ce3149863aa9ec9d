"""CUDA-side behaviour checked on CPU. The GPU check never passes what it did not run:
with one GPU the multi-rank NCCL test is skipped with its reason, under pytest and in a
direct run (``SKIP``), and ``benchmarks/gpu_check.sh`` prints SKIP for what it leaves
out. A CUDA run's peak memory says what it leaves out beside it."""

import importlib.util

import pytest
import torch

import real.backend as backend_mod
from real.backend import RealBackend
from testbed.scenario.scenario import Scenario


@pytest.fixture
def cuda_tests(repo_root):
    spec = importlib.util.spec_from_file_location("cuda_tests", repo_root / "tests" / "real" / "test_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_multi_gpu_test_skips_with_its_reason_on_one_gpu(cuda_tests, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    test = cuda_tests.test_nccl_ranks_match_the_reference_with_overlap
    with pytest.raises(pytest.skip.Exception, match="needs 2 or more GPUs, this machine has 1"):
        test()
    failed = cuda_tests.run_directly({"test_nccl_ranks_match_the_reference_with_overlap": test})
    out = capsys.readouterr().out
    assert failed == 0 and out.startswith("SKIP test_nccl_ranks_match_the_reference_with_overlap: needs 2")
    assert "PASS" not in out


def test_gpu_check_prints_skip_for_what_one_gpu_cannot_run(repo_root):
    script = (repo_root / "benchmarks" / "gpu_check.sh").read_text()
    assert 'echo "[$(ts)] SKIP test_nccl_ranks_match_the_reference_with_overlap: needs 2 or more GPUs' in script
    assert 'echo "[$(ts)] SKIP multi-rank NCCL collectives' in script
    assert "-rs" in script  # pytest lists the skipped tests with their reasons


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_measured_peak_says_what_it_leaves_out(monkeypatch, two_ranks, tmp_path, device):
    """The allocator's peak holds no NCCL buffers, and a CPU rank's summed peak no
    collective buffers or communicators, which the simulator's peak counts: a run's
    result says so beside its memory (``peak_memory_note``). The launch is replaced: no
    GPU here."""
    monkeypatch.setattr(backend_mod, "pick_device", lambda scenario: device)
    monkeypatch.setattr(backend_mod, "run_ranks", lambda *args, **kwargs: {"routing": None, "group_create_s": 0.0,
                                                                          "trace": []})
    s = Scenario.from_dict({**two_ranks, "run": {**two_ranks["run"], "output_dir": str(tmp_path)}})
    extra = RealBackend().run(s).extra
    assert "simulator" in extra["peak_memory_note"]
    if device == "cuda":
        assert "NCCL" in extra["peak_memory_note"]
    else:
        assert "collective buffers and communicators" in extra["peak_memory_note"]
