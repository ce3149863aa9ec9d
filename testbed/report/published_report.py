"""``reports/published.html``: the simulator's predictions against the published runs
(``experiments/validate_published.py``, issue 26), from the experiment's result object:
the goals, each row's error with the run it comes from, the comparisons, DeepEP's
bandwidths, the assumed constants with their sensitivity, for each row that misses
the sentence ``testbed.study.published_validation.explain_miss`` computed, and the table
again at each unstated setting's other sourced value (``published_validation.under_setting``).
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from testbed.report.html_page import SERIES_COLORS, figures_html, legend_below, table_html, write_page

GiB = 2**30


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def _value(unit: str, x) -> str:
    if x is None:
        return "—"
    return f"{100 * x:.1f}%" if unit == "mfu" else f"{x:,.1f}"


def _rows_table(rows: list[dict]) -> str:
    header = ["row", "scenario", "unit", "published", "predicted", "error", "step", "bubble", "peak memory",
              "fits", "run"]
    body = []
    for r in rows:
        body.append([r["id"] + (" (weak)" if r["weak"] else ""), r["config"], r["unit"],
                     _value(r["unit"], r["published"]), _value(r["unit"], r["predicted"]), _pct(r["error"]),
                     f"{r['step_time_s']:.3f} s" if r.get("step_time_s") else "—",
                     _pct(r.get("bubble_fraction")).lstrip("+") if r.get("bubble_fraction") is not None else "—",
                     f"{r['peak_memory_bytes'] / GiB:.1f} GiB" if r.get("peak_memory_bytes") else "—",
                     {True: "yes", False: "no"}.get(r.get("fits"), "—"),
                     Path(r["run_dir"]).name if r.get("run_dir") else (r["missing"] or "—")])
    return table_html(header, body, dense=True)


def _stages_table(rows: list[dict]) -> str:
    stages = list(dict.fromkeys(k for r in rows for k in (r.get("stage_time_s") or {})))
    body = [[r["id"]] + [f"{1e3 * r['stage_time_s'][k]:.1f} ms" if k in (r.get("stage_time_s") or {}) else "—"
                         for k in stages] for r in rows if r.get("stage_time_s")]
    return table_html(["row"] + stages, body, dense=True)


def _comparisons_table(comps: list[dict]) -> str:
    body = [[c["what"], f"{c['published']:.3f}", "—" if c["predicted"] is None else f"{c['predicted']:.3f}",
             {True: "agrees", False: "differs", None: "—"}[c["direction_agrees"]],
             "—" if c["magnitude_gap"] is None else f"{100 * c['magnitude_gap']:.1f} pp"] for c in comps]
    return table_html(["comparison", "published ratio", "predicted ratio", "direction", "|gap|"], body)


def _deepep_table(rows: list[dict]) -> str:
    body = [[d["id"], d["kind"], str(d["ep"]), d["link"], f"{d['published_dispatch_GBps']:.0f}",
             f"{d['dispatch_GBps']:.1f}", _pct(d["dispatch_error"]), f"{d['published_combine_GBps']:.0f}",
             f"{d['combine_GBps']:.1f}", _pct(d["combine_error"]), d.get("bound_by", "—"),
             "; source of that figure: ".join(x for x in (d.get("why"), d.get("why_source")) if x)]
            for d in rows]
    return table_html(["row", "type", "EP", "link", "dispatch published GB/s", "simulated", "error",
                       "combine published GB/s", "simulated", "error", "simulated bound by", "where it misses"], body)


def _assumed_table(assumed: list[dict]) -> str:
    body = [[a["key"], a["row"] or "—", _pct(a.get("minus")), _pct(a.get("plus")), f"{100 * a['largest']:.2f}%",
             a.get("why") or ""] for a in assumed]
    return table_html(["assumed constant", "row it moves most", "step time at -20%", "at +20%", "largest |change|",
                       "not moved because"], body)


def _unstated_html(unstated: list[dict]) -> str:
    """Each unstated setting's rows, comparisons and goals (not judged: the setting's source in the text)."""
    out = []
    for u in unstated:
        g = u["goals"]
        out.append(f"<p><b>{u['what']}</b> ({', '.join(u['overrides'])}). Source: {u['source']}. With it the "
                   f"table's median |error| would be {_pct(g['median_abs_error']).lstrip('+')}, its worst "
                   f"{_pct(g['worst_abs_error']).lstrip('+')}, and {g['comparisons_within_magnitude']} of "
                   f"{g['comparisons']} comparisons within 5 points.</p>")
        out.append(table_html(["row", "scenario", "published", "predicted at it", "error", "bubble", "fits", "run"], [
            [r["id"], r["config"], _value(r.get("unit", ""), r.get("published")), _value(r.get("unit", ""), r["predicted"]),
             _pct(r["error"]), _pct(r.get("bubble_fraction")).lstrip("+") if r.get("bubble_fraction") is not None
             else "—", {True: "yes", False: "no"}.get(r.get("fits"), "—"),
             Path(r["run_dir"]).name if r.get("run_dir") else (r["missing"] or "—")] for r in u["rows"]], dense=True))
        out.append(_comparisons_table(u["comparisons"]))
    return "".join(out) or "<p>No unstated setting is listed.</p>"


def _figure(rows: list[dict]) -> go.Figure:
    fig = go.Figure()
    shown = [r for r in rows if r["predicted"] is not None]
    fig.add_trace(go.Bar(x=[r["id"] for r in shown], y=[100 * r["error"] for r in shown],
                         marker_color=SERIES_COLORS[0], name="predicted / published - 1",
                         hovertext=[r["config"] for r in shown]))
    for y in (-20, -10, 10, 20):
        fig.add_hline(y=y, line_dash="dot", line_color="#999")
    fig.update_yaxes(title="error of the predicted throughput (%)")
    return legend_below(fig, "Predicted against published throughput, per row (dotted: ±10%, ±20%)", 420)


def write_published_report(path: str | Path, out: dict) -> Path:
    """Write the page for the experiment's result object ``out`` (its --json output)."""
    g = out["goals"]
    findings = [(
        f"Median |error| {_pct(g['median_abs_error']).lstrip('+')} over {g['rows_simulated']} of {g['rows']} rows "
        f"(goal 10%: {'met' if g['median_met'] else 'not met'}), worst {_pct(g['worst_abs_error']).lstrip('+')} "
        f"(goal 20%: {'met' if g['worst_met'] else 'not met'}); comparisons in the published direction "
        f"{g['comparisons_direction_agree']} of {g['comparisons']}, within 5 points {g['comparisons_within_magnitude']};"
        f" DeepEP's worst bandwidth error {_pct(g['deepep_worst_abs_error']).lstrip('+')} (goal 15%: "
        f"{'met' if g['deepep_met'] else 'not met'}). Largest share of a simulated step from fitted constants: "
        f"{g['fitted_share']}.")]
    misses = [f"{r['id']}: {r['explanation']}" for r in out["rows"] if r["explanation"]]
    sections = [("Rows", _rows_table(out["rows"])),
                ("Errors", figures_html([_figure(out["rows"])])),
                ("Where each row misses", "".join(f"<p>{m}</p>" for m in misses) or "<p>Every row is within 20%.</p>"),
                ("Stage breakdown (summed stage times of one step)", _stages_table(out["rows"])),
                ("Published comparisons", _comparisons_table(out["comparisons"] + out["deepep_comparisons"])),
                ("DeepEP's normal kernels (h800 profile)", _deepep_table(out["deepep"])),
                ("Assumed constants and their sensitivity", _assumed_table(out["assumed_constants"])),
                ("Unstated settings at another sourced value (not judged)", _unstated_html(out.get("unstated", [])))]
    note = ("Each row is simulated from its scenario in configs/published/ (one measured step) on the profile the "
            "file names; the run folder is in the last column. Published figures are from docs/published.md, "
            "which gives their sources; nothing is fitted to them. Throughput is Megatron-LM's TFLOP/s per GPU "
            "(MFU against 989.5 TFLOP/s) or tokens/s per GPU, as the row publishes it. A sensitivity is the "
            "change of the row's simulated step time with one assumed constant of its profile moved by -20% "
            "and +20%" + (" (--quick: the first row's scenario only)." if out["quick"] else "."))
    return write_page(path, "Simulated against published MoE training runs", note, sections,
                      scenario="configs/published/", findings=findings)
