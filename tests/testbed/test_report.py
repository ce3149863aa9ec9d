"""The comparison report: built from hand-made run folders with known numbers."""

from __future__ import annotations

import html
import re
import shutil

import plotly.offline
import pytest

from testbed.cli import main as cli_main
from testbed.errors import ScenarioError
from testbed.report import (
    load_runs,
    run_label,
    stage_time_figure,
    write_comparison_report,
)
from testbed.results import StepRecord, summarize
from testbed.runs import RunWriter
from testbed.scenario import Scenario


def record(step: int, step_time_s: float) -> StepRecord:
    return StepRecord(
        step=step, step_time_s=step_time_s,
        stage_time_s={"route": 0.001, "experts": 0.005},
        bytes_by_stage={"dispatch": 4096, "expert_sync": 1024},
        bytes_by_level={"nvlink": 2048, "leaf": 2048, "spine": 1024, "pcie": 0},
        peak_memory_bytes=3 * 2**20, routed_slots=100, dropped_slots=5, page_moves=2,
        page_bytes=0, page_stall_s=0.0, cache_hits=3, cache_lookups=4, loss=2.0 - 0.1 * step)


def make_run(tmp_path, comm: dict, times: list[float], complete: bool = True):
    scenario = Scenario().replace(comm=comm, run={"output_dir": str(tmp_path / "runs")})
    writer = RunWriter(scenario, "sim")
    records = [record(i, t) for i, t in enumerate(times)]
    for r in records:
        writer.write_step(r)
    summary = summarize(records, scenario.run.warmup_steps, backend="sim", run_dir=str(writer.dir))
    writer.finish(summary, [], None, complete=complete)
    return writer.dir


@pytest.fixture
def run_dirs(tmp_path):
    return [
        make_run(tmp_path, {"token_strategy": "alltoall", "expert_sync": "allreduce"}, [0.050, 0.0123, 0.0125, 0.0127]),
        make_run(tmp_path, {"token_strategy": "allgather", "expert_sync": "allreduce"}, [0.040, 0.0213, 0.0217, 0.0215]),
        make_run(tmp_path, {"token_strategy": "alltoall", "expert_sync": "two_stage"}, [0.030, 0.0311], complete=False),
    ]


def test_report_is_offline_and_names_every_run(run_dirs, tmp_path):
    out = write_comparison_report(run_dirs, tmp_path / "out" / "report.html", title="A <test>")
    page = out.read_text(encoding="utf-8")
    marker = plotly.offline.get_plotlyjs()[:200]
    assert page.count(marker) == 1  # plotly.js inline, once
    assert '<script src="http' not in page
    assert not re.search(r"<script[^>]*\ssrc=", page)  # no script loaded from anywhere
    assert "<h1>A &lt;test&gt;</h1>" in page
    table = page[page.index("<table>"):page.index("</table>")]
    for d in run_dirs[:2]:
        assert html.escape(str(d)) in table
    assert html.escape(str(run_dirs[2])) not in page  # the stopped run is skipped, not shown
    assert "12.500 ms" in table and "21.500 ms" in table  # medians of the measured steps
    assert "3.00 MiB" in table and "5.00%" in table and "75.00%" in table
    assert "sim · alltoall" in table and "sim · allgather" in table  # two_stage went with the stopped run
    assert "incomplete" not in table
    assert "median of measured steps" in page and "mean per measured step, all ranks" in page


def test_stage_figure_leaves_out_zero_stages(run_dirs):
    names = [t.name for t in stage_time_figure(load_runs(run_dirs)).data]
    assert names == ["route", "experts"]


def test_run_label_shows_only_differing_fields():
    a = {"comm": {"token_strategy": "alltoall"}, "router": {"capacity_factor": 1.0}, "run": {"output_dir": "x"}}
    b = {"comm": {"token_strategy": "allgather"}, "router": {"capacity_factor": 1.25}, "run": {"output_dir": "y"}}
    assert run_label([a, b], ["sim", "real"]) == ["sim · alltoall · capacity_factor=1.0",
                                                  "real · allgather · capacity_factor=1.25"]
    assert run_label([a, a], ["sim", "sim"]) == ["sim #1", "sim #2"]


def test_folders_that_are_not_complete_runs_are_skipped_with_one_line_each(run_dirs, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "summary.json").write_text("{not json")
    cut = tmp_path / "cut"
    shutil.copytree(run_dirs[1], cut)
    (cut / "steps.jsonl").write_text('{"step": 0, "step_ti')
    out = write_comparison_report([run_dirs[0], empty, run_dirs[2], garbled, cut], tmp_path / "r.html")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"testbed report: skipping {empty}: not a run folder (no summary.json)",
                   f"testbed report: skipping {run_dirs[2]}: incomplete run (its summary says complete: false)",
                   err[2], err[3]]
    assert err[2].startswith(f"testbed report: skipping {garbled}: unreadable run folder: ")
    assert err[3].startswith(f"testbed report: skipping {cut}: unreadable run folder: ")
    page = out.read_text(encoding="utf-8")
    assert html.escape(str(run_dirs[0])) in page and "Comparison of 1 run(s)" in page
    assert html.escape(str(empty)) not in page and html.escape(str(garbled)) not in page


def test_no_complete_run_is_a_scenario_error(run_dirs, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ScenarioError) as e:
        write_comparison_report([empty, run_dirs[2]], tmp_path / "r.html")
    assert e.value.field == "RUN_DIR" and e.value.reason == "no complete run among the 2 given"
    assert len(capsys.readouterr().err.splitlines()) == 2  # one notice per skipped folder
    assert not (tmp_path / "r.html").exists()


def test_cli_report(run_dirs, tmp_path, capsys):
    assert cli_main(["report", str(run_dirs[0]), "-o", str(tmp_path / "c.html")]) == 0
    assert (tmp_path / "c.html").is_file()
    assert cli_main(["report", str(tmp_path / "missing"), "-o", str(tmp_path / "d.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"testbed report: skipping {tmp_path / 'missing'}: not a run folder (no summary.json)"
    assert len(err) == 2 and "RUN_DIR" in err[1] and "no complete run among the 1 given" in err[1]
    assert not (tmp_path / "d.html").exists()
