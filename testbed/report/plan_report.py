"""``testbed plan``'s outputs (issue 27): the plotly page - throughput against peak memory with
the Pareto front marked and the published runs placed, and each knob's effect (the best and
median tokens/s per GPU of the ranked layouts with each value) - and the ranking as CSV and
JSON, from ``testbed.study.plan.run_plan``'s result.
"""

from __future__ import annotations

import json
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from testbed.core.files import write_atomic
from testbed.report.html_page import SERIES_COLORS, figures_html, table_html, write_page
from testbed.study.plan import knob_effects
from testbed.study.sweep import write_table

GB = 1e9


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (memory, throughput) points no other beats on both (less or as much memory
    and more throughput, or as much throughput and less memory), by memory."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], float("-inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def _scatter(result: dict) -> go.Figure:
    ranked = result["ranking"]
    pts = [(e["peak_memory_bytes"] / GB, e["tokens_per_s_per_gpu"]) for e in ranked]
    front = pareto_front(pts)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="markers", name="fits",
                             marker={"color": SERIES_COLORS[0], "size": 7, "opacity": 0.7},
                             text=[f"#{e['rank']} {e['label']}" for e in ranked], hoverinfo="text+x+y"))
    over = result.get("not_ranked", [])
    if over:
        fig.add_trace(go.Scatter(x=[e["peak_memory_bytes"] / GB for e in over],
                                 y=[e["tokens_per_s_per_gpu"] for e in over], mode="markers",
                                 name="over memory (simulated)", marker={"color": "#bbbbbb", "size": 6,
                                                                         "symbol": "x"},
                                 text=[e["label"] for e in over], hoverinfo="text+x+y"))
    fig.add_trace(go.Scatter(x=[pts[i][0] for i in front], y=[pts[i][1] for i in front], mode="lines+markers",
                             name="Pareto front", line={"color": SERIES_COLORS[1]},
                             marker={"size": 9, "color": SERIES_COLORS[1]},
                             text=[ranked[i]["label"] for i in front], hoverinfo="text+x+y"))
    pub = result.get("published", [])
    if pub:
        fig.add_trace(go.Scatter(x=[p["peak_memory_bytes"] / GB for p in pub], y=[p["tokens_per_s_per_gpu"] for p in pub],
                                 mode="markers+text", name="published", text=[p["config"] for p in pub],
                                 textposition="top center", marker={"color": SERIES_COLORS[2], "size": 11,
                                                                    "symbol": "star"}))
    fig.add_vline(x=result["device_memory_bytes"] / GB, line_dash="dot", annotation_text="device memory")
    fig.update_layout(title="tokens/s per GPU against the fullest GPU's peak memory", height=520,
                      xaxis_title="peak memory (GB, 10^9 bytes)", yaxis_title="tokens/s per GPU")
    return fig


def _effects(result: dict) -> go.Figure | None:
    effects = knob_effects(result)
    if not effects:
        return None
    keys = list(effects)
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[k.rsplit(".", 1)[-1] for k in keys])
    for n, key in enumerate(keys):
        r, c = n // cols + 1, n % cols + 1
        values = list(effects[key])
        for j, what in enumerate(("best", "median")):
            fig.add_trace(go.Bar(x=values, y=[effects[key][v][what] for v in values], name=what,
                                 marker_color=SERIES_COLORS[j], showlegend=n == 0), row=r, col=c)
    fig.update_layout(title="each knob's effect: best and median tokens/s per GPU of the ranked layouts with "
                      "each value", barmode="group", height=300 * rows)
    return fig


def _top_table(result: dict) -> str:
    body = [[str(e["rank"]), f"{e['tokens_per_s_per_gpu']:,.0f}", f"{100 * (e['mfu'] or 0):.1f}%",
             f"{e['step_time_s']:.3f} s", f"{e['peak_memory_bytes'] / GB:.1f}",
             f"{100 * (e['bubble_fraction'] or 0):.1f}%", f"{e['exposed_s'] or 0:.3f} s", str(e["dominant_stage"]),
             e["label"], Path(e["run_dir"]).name] for e in result["top"]]
    return table_html(["rank", "tokens/s per GPU", "MFU", "step", "peak GB", "bubble", "exposed", "dominant stage",
                       "layout", "run"], body, dense=True)


