"""The page every experiment writes: its headline, its own figures, simulated against
measured speedup per point, the table of points and the runs every number comes from.

Times in the page are milliseconds, speedups are baseline step time / point step time
(> 1: faster than the baseline), spreads are (max - min) / mean over repeats.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from testbed.report.html_page import category_ticks, figures_html, legend_below, series_color, table_html, write_page
from testbed.report.validation import identity_axes
from testbed.study.sweep import SweepResult, point_label


def _ms(x) -> str:
    return "—" if x is None else f"{x * 1e3:.2f} ms"


def _x(x) -> str:
    return "—" if x is None else f"x{x:.3f}"


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def speedup_figure(points: list[dict]) -> go.Figure:
    """Simulated against measured speedup per point (identity line: the simulator's
    answer holds), error bars: the measured speedup's range over repeats."""
    sel = [p for p in points if p["sim_speedup"] is not None and p["measured_speedup"] is not None]
    fig = go.Figure()
    if sel:
        fig.add_trace(go.Scatter(
            x=[p["measured_speedup"] for p in sel], y=[p["sim_speedup"] for p in sel], mode="markers+text",
            name="a point of the sweep, labelled by its settings", marker={"size": 10, "color": series_color(0)},
            text=[p["label"] for p in sel], textposition="top center", textfont={"size": 10},
            error_x={"type": "data", "symmetric": False,
                     "array": [p["measured_speedup_range"][1] - p["measured_speedup"] for p in sel],
                     "arrayminus": [p["measured_speedup"] - p["measured_speedup_range"][0] for p in sel]},
            hovertemplate="%{text}<br>measured x%{x:.3f}<br>simulated x%{y:.3f}<extra></extra>"))
        values = [p[k] for p in sel for k in ("measured_speedup", "sim_speedup")]
        values += [x for p in sel for x in p["measured_speedup_range"]]
        identity_axes(fig, values, "speedup")
        # speedups sit near 1: show their range, not the axis from zero
        lo, hi = min(values), max(values)
        pad = 0.05 * max(hi - lo, 0.02)
        fig.update_xaxes(range=[lo - pad, hi + pad], rangemode="normal")
        fig.update_yaxes(range=[lo - pad, hi + pad], rangemode="normal")
    return legend_below(fig, "Simulated vs measured speedup over the baseline point", 520,
                        "on the dashed line the simulator predicts what was measured; bars: range over repeats")


def step_bars_figure(points: list[dict]) -> go.Figure:
    """Step time per point, simulated and measured side by side."""
    labels = [p["label"] for p in points]
    fig = go.Figure()
    for i, (key, name) in enumerate((("sim_step_s", "simulated"), ("measured_step_s", "measured"))):
        if any(p[key] is not None for p in points):
            fig.add_trace(go.Bar(x=labels, y=[None if p[key] is None else p[key] * 1e3 for p in points], name=name,
                                 marker_color=series_color(i)))
    fig.update_xaxes(category_ticks(labels))
    fig.update_yaxes(title="step time, ms (median of measured steps)", rangemode="tozero")
    return legend_below(fig, "Step time per point", 480, barmode="group")


def points_table(result: SweepResult, points: list[dict], extra: list[tuple[str, callable]] = ()) -> str:
    """One row per point: its values, step times, speedups, measured spread and ``extra``
    columns ((header, point -> cell))."""
    header = ["point", "simulated", "measured", "measured spread", "sim speedup", "measured speedup",
              "measured speedup range"] + [h for h, _ in extra]
    rows = []
    for p in points:
        rng = p.get("measured_speedup_range")
        rows.append([p["label"] + (" (baseline)" if p["baseline"] else ""), _ms(p["sim_step_s"]),
                     _ms(p["measured_step_s"]), _pct(p["measured_spread"]), _x(p["sim_speedup"]),
                     _x(p["measured_speedup"]), "—" if not rng else f"{rng[0]:.3f} / {rng[1]:.3f}"]
                    + [f(p) for _, f in extra])
    return table_html(header, rows, dense=True)


def runs_table(result: SweepResult) -> str:
    """Every run behind the page: point, backend, repeat, run id, profile, routing source."""
    rows = [[point_label(result.grid[i]), backend, str(repeat + 1), Path(s["run_dir"]).name, str(s.get("profile")),
             str(s.get("routing_source"))]
            for (i, backend, repeat), s in sorted(result.summaries.items())]
    return table_html(["point", "backend", "repeat", "run", "profile", "routing source"], rows, dense=True)


def headline_table(headline: dict) -> str:
    """One row per figure; nested mappings (a best value per setting) one row per entry."""
    rows = []
    for k, v in headline.items():
        for sub_key, sub_value in (v.items() if isinstance(v, dict) else [("", v)]):
            rows.append([k, str(sub_key), _cell_text(sub_value)])
    return table_html(["figure", "setting", "value"], rows)


def _cell_text(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_cell_text(x) for x in v)
    return str(v)


def sweep_findings(points: list[dict], skipped: int = 0) -> list[str]:
    """What the sweep's figures show, in one to three sentences computed from its points:
    the fastest point on each backend and its speedup over the baseline, and whether the
    simulator picks the point that measured fastest."""
    out = []
    best = {}
    for key, what in (("sim_step_s", "simulated"), ("measured_step_s", "measured")):
        timed = [p for p in points if p[key] is not None]
        if not timed:
            continue
        b = best[key] = min(timed, key=lambda p: p[key])
        speedup = b["sim_speedup" if key == "sim_step_s" else "measured_speedup"]
        out.append(f"Fastest {what} point: {b['label']} ({_ms(b[key])}"
                   + ("" if b["baseline"] or speedup is None else f", x{speedup:.3f} over the baseline") + ").")
    paired = [p for p in points if p["sim_step_s"] is not None and p["measured_step_s"] is not None]
    if len(best) == 2 and best["sim_step_s"] in paired:
        place = sorted(paired, key=lambda p: p["measured_step_s"]).index(best["sim_step_s"]) + 1
        out.append("The simulator picks the point that measured fastest." if place == 1 else
                   f"The simulator's fastest point measured {_ordinal(place)} fastest of {len(paired)}.")
    if skipped:
        out.append(f"{skipped} point(s) of the grid are not valid scenarios (listed at the end).")
    return out


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def write_sweep_report(result: SweepResult, output: str | Path, title: str, note: str, headline: dict,
                       figures: list[go.Figure], extra_columns: list[tuple[str, callable]] = (),
                       table_path: str | Path | None = None) -> Path:
    points = result.points()
    paired = any(p["measured_speedup"] is not None and p["sim_speedup"] is not None for p in points)
    figs = list(figures) + ([speedup_figure(points)] if paired else []) + [step_bars_figure(points)]
    sections = [("Headline", headline_table(headline)), ("Figures", figures_html(figs)),
                ("Points", points_table(result, points, extra_columns)), ("Runs", runs_table(result))]
    if result.skipped:
        sections.append(("Points the scenario refuses", table_html(
            ["point", "reason"], [[point_label(p), why] for p, why in result.skipped])))
    if table_path is not None:
        note += f"\n\nEvery run's figures are in the table {Path(table_path).name} beside this page."
    return write_page(output, title, note, sections, scenario=f"sweep {result.sweep.name}: "
                      + (result.sweep.base.notes or "") + f" ({len(result.grid)} points)",
                      findings=sweep_findings(points, len(result.skipped)))
