"""experiments/paper_scale.py --quick on the simulator: the seed's system against its
Megatron-style baseline, both whole-model, with iteration time, MFU, tokens/s per GPU,
the memory breakdown and the communication share, and its report."""

import json

import pytest

from testbed.experiment import load_experiment



@pytest.fixture(scope="module")
def paper_scale():
    return load_experiment("paper_scale")


def test_quick_compares_the_two_configurations_and_writes_its_report(paper_scale, tmp_path, capsys):
    report = tmp_path / "paper_scale.html"
    args = ["--quick", "--backends", "sim", "--json", "--no-progress", "--output-dir", str(tmp_path / "runs"),
            "--report", str(report)]
    assert paper_scale.EXPERIMENT and paper_scale.experiment_main(paper_scale.EXPERIMENT, args) == 0
    out = json.loads(capsys.readouterr().out)
    assert report.is_file() and report.with_suffix(".csv").is_file()
    h = out["headline"]
    for name in paper_scale.CONFIGS:
        assert h[f"{name}.step_time_s"] > 0 and 0 < h[f"{name}.mfu"] < 1 and h[f"{name}.tokens_per_s_per_gpu"] > 0
        for cat in ("expert_pages", "parameters", "gradients", "optimizer_state", "activations"):
            assert h[f"{name}.memory.{cat}"] > 0, (name, cat)
        assert 0 < h[f"{name}.comm_share"] < 1
        assert h[f"{name}.peak_memory_at"]
    assert h["speedup_over_megatron_baseline"] == pytest.approx(
        h["megatron-baseline-1440.step_time_s"] / h["paper-1440.step_time_s"])
    # no paging in the baseline: every local expert resident, more than paper-1440's page budget
    assert h["megatron-baseline-1440.memory.expert_pages"] > h["paper-1440.memory.expert_pages"]
