"""The comparison report: built from hand-made run folders with known numbers."""

from __future__ import annotations

import html
import re
import shutil

import plotly.offline
import pytest

from testbed.cli.main import main as cli_main
from testbed.core.errors import ScenarioError
from testbed.report.comparison import (
    load_runs,
    run_label,
    stage_time_figure,
    write_comparison_report,
)
from testbed.run.results import StepRecord, summarize
from testbed.run.store import RunWriter
from testbed.scenario.scenario import Scenario


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
    assert capsys.readouterr().err == "testbed report: comparing 1 run folder(s)\n"
    assert cli_main(["report", str(tmp_path / "missing"), "-o", str(tmp_path / "d.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err.pop(0) == "testbed report: comparing 1 run folder(s)"
    assert err[0] == f"testbed report: skipping {tmp_path / 'missing'}: not a run folder (no summary.json)"
    assert len(err) == 2 and "RUN_DIR" in err[1] and "no complete run among the 1 given" in err[1]
    assert not (tmp_path / "d.html").exists()


def findings_of(page: str) -> list[str]:
    box = page[page.index('<div class="findings">'):page.index("</div>", page.index('<div class="findings">'))]
    return [html.unescape(p) for p in re.findall(r"<p>(.*?)</p>", box)]


def test_the_page_opens_with_what_its_figures_show(run_dirs, tmp_path):
    page = write_comparison_report(run_dirs, tmp_path / "r.html").read_text()
    assert findings_of(page) == ["Of 2 runs, sim · alltoall has the shortest step (12.5 ms) and sim · allgather "
                                 "the longest (21.5 ms, 1.72x)."]


def paired_run(tmp_path, backend: str, step_s: float, dropped: int, **sources):
    """A run of the default scenario on ``backend`` with its summary's source fields."""
    scenario = Scenario().replace(run={"output_dir": str(tmp_path / "runs")})
    writer = RunWriter(scenario, backend)
    records = [StepRecord(step=i, step_time_s=step_s, stage_time_s={"experts": step_s}, bytes_by_stage={},
                          bytes_by_level={}, peak_memory_bytes=1, routed_slots=100, dropped_slots=dropped,
                          page_moves=0, page_bytes=0, page_stall_s=0.0, cache_hits=0, cache_lookups=0)
               for i in range(3)]
    for r in records:
        writer.write_step(r)
    writer.finish(summarize(records, 1, backend=backend, run_dir=str(writer.dir), **sources), [], None)
    return writer.dir


def test_a_simulated_and_a_measured_run_of_one_scenario_say_why_they_differ(tmp_path):
    sim = paired_run(tmp_path, "sim", 0.006, 17, profile="local-cpu", profile_calibrated_here=False,
                     routing_source="synthetic workload (M4)")
    real = paired_run(tmp_path, "real", 0.120, 0, profile="local-cpu", profile_calibrated_here=False,
                      routing_source="real router", device="cpu", ranks=8, host_cpu_count=2)
    found = findings_of(write_comparison_report([sim, real], tmp_path / "r.html").read_text())
    assert len(found) == 2  # no peak-memory note in these summaries
    why = found[1]
    assert why.startswith("The simulated step of sim is 0.05x the measured one of real: ")
    assert "local-cpu profile, which was not calibrated on this machine" in why
    assert "synthetic workload (M4) while the real run routed its tokens with its router (17.0% against 0.0% dropped" in why
    assert "8 CPU ranks shared 2 cores" in why
    # calibrated, replayed, one rank per core: none of the reasons applies
    sim2 = paired_run(tmp_path, "sim", 0.100, 0, profile="local", profile_calibrated_here=True,
                      routing_source=f"replayed trace of {real}")
    real2 = paired_run(tmp_path, "real", 0.125, 0, profile="local", profile_calibrated_here=True,
                       routing_source="real router", device="cpu", ranks=2, host_cpu_count=2)
    found = findings_of(write_comparison_report([sim2, real2], tmp_path / "r2.html").read_text())
    assert found[1] == ("The simulated step of sim is 0.80x the measured one of real; both used a calibrated profile "
                        "and the same routing, so the difference is the simulator's error on this machine.")


def test_cli_report_latest_takes_the_newest_run_of_a_scenario_per_backend(tmp_path, capsys):
    from testbed.run.runner import run_scenario
    config = tmp_path / "s.toml"
    config.write_text(f'[run]\nsteps = 2\nwarmup_steps = 1\noutput_dir = "{tmp_path / "runs"}"\n')
    scenario = Scenario.from_dict({"run": {"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")}})
    run_scenario(scenario, "sim")
    newest = run_scenario(scenario, "sim")["run_dir"]
    assert cli_main(["report", "--latest", str(config), "-o", str(tmp_path / "l.html")]) == 0
    err = capsys.readouterr().err
    assert "comparing 1 run folder(s)" in err
    assert html.escape(newest) in (tmp_path / "l.html").read_text()
    assert cli_main(["report", "--latest", str(config), "--set", "workload.skew=0.5", "-o",
                     str(tmp_path / "m.html")]) == 2
    assert "no complete run of this scenario" in capsys.readouterr().err
    assert cli_main(["report", "-o", str(tmp_path / "n.html")]) == 2


def test_a_measured_peak_is_set_beside_the_simulated_one_with_what_it_leaves_out(tmp_path):
    sim = paired_run(tmp_path, "sim", 0.006, 0, profile_calibrated_here=True, routing_source="replayed trace of x")
    real = paired_run(tmp_path, "real", 0.008, 0, profile_calibrated_here=True, routing_source="real router",
                      peak_memory_note="the CPU peak leaves out collective buffers")
    found = findings_of(write_comparison_report([sim, real], tmp_path / "r.html").read_text())
    assert found[-1] == ("Peak memory: 0.00 MiB simulated against 0.00 MiB measured; the CPU peak leaves out "
                         "collective buffers.")
