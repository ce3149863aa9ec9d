"""The report of the validation on the emulated cluster (``validate_sim_vs_real.py --fabric emulated``).

Every number comes from the result the experiment passes in, which names each point's
real runs (measured, with the kernel's byte counters) and simulated run (the simulator
replaying the first real run's routing with the named calibrated profile). Times in ms,
wire bytes in MiB (2^20 bytes).
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from testbed.core.stages import STAGES
from testbed.report.html_page import (
    LEVEL_COLORS,
    MiB,
    category_ticks,
    figures_html,
    legend_below,
    table_html,
    write_page,
)
from testbed.report.validation import (
    _label,
    _ms,
    identity_axes,
    miss_reason,
    out_of_sample_note,
    profile_section,
    scatter_figure,
    sources_note,
    stage_error_figure,
    stage_time_figure,
    validation_findings,
)
from testbed.scenario.profile import load_profile
from testbed.scenario.topology import LEVELS

#: (result key, what it is, how it is judged, format)
GOAL_ROWS = (
    ("min_network_share", "network's share of the measured step (smallest point)", ">=", "pct"),
    ("median_abs_error", "median |step-time error|", "<=", "pct"),
    ("max_abs_error", "worst |step-time error|", "<=", "pct"),
    ("speedup_direction_agreement", "speedup direction agrees (pairs beyond the run-to-run spread)", ">=", "frac"),
    ("median_speedup_error_pp", "median error of the speedup's magnitude, percentage points", "<=", "pp"),
    ("max_wire_bytes_error", "wire bytes per level, worst |simulated - measured| / measured", "<=", "pct"),
    ("max_fitted_share", "simulated step time from fitted constants (largest point)", "<=", "pct"),
)


def _fmt(value, kind: str) -> str:
    if value is None:
        return "n/a"
    return {"pct": f"{100 * value:.1f}%", "frac": f"{value:.3f}", "pp": f"{value:.1f} pp"}[kind]


#: a marker shape per level, so that levels whose points fall on each other stay apart
_SYMBOLS = {"nvlink": "circle", "leaf": "square", "spine": "diamond"}


def wire_figure(points: list[dict]) -> go.Figure:
    """Simulated against measured wire bytes per level and point (MiB per step), one
    colour per level; log axes when the values span more than 10x."""
    fig = go.Figure()
    values: list[float] = []
    for level in ("nvlink", "leaf", "spine"):
        sel = [(p, p["wire_bytes_by_level"][level]) for p in points if level in p.get("wire_bytes_by_level", {})]
        if not sel:
            continue
        xs = [w["measured"] / MiB for _, w in sel]
        ys = [w["simulated"] / MiB for _, w in sel]
        values += xs + ys
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=level, text=[_label(p) for p, _ in sel],
                                 marker={"size": 9, "color": LEVEL_COLORS[level], "symbol": _SYMBOLS[level]},
                                 hovertemplate=f"%{{text}}<br>{level}<br>measured %{{x:.2f}} MiB<br>"
                                               "simulated %{y:.2f} MiB<extra></extra>"))
    identity_axes(fig, values, "MiB per step")
    return legend_below(fig, "Wire bytes per step and level: simulated network vs kernel counters", 540)


def utilization_figure(points: list[dict]) -> go.Figure:
    """Link utilisation per level (%), measured (solid) and simulated (hatched) in the
    level's colour, one group of bars per point."""
    fig = go.Figure()
    labels = [_label(p) for p in points]
    for level in ("nvlink", "leaf", "spine"):
        for side in ("measured", "simulated"):
            xs = [p.get("utilization_by_level", {}).get(level, {}).get(side) for p in points]
            if all(x is None for x in xs):
                continue
            fig.add_trace(go.Bar(y=labels, x=[100 * x if x is not None else None for x in xs], orientation="h",
                                 name=f"{level} {side}", marker_color=LEVEL_COLORS[level],
                                 marker_pattern_shape="/" if side == "simulated" else "", customdata=labels,
                                 hovertemplate=f"%{{customdata}}<br>{level} {side}: %{{x:.0f}}%<extra></extra>"))
    fig.update_xaxes(title="% of the level's capacity", rangemode="tozero")
    fig.update_yaxes(autorange="reversed", **category_ticks(labels))
    return legend_below(fig, "Link utilisation per level: wire bytes / (capacity x step time)", 200 + 56 * len(points),
                        barmode="group", bargap=0.3)


