"""The claims ledger's page (``experiments/claims.py``): one verdict per claim C1-C16,
with its conditions, the reason, the numbers and the runs every number comes from.

``data`` is what the script writes as ``claims.json``: ``{"claims": [{"id", "claim",
"verdict", "conditions", "why", "tolerance", "numbers": {scenario: {figure: value, ...,
"backend", "runs"}}, "runs": [{"run", "backend", "scenario", "run_dir"}]}], ...}``.
Figures are formatted by their names: ``*_bytes`` as binary sizes, ``*_s`` in
milliseconds, shares, fractions, rates, utilisations, reductions, overheads,
slowdowns, gains and noise in percent, ratios and speeds as factors.
"""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go

from testbed.core.units import format_bytes
from testbed.report.html_page import category_ticks, figures_html, legend_below, series_color, table_html, write_page

VERDICT_COLORS = {"holds": "#2e7d32", "does not hold": "#b00020", "holds only under stated conditions": "#b26a00",
                  "not testable yet": "#555555"}
_PERCENT = ("share", "fraction", "spread", "util", "reduction", "overhead", "slowdown", "rate", "_over_", "gain",
            "noise")
_FACTOR = ("ratio", "speed")


def format_value(name: str, value) -> str:
    """One figure as a cell, by its name (module doc)."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(name, v) for v in value)
    if "bytes" in name:
        return f"{format_bytes(value)} ({value:.3g} B)"
    if name.endswith("_GB"):
        return f"{value:.2f} GB"
    if name.endswith("_s"):
        return f"{value * 1e3:.3f} ms"
    if any(k in name for k in _PERCENT):
        return f"{100 * value:.2f}%"
    if any(k in name for k in _FACTOR):
        return f"x{value:.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"


def _verdict(v: str) -> str:
    color = VERDICT_COLORS.get(v, "#222")
    return f'<strong style="color:{color}">{html.escape(v)}</strong>'


def summary_table(claims: list[dict]) -> str:
    rows = [[c["id"], c["claim"], c["verdict"], c["conditions"] or "—", str(len(c["runs"]))] for c in claims]
    return table_html(["claim", "hypothesis (as the seed documents state it)", "verdict", "conditions", "runs"], rows)


def numbers_table(claim: dict) -> str:
    rows = []
    for scenario, figs in claim["numbers"].items():
        runs = ", ".join(figs.get("runs", []))
        for name, value in figs.items():
            if name in ("runs", "backend"):
                continue
            rows.append([scenario, figs.get("backend", ""), name, format_value(name, value), runs])
    if not rows:
        return '<p class="note">No numbers: nothing the testbed runs measures this claim.</p>'
    return table_html(["scenario", "backend", "figure", "value", "runs"], rows, dense=True)


def runs_table(claim: dict) -> str:
    if not claim["runs"]:
        return ""
    rows = [[r["run"], r["backend"], r["scenario"], r["run_dir"]] for r in claim["runs"]]
    return table_html(["run", "backend", "scenario", "run folder"], rows, dense=True)


def claim_section(claim: dict) -> str:
    parts = [f"<p>Verdict: {_verdict(claim['verdict'])}</p>"]
    if claim["conditions"]:
        parts.append(f"<p><em>Conditions:</em> {html.escape(claim['conditions'])}</p>")
    parts.append(f"<p>{html.escape(claim['why'])}</p>")
    if claim.get("tolerance"):
        parts.append(f'<p class="note">Agreement means: {html.escape(claim["tolerance"])}.</p>')
    parts.append(numbers_table(claim))
    parts.append(runs_table(claim))
    return "\n".join(parts)


def a2a_share_figure(claim: dict) -> go.Figure | None:
    """C16: the A2A share of the step per scenario against the 25% / 35% thresholds."""
    rows = [(k, v["a2a_share_of_step"]) for k, v in claim["numbers"].items() if "a2a_share_of_step" in v]
    if not rows:
        return None
    labels = [k for k, _ in rows]
    fig = go.Figure(go.Bar(x=labels, y=[100 * v for _, v in rows], marker_color=series_color(0), name="A2A share"))
    for y, name in ((25, "healthy below 25%"), (35, "A2A-bound above 35%")):
        fig.add_hline(y=y, line_dash="dash", annotation_text=name, annotation_position="top left")
    fig.update_xaxes(category_ticks(labels))
    fig.update_yaxes(title="dispatch + combine + backward, % of step", rangemode="tozero")
    return legend_below(fig, "C16: all-to-all share of the step", 480, "the rule of thumb's thresholds dashed")


def write_claims_report(data: dict, output: str | Path) -> Path:
    claims = data["claims"]
    backends = ", ".join(data.get("backends", []))
    note = ("Every claim below is a hypothesis from the seed documents (docs/claims.md C1-C16), tested here, never taken "
            "as fact. Verdicts: holds (the testbed's numbers agree within the stated tolerance), does not hold, "
            "holds only under stated conditions (some scenarios, a part of the claim, or a reading of it; the "
            "conditions say which), not testable yet (the testbed does not model what the claim is about; the "
            "reason is given). Every number names the runs it comes from; 'simulated' numbers come from the sim "
            "backend, 'measured' ones from real CPU ranks."
            f"\n\nBackends: {backends}{' (quick)' if data.get('quick') else ''}"
            + (f"; measured side: {data['fabric']}, profile {data.get('profile')}" if data.get("fabric") else "")
            + (f"; {data['wall_s']:.0f} s of wall time." if data.get("wall_s") is not None else "."))
    sections = [("Verdicts", summary_table(claims))]
    for claim in claims:
        inner = claim_section(claim)
        if claim["id"] == "C16" and (fig := a2a_share_figure(claim)) is not None:
            inner += figures_html([fig])
        sections.append((f"{claim['id']}: {claim['claim']}", inner))
    return write_page(output, "Claims ledger: C1-C16 on the testbed", note, sections, scenario="claims ledger C1-C16")