def _rank(p: dict) -> str:
    """A published run's rank among the layouts of what it held fixed (its GEMM precision), then among all."""
    held = ", ".join(str(v) for v in p.get("held", {}).values()) or "all"
    return f"{p['rank']} of {p['of']} ({held}); {p['rank_of_all']} of all"


def _published_table(result: dict) -> str:
    body = [[p["config"], _rank(p), f"{p['tokens_per_s_per_gpu']:,.0f}",
             f"{100 * p['gap_to_best']:+.1f}%", "yes" if p["placed"] else "no",
             str(p["plan_rank_of_layout"]) if p["layout_in_space"] else "outside",
             ", ".join(f"{k} {v[0]} (plan {v[1]})" for k, v in p["differs_from_base"].items()) or "—",
             p["why"] or "—", Path(p["run_dir"]).name] for p in result.get("published", [])]
    return table_html(["published", "rank (among its GEMM precision's)", "tokens/s per GPU", "gap to best",
                       "top 5 or within 5%",
                       "its layout in the plan", "differs from the plan's base", "why", "run"], body, dense=True)


def _counts(result: dict) -> str:
    rows = [["considered", str(result["enumerated"])], ["valid", str(result["valid"])]]
    rows += [[f"refused on {k}", str(v)] for k, v in sorted(result["refused"].items())]
    rows += [[f"pruned by the bound: {k}", str(v)] for k, v in sorted(result["pruned"].items())]
    rows += [["simulated", str(result["simulated"])]]
    rows += [[f"over {k} (simulated)", str(v)] for k, v in result["not_fitting"].items()]
    rows += [["ranked", str(result["ranked"])], ["bound above the simulated peak", str(result["bound_above_peak"])]]
    return table_html(["layouts", "count"], rows)


def ranking_rows(result: dict) -> list[dict]:
    """The ranking as table rows: the layout's keys, then its figures."""
    out = []
    for e in result["ranking"] + result.get("not_ranked", []):
        row = {**e["layout"], "rank": e.get("rank"), "label": e["label"]}
        row.update({k: e[k] for k in ("tokens_per_s_per_gpu", "mfu", "step_time_s", "peak_memory_bytes",
                                      "bound_bytes", "fits", "bubble_fraction", "exposed_s", "dominant_stage",
                                      "run_dir")})
        out.append(row)
    return out


def write_plan_outputs(result: dict, page: str | Path) -> dict[str, Path]:
    """The page at ``page`` and beside it ``.csv`` (the ranking) and ``.json`` (the result)."""
    page = Path(page)
    figures = [f for f in (_scatter(result), _effects(result)) if f is not None]
    best = result["top"][0]
    findings = [(f"Of {result['enumerated']} layouts, {result['ranked']} fit and are ranked; the best, "
                f"{best['label']}, simulates {best['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
                f"(run {Path(best['run_dir']).name}).")]
    placed = result.get("published", [])
    if placed:
        findings.append("Published runs: " + "; ".join(
            f"{p['config']} rank {p['rank']} ({100 * abs(p['gap_to_best']):.1f}% "
            f"{'slower' if p['gap_to_best'] > 0 else 'faster'} than the best)" for p in placed) + ".")
    note = ("Each layout is the plan's base scenario with the layout's knobs, one warm-up and one measured "
            "simulated step. Layouts whose closed-form lower bound of memory (testbed.model.memory_estimate) "
            "exceeds the device are pruned before simulation; the rest are ranked when their simulated peak fits."
            "\n\nExposed: the simulated step's time on a GPU outside compute (for a pipelined run, one micro-batch "
            "step of its simulated stage).")
    sections = [("Counts", _counts(result)), ("Top layouts", _top_table(result))]
    if placed:
        sections.append(("Published runs", _published_table(result)))
    sections.append(("Figures", figures_html(figures)))
    write_page(page, f"testbed plan: {result['name']}", note, sections, scenario=result["name"], findings=findings)
    csv = write_table(ranking_rows(result), page.with_suffix(".csv"))
    js = page.with_suffix(".json")
    write_atomic(js, json.dumps(result, default=str, indent=1))
    return {"page": page, "csv": csv, "json": js}