def write_emulated_report(result: dict, output: str | Path) -> Path:
    points, pairs, goals = result["points"], result["speedup_pairs"], result["goals"]
    head = [[text, _fmt(result[key], kind), f"{op} {_fmt(goals[key], kind)}",
             "met" if result["goals_met"][key] else "MISSED"] for key, text, op, kind in GOAL_ROWS]
    head.append(["run-to-run spread of the measured step (median)", _fmt(result["median_run_to_run_spread"], "pct"),
                 f"{result['repeats']} real runs per point", ""])
    head.append(["speedup pairs", f"{result['scored_pairs']} scored of {result['pairs']}",
                 "one knob apart; scored when measured beyond both points' spread", ""])
    rows = []
    for p in points:
        wire = ", ".join(f"{lv} {100 * w['error']:+.1f}%" for lv, w in p.get("wire_bytes_by_level", {}).items()
                         if w["error"] is not None)
        rows.append([_label(p), _ms(p["measured_step_s"]), _ms(p["simulated_step_s"]), f"{100 * p['rel_error']:+.1f}%",
                     _fmt(p.get("network_share"), "pct"), _fmt(p.get("fitted_share"), "pct"), wire,
                     f"{100 * p['run_to_run_spread']:.1f}%", miss_reason(p, goals["median_abs_error"]),
                     ", ".join(p["real_runs"]), p["sim_run"]])
    stages = [st for st in STAGES if any(st in p["stages"] for p in points)]
    stage_rows = [[_label(p)] + [f"{_ms(p['stages'][st]['measured_s'])} / {_ms(p['stages'][st]['simulated_s'])}"
                                 if st in p["stages"] else "" for st in stages] for p in points]
    util_rows = [[_label(p)] + [f"{100 * u['measured']:.0f}% / {100 * u['simulated']:.0f}%"
                                if (u := p.get("utilization_by_level", {}).get(lv)) else "" for lv in LEVELS[:3]]
                 for p in points]
    pair_rows = [[q["knob"], q["a"], q["b"], f"{q['measured_speedup']:.3f}", f"{q['simulated_speedup']:.3f}",
                  f"{q['error_pp']:.1f}", "yes" if q["agree"] else "NO",
                  "scored" if q["scored"] else "within run-to-run spread"] for q in pairs]
    note = ("Each point ran on the real backend on an emulated cluster (8 CPU ranks, each in its own network "
            "namespace, links shaped by traffic control: real.network = emulated) and on the simulator replaying "
            "that run's routing with the profile below, whose network model (max-min flows over the same links at "
            "the same rates, the algorithms gloo runs) was not fitted to any collective time. Error = (simulated - "
            "measured) / measured of the median step. Wire bytes: measured from the kernel's counters of every "
            "link, simulated from the flow model with the profile's protocol overhead, both summed over the "
            "directed links of a level. Network share: the measured time of the stages that are collectives. "
            "Speedups: time of a / time of b for every two points one knob apart."
            + (" " + out_of_sample_note(result) if result.get("provenance") else "") + "\n\n" + sources_note(result)
            + " Times in milliseconds everywhere, wire bytes in MiB (2^20 bytes); an axis marked \"log scale\" is "
            "logarithmic because its values span more than 10x. Stages have the colours of every testbed report, "
            "link levels one colour each (simulated hatched).")
    sections = [
        ("Result against the goals", table_html(["figure", "value", "goal", ""], head)),
        ("Figures", figures_html([scatter_figure(points), stage_error_figure(points), stage_time_figure(points),
                                  wire_figure(points), utilization_figure(points)])),
        ("Points", table_html(["point", "measured ms", "simulated ms", "error", "network share", "fitted share",
                               "wire bytes error by level", "spread", "why (where the point misses)", "real runs",
                               "simulated run"], rows, dense=True)),
        ("Stage times, measured / simulated (ms per step, mean over ranks)",
         table_html(["point"] + stages, stage_rows, dense=True)),
        ("Link utilisation per level, measured / simulated", table_html(["point"] + list(LEVELS[:3]), util_rows)),
        ("Speedups, one knob apart (time of a / time of b)",
         table_html(["knob", "a", "b", "measured", "simulated", "error pp", "same direction", ""], pair_rows)),
        ("Profile used, and the shapes of calibration and validation", profile_section(result)),
    ]
    return write_page(output, "Simulated vs measured on the emulated cluster: " + load_profile(result["profile"]).name,
                      note, sections, findings=validation_findings(result))
