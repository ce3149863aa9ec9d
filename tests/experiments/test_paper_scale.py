"""experiments/paper_scale.py: MegaScale-352B on H800 in Megatron-LM's and MegaScale-MoE's
layouts (configs/published/), the seed's mechanisms on top of the MegaScale layout at 1,440
GPUs (a refused one with its reason), the speedups over Megatron-LM, and its --quick report."""

import json

import pytest

from testbed.scenario.file import load_scenario
from testbed.study.experiments import Options, load_experiment


@pytest.fixture(scope="module")
def paper_scale():
    return load_experiment("paper_scale")


def options(quick: bool) -> Options:
    return Options(quick=quick, backends=("sim",), fabric="auto", profile=None, repeats=1, output_dir=None)


def test_variants_are_the_published_pair_and_the_mechanisms_on_top(paper_scale):
    got = paper_scale.variants(options(quick=True))
    labels = [label for label, _ in got]
    on = "MegaScale-MoE layout (1,440 H800)"
    assert labels == ["Megatron-LM layout (1,440 H800)", on, f"{on} + paging", f"{on} + heat map",
                      f"{on} + two-stage sync", f"{on} + heat map + two-stage sync"]
    by = dict(got)
    # paging with pipelines is refused: the scenario's one line, naming the field
    assert isinstance(by[f"{on} + paging"], str) and by[f"{on} + paging"].startswith("pager.enabled = True")
    published = load_scenario(paper_scale.config_path(1440, "megascale"))
    seed = by[f"{on} + heat map + two-stage sync"]
    assert seed.heat.enabled and seed.comm.expert_sync == "two_stage" and not seed.pager.enabled
    assert not published.heat.enabled and published.comm.expert_sync == "allreduce"
    # everything else is the published file's, but 2 steps (1 measured)
    assert by[on].replace(run={"steps": published.run.steps}).to_dict() == published.to_dict()
    assert by[on].run.steps == 2 and by[on].run.warmup_steps == 1
    assert by["Megatron-LM layout (1,440 H800)"].parallelism.attention_parallel == "tp"
    for label, s in got:
        if not isinstance(s, str):
            assert paper_scale.label_of(s) == label  # a run's label comes back from its own scenario
    full = [label for label, _ in paper_scale.variants(options(quick=False))]
    assert full[:2] == ["Megatron-LM layout (240 H800)", "MegaScale-MoE layout (240 H800)"]
    assert len(full) == 2 * len(paper_scale.GPU_COUNTS) + 4 and full[-4:] == labels[2:]


def test_speedups_divide_megatrons_step_by_each_point_at_the_same_gpu_count(paper_scale):
    runs = {"Megatron-LM layout (1,440 H800)": {"step_time_s": 3.8},
            "MegaScale-MoE layout (1,440 H800)": {"step_time_s": 2.0},
            "MegaScale-MoE layout (1,440 H800) + heat map": {"step_time_s": 1.9},
            "Megatron-LM layout (240 H800)": {"step_time_s": 18.0},
            "MegaScale-MoE layout (240 H800)": {"step_time_s": 12.0}}
    assert paper_scale.speedups(runs) == {
        "MegaScale-MoE over Megatron-LM at 240 GPUs": pytest.approx(1.5, rel=1e-15),
        "MegaScale-MoE over Megatron-LM at 1,440 GPUs": pytest.approx(1.9, rel=1e-15),
        "MegaScale-MoE layout (1,440 H800) + heat map over Megatron-LM": pytest.approx(2.0, rel=1e-15)}
    assert paper_scale.comm_share({"step_time_s": 2.0, "stage_time_s": {"dispatch": 0.1, "expert_sync": 0.3,
                                                                        "experts": 1.0}}) == pytest.approx(0.2)


@pytest.mark.slow
def test_quick_runs_the_pair_and_the_mechanisms_and_writes_its_report(paper_scale, tmp_path, capsys):
    report = tmp_path / "paper_scale.html"
    args = ["--quick", "--backends", "sim", "--json", "--no-progress", "--output-dir", str(tmp_path / "runs"),
            "--report", str(report)]
    assert paper_scale.experiment_main(paper_scale.EXPERIMENT, args) == 0
    h = json.loads(capsys.readouterr().out)["headline"]
    assert report.is_file() and report.with_suffix(".csv").is_file()
    ran = [label for label, s in paper_scale.variants(options(quick=True)) if not isinstance(s, str)]
    for label in ran:
        assert h[f"{label}.step_time_s"] > 0 and 0 < h[f"{label}.mfu"] < 1, label
        assert 0 < h[f"{label}.comm_share"] < 1 and h[f"{label}.peak_memory_at"]
        for cat in ("expert_pages", "parameters", "gradients", "optimizer_state", "activations"):
            assert h[f"{label}.memory.{cat}"] > 0, (label, cat)
    megatron, megascale = h["Megatron-LM layout (1,440 H800).step_time_s"], h["MegaScale-MoE layout (1,440 H800).step_time_s"]
    assert h["speedup: MegaScale-MoE over Megatron-LM at 1,440 GPUs"] == pytest.approx(megatron / megascale, rel=1e-12)
    # the same model and batch in both layouts: TP 8's dense layers cost more than Ulysses' here
    assert megatron > megascale
