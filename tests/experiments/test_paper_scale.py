"""experiments/paper_scale.py --quick on the simulator: the seed's system against its
Megatron-style baseline, both whole-model, with iteration time, MFU, tokens/s per GPU,
the memory breakdown and the communication share, and its report."""

import json

import pytest

from testbed.run.store import load_run
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario
from testbed.study.experiments import ROOT, load_experiment


@pytest.fixture(scope="module")
def paper_scale():
    return load_experiment("paper_scale")


@pytest.mark.slow
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
    # the runs the sweep wrote, each told apart by its own scenario.toml: the headline gives each
    # configuration its own run's step, and the speedup divides the baseline's by paper-1440's
    def content(s: Scenario) -> dict:  # what the simulator runs: all but the notes and the run store
        d = s.to_dict()
        d.pop("notes"), d["run"].pop("output_dir")
        return d

    runs = [load_run(d) for d in (tmp_path / "runs").iterdir() if (d / "summary.json").is_file()]
    assert len(runs) == 2
    direct = {}
    for name in paper_scale.CONFIGS:
        want = content(load_scenario(ROOT / "configs" / f"{name}.toml").replace(cluster=paper_scale.QUICK_CLUSTER))
        (direct[name],) = [(Scenario.from_dict(sc), summary) for sc, summary, _ in runs
                           if content(Scenario.from_dict(sc)) == want]
    for name, (s, summary) in direct.items():
        assert s.world_size == 64 and h[f"{name}.step_time_s"] == pytest.approx(summary["step_time_s"], rel=1e-12)
    assert h["speedup_over_megatron_baseline"] == pytest.approx(
        direct["megatron-baseline-1440"][1]["step_time_s"] / direct["paper-1440"][1]["step_time_s"], rel=1e-12)
    assert not direct["megatron-baseline-1440"][0].pager.enabled and direct["paper-1440"][0].pager.enabled
    # no paging in the baseline: every local expert resident, all its bytes
    base = direct["megatron-baseline-1440"][0]
    assert h["megatron-baseline-1440.memory.expert_pages"] == (
        base.experts_per_rank * base.model.num_layers * base.model.expert_bytes)
    # paper-1440 pages: at most its budget holds
    assert 0 < h["paper-1440.memory.expert_pages"] <= direct["paper-1440"][0].pager.gpu_budget_bytes
