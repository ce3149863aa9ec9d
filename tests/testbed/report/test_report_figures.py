"""The reports read well and say where their numbers come from: labels, colours, log
axes, legends, the machine profile and the routing source. Run folders are written by
hand here, with known numbers, so that nothing runs."""

from __future__ import annotations

import json
import re

import pytest

from testbed.core.stages import STAGES
from testbed.report.comparison import (
    level_bytes_figure,
    load_runs,
    memory_figure,
    run_label,
    stage_bytes_figure,
    stage_time_figure,
    step_time_figure,
    write_comparison_report,
)
from testbed.report.html_page import STAGE_COLORS, log_ticks, shorten, spans_decade, value_axis, wrap
from testbed.report.validation import scatter_figure, write_validation_report
from testbed.report.validation import stage_time_figure as validation_stage_figure
from testbed.report.validation_emulated import write_emulated_report


def write_run(root, name, backend="sim", step_s=0.006, strategy="alltoall", trace="", steps=4, **summary):
    """A complete run folder: every stage takes step_s / 13, every level carries 1 MiB
    times the step in ms, memory is 2 MiB times the step in ms."""
    d = root / name
    d.mkdir(parents=True)
    (d / "scenario.toml").write_text(f'notes = "{name}"\n[comm]\ntoken_strategy = "{strategy}"\n'
                                     f'[workload]\ntrace = "{trace}"\n[run]\nwarmup_steps = 1\n'
                                     f'output_dir = "{root}"\n')
    scale = step_s * 1e3
    (d / "summary.json").write_text(json.dumps(dict({
        "backend": backend, "complete": True, "measured_steps": steps - 1, "step_time_s": step_s,
        "stage_time_s": {s: step_s / len(STAGES) for s in STAGES},
        "bytes_by_stage": {"dispatch": 2**20 * scale, "expert_sync": 2**19 * scale},
        "bytes_by_level": {"nvlink": 2**20 * scale, "leaf": 2**20 * scale, "spine": 2**20 * scale, "pcie": 0},
        "peak_memory_bytes": 2**21 * scale}, **summary)))
    lines = [{"step": i, "step_time_s": step_s * (2 if i == 0 else 1), "stage_time_s": {}, "bytes_by_stage": {},
              "bytes_by_level": {}, "peak_memory_bytes": 0, "routed_slots": 0, "dropped_slots": 0,
              "page_moves": 0, "page_bytes": 0, "page_stall_s": 0.0, "cache_hits": 0, "cache_lookups": 0,
              "loss": None} for i in range(steps)]
    (d / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


@pytest.fixture
def sim_and_real(tmp_path):
    """Three simulated runs near 6 ms and one measured at 170 ms (more than 10x apart)."""
    real = write_run(tmp_path, "real-a", backend="real", step_s=0.170, profile="local-cpu",
                     profile_source="built in", profile_calibrated_here=False, routing_source="real router")
    sims = [write_run(tmp_path, "sim-a", step_s=0.006, profile="local", profile_source="testbed calibrate on host x",
                      profile_calibrated_here=True, routing_source="synthetic workload (M4)"),
            write_run(tmp_path, "sim-b", step_s=0.0065, strategy="allgather"),
            write_run(tmp_path, "sim-c", step_s=0.0062, trace=str(real),
                      routing_source=f"replayed trace of {real}")]
    return [*sims, real]


# ---- labels ---------------------------------------------------------------------------
def test_labels_name_the_backend_and_never_show_an_empty_field():
    a = {"comm": {"token_strategy": "alltoall"}, "workload": {"trace": ""}, "router": {"capacity_factor": 1.0}}
    b = {"comm": {"token_strategy": "alltoall"}, "workload": {"trace": "/runs/real-2eb20bd32e37-20261201T061608-8f38"},
         "router": {"capacity_factor": None}}
    c = {"comm": {"token_strategy": "allgather"}, "router": {}}  # trace and capacity factor missing
    labels = run_label([a, b, c], ["sim", "sim", "real"])
    assert labels == ["sim · alltoall · capacity_factor=1.0", "sim · alltoall · trace=real-2eb2…61608-8f38",
                      "real · allgather"]
    for label in labels:
        assert not re.search(r"=(\s|·|$)", label) and "unset" not in label and "None" not in label
        assert "· ·" not in label and "  " not in label and not label.endswith("·")


def test_unset_empty_and_missing_are_one_value():
    a = {"workload": {"trace": ""}, "notes": "x"}
    b = {"workload": {}, "notes": "y"}
    assert run_label([a, b], ["sim", "sim"]) == ["sim #1", "sim #2"]


def test_long_labels_wrap_at_their_fields_and_stay_whole_in_the_hover(sim_and_real):
    label = "sim · hidden_size=64 · ffn_hidden_size=128 · capacity_factor=1.0 · allgather · tokens_per_rank=256"
    assert wrap(label) == ("sim · hidden_size=64 · ffn_hidden_size=128<br>capacity_factor=1.0 · allgather"
                           "<br>tokens_per_rank=256")  # every field in view: none is cut
    assert wrap("a · b", width=3, max_lines=1) == "a…b" and wrap("short") == "short"  # past max_lines: cut
    assert len(shorten("x" * 100)) == 48 and shorten("short") == "short"
    runs = load_runs(sim_and_real)
    long = [r for r in runs if "trace=" in r.label][0]
    trace = [t for t in level_bytes_figure(runs).data if t.customdata[0][0] == long.label][0]
    assert trace.name == wrap(long.label) and all(len(line) <= 44 for line in trace.name.split("<br>"))
    axis = stage_time_figure(runs).layout.yaxis
    assert list(axis.tickvals) == [r.label for r in runs[:3]] and wrap(long.label) in axis.ticktext


def test_a_backend_whose_runs_span_ten_times_gets_a_panel_per_band(tmp_path):
    dirs = [write_run(tmp_path, "sim-a", step_s=0.006), write_run(tmp_path, "sim-b", step_s=4.85, strategy="x"),
            write_run(tmp_path, "sim-c", step_s=0.0069, strategy="y"),
            write_run(tmp_path, "real-a", backend="real", step_s=0.12)]
    fig = stage_time_figure(load_runs(dirs))
    assert [a.text for a in fig.layout.annotations] == ["sim: 6 to 6.9 ms", "sim: 4850 ms", "real"]
    assert all(getattr(fig.layout, f"xaxis{i}").type != "log" for i in ("", 2, 3))


# ---- colours --------------------------------------------------------------------------
def test_every_stage_has_its_own_colour():
    assert set(STAGE_COLORS) == set(STAGES)
    assert len(set(STAGE_COLORS.values())) == len(STAGES)


def test_a_stage_has_the_same_colour_in_every_figure(sim_and_real, tmp_path):
    runs = load_runs(sim_and_real)
    point = {"grid": "cpu", "world": 2, "token_strategy": "alltoall", "expert_sync": "allreduce",
             "capacity_factor": 1.25,
             "stages": {s: {"measured_s": 0.001, "simulated_s": 0.002, "error_s": 0.001} for s in STAGES}}
    figures = [stage_time_figure(runs), stage_bytes_figure(runs), validation_stage_figure([point])]
    for stage in ("dispatch", "expert_sync"):
        colours = {t.marker.color for fig in figures for t in fig.data if t.name == stage}
        assert colours == {STAGE_COLORS[stage]}


def test_a_run_has_the_same_colour_in_every_figure_of_runs(sim_and_real):
    runs = load_runs(sim_and_real)
    by_level = [t.marker.color for t in level_bytes_figure(runs).data]
    by_step = [t.line.color for t in step_time_figure(runs).data]
    assert by_level == by_step == list(memory_figure(runs).data[0].marker.color)
    assert len(set(by_level)) == len(runs)


# ---- axes -----------------------------------------------------------------------------
def test_spans_decade_leaves_out_zeros():
    assert spans_decade([6, 170]) and not spans_decade([6, 50, 0, None]) and not spans_decade([5])
    assert value_axis("ms", [6, 170])["type"] == "log" and "log scale" in value_axis("ms", [6, 170])["title"]
    assert value_axis("ms", [6, 50])["rangemode"] == "tozero"
    assert log_ticks([6, 170]) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_a_log_axis_where_values_span_more_than_ten_times(sim_and_real):
    runs = load_runs(sim_and_real)
    assert step_time_figure(runs).layout.yaxis.type == "log"  # 6 ms beside 170 ms
    assert memory_figure(runs).layout.xaxis.type == "log"
    assert level_bytes_figure(runs).layout.yaxis.type == "log"
    sims = load_runs(sim_and_real[:3])
    assert step_time_figure(sims).layout.yaxis.type != "log"  # 6 to 13 ms (warm-up doubled): linear
    assert memory_figure(sims).layout.xaxis.type != "log"


def test_stacked_figures_get_one_panel_per_backend_when_totals_span_ten_times(sim_and_real):
    runs = load_runs(sim_and_real)
    fig = stage_time_figure(runs)
    assert fig.layout.xaxis.type != "log" and fig.layout.xaxis2.type != "log"  # each panel linear
    panel_of = {t.yaxis: set(t.y) for t in fig.data}
    assert sorted(len(v) for v in panel_of.values()) == [1, 3]
    assert [a.text for a in fig.layout.annotations] == ["sim", "real"]
    assert sum(t.showlegend is not False for t in fig.data) == len(STAGES)  # the legend shows each stage once
    assert len(stage_time_figure(load_runs(sim_and_real[:3])).layout.annotations) == 0  # one panel


def test_validation_scatter_goes_log_when_times_span_ten_times():
    def point(world, measured, simulated):
        return {"world": world, "token_strategy": "alltoall", "expert_sync": "allreduce", "capacity_factor": 1.0,
                "measured_step_s": measured, "simulated_step_s": simulated}
    assert scatter_figure([point(2, 0.006, 0.007), point(4, 0.170, 0.160)]).layout.xaxis.type == "log"
    assert scatter_figure([point(2, 0.06, 0.07), point(4, 0.170, 0.160)]).layout.xaxis.type != "log"


def test_legends_sit_under_the_plot(sim_and_real):
    runs = load_runs(sim_and_real)
    for fig in (stage_time_figure(runs), level_bytes_figure(runs), step_time_figure(runs)):
        legend = fig.layout.legend
        assert legend.orientation == "h" and legend.yref == "container" and legend.yanchor == "bottom"


# ---- where the numbers come from -------------------------------------------------------
def test_comparison_page_names_profile_and_routing_source_of_every_run(sim_and_real, tmp_path):
    page = write_comparison_report(sim_and_real, tmp_path / "c.html").read_text(encoding="utf-8")
    sources = page[page.index("<h2>Machine profile and routing source"):page.index("<h2>Figures")]
    assert "local-cpu" in sources and "built in" in sources and "real router" in sources
    assert "testbed calibrate on host x" in sources and "synthetic workload (M4)" in sources
    assert f"replayed trace of {sim_and_real[3]}" in sources
    assert sources.count(">unknown<") == 4 + 3  # sim-b says nothing, sim-c only its routing
    note = page[page.index('<p class="note">'):page.index("<h2>")]
    assert "Machine profile: local (testbed calibrate on host x; calibrated on this machine: yes) in 1 run" in note
    assert "calibrated on this machine: no" in note and "Routing source: synthetic workload (M4) in 1 run" in note
    assert "times in milliseconds (ms) everywhere" in note and "figures are in MiB" in note


def validation_result(profile, **extra):
    points = [{"grid": "cpu", "world": w, "capacity_factor": 1.25, "token_strategy": "alltoall",
               "expert_sync": "allreduce", "measured_step_s": 0.1 * w, "simulated_step_s": 0.11 * w,
               "rel_error": 0.1, "stages": {"dispatch": {"measured_s": 0.01, "simulated_s": 0.02, "error_s": 0.01}},
               "worst_stage": "dispatch", "run_to_run_spread": 0.01, "real_runs": ["r"], "real_run": "r",
               "sim_run": "s"} for w in (2, 4)]
    return dict({"median_abs_error": 0.1, "max_abs_error": 0.1, "speedup_rank_agreement": 1.0,
                 "speedup_rank_agreement_all_pairs": 1.0, "scored_pairs": 0, "pairs": 0,
                 "goals": {"median_abs_error": 0.1, "max_abs_error": 0.25, "speedup_rank_agreement": 1.0},
                 "profile": profile, "points": points, "speedup_pairs": [], "tie": 0.05, "repeats": 2,
                 "median_run_to_run_spread": 0.01}, **extra)


def test_validation_page_says_whether_the_profile_was_calibrated_here_and_where_routing_comes_from(tmp_path):
    page = write_validation_report(validation_result("local-cpu", profile_calibrated_here=True),
                                   tmp_path / "v.html").read_text()
    assert "Machine profile: local-cpu (calibrated on this machine)" in page
    assert "the simulator replays each real run&#x27;s routing" in page
    assert "<td>calibrated on this machine</td><td>yes</td>" in page
    page = write_validation_report(validation_result("local-cpu", profile_calibrated_here=False),
                                   tmp_path / "v.html").read_text()
    assert "(not calibrated on this machine)" in page
    page = write_validation_report(validation_result("local-cpu"), tmp_path / "v.html").read_text()
    assert "Machine profile: local-cpu." in page and "<td>calibrated on this machine</td>" not in page


def test_emulated_page_names_profile_calibration_and_routing_source(tmp_path):
    point = {"grid": "emulated", "world": 8, "cluster": "2x2x2", "token_strategy": "alltoall",
             "expert_sync": "allreduce", "placement": "topology", "oversubscription": 1.0, "skew": 1.0,
             "shape": "256x128x1024x16", "measured_step_s": 1.0, "simulated_step_s": 1.1, "rel_error": 0.1,
             "stages": {"dispatch": {"measured_s": 0.1, "simulated_s": 0.12, "error_s": 0.02}},
             "worst_stage": "dispatch", "run_to_run_spread": 0.01, "real_runs": ["r0"], "real_run": "r0",
             "sim_run": "s", "fitted_share": 0.1, "network_share": 0.8,
             "wire_bytes_by_level": {"nvlink": {"measured": 2**20, "simulated": 2**20, "error": 0.0},
                                     "leaf": {"measured": 2**25, "simulated": 2**25, "error": 0.0}},
             "utilization_by_level": {"leaf": {"measured": 0.5, "simulated": 0.52}}}
    keys = ("min_network_share", "median_abs_error", "max_abs_error", "speedup_direction_agreement",
            "median_speedup_error_pp", "max_wire_bytes_error", "max_fitted_share")
    result = {**{k: 0.1 for k in keys}, "goals": {k: 0.2 for k in keys}, "goals_met": {k: True for k in keys},
              "median_run_to_run_spread": 0.01, "repeats": 2, "scored_pairs": 0, "pairs": 0, "points": [point],
              "speedup_pairs": [], "profile": "emulated", "profile_calibrated_here": False}
    page = write_emulated_report(result, tmp_path / "e.html").read_text()
    assert "Machine profile: emulated (not calibrated on this machine)" in page
    assert "the simulator replays each real run&#x27;s routing" in page
    assert "wire bytes in MiB" in page and "measured MiB per step (log scale)" in page  # 1 MiB beside 32 MiB
