"""The simulated-vs-measured report (``experiments/validate_sim_vs_real.py``).

Every number on the page comes from the result the experiment passes in, which names
the run folders of each point (measured: a real run; simulated: the simulator replaying
that run's routing with the named profile). Times in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from testbed.html_page import figures_html, table_html, write_page
from testbed.profile import load_profile
from testbed.stages import STAGES

#: what a large error in a stage usually means, for the reader of a missed point
WHY = {
    "route": "router host work and the counts all-gather: Python time under CPU contention and the library's "
             "per-call latency vary more than the fitted host cost and latency say",
    "paging": "page copies and replica refreshes carry per-page host costs the model averages",
    "dispatch": "all-to-all: TCP shares the links less evenly than the max-min model, and each message's software "
                "cost grows when the rank's core is busy with other ranks' compute",
    "combine": "all-to-all: TCP shares the links less evenly than the max-min model, and each message's software "
               "cost grows when the rank's core is busy with other ranks' compute",
    "combine_backward": "backward all-to-all plus autograd work that the fixed host cost per call does not follow",
    "dispatch_backward": "backward all-to-all plus autograd work that the fixed host cost per call does not follow",
    "experts": "expert GEMMs: the per-expert loop's Python overhead grows with experts per rank, and the kernel's "
               "network processing takes CPU time the core-sharing model does not count",
    "experts_backward": "expert GEMMs: the per-expert loop's Python overhead grows with experts per rank, and the "
                        "kernel's network processing takes CPU time the core-sharing model does not count",
    "route_backward": "router backward and autograd bookkeeping",
    "expert_sync": "group creation and small reduce-scatter / all-gather calls (two-stage) or the all-reduce's "
                   "pipelining, which the ring model times as one fluid transfer",
    "dense_sync": "the first collective after the backward also absorbs waiting for the slowest rank (stragglers)",
    "optimizer": "per-page host work of the weight update",
    "heat": "heat-map update host work",
}


def _fraction(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def scatter_figure(points: list[dict]) -> go.Figure:
    fig = go.Figure()
    for world in sorted({p["world"] for p in points}):
        sel = [p for p in points if p["world"] == world]
        fig.add_trace(go.Scatter(
            x=[p["measured_step_s"] * 1e3 for p in sel], y=[p["simulated_step_s"] * 1e3 for p in sel],
            mode="markers", name=f"{world} ranks", marker={"size": 10},
            text=[_label(p) for p in sel], hovertemplate="%{text}<br>measured %{x:.1f} ms<br>simulated %{y:.1f} ms"))
    top = max(max(p["measured_step_s"], p["simulated_step_s"]) for p in points) * 1e3 * 1.1
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="identity",
                             line={"dash": "dash", "color": "#888"}))
    fig.update_layout(title="Simulated vs measured step time (median of measured steps)", height=520,
                      xaxis_title="measured ms", yaxis_title="simulated ms")
    return fig


def stage_error_figure(points: list[dict]) -> go.Figure:
    """Signed error (simulated - measured) per stage and point, ms."""
    stages = [s for s in STAGES if any(s in p["stages"] for p in points)]
    z = [[p["stages"].get(s, {}).get("error_s", 0.0) * 1e3 for s in stages] for p in points]
    fig = go.Figure(go.Heatmap(z=z, x=stages, y=[_label(p) for p in points], colorscale="RdBu", zmid=0,
                               colorbar={"title": "ms"}))
    fig.update_layout(title="Error by stage: simulated minus measured (ms per step, mean over ranks)",
                      height=max(360, 26 * len(points) + 160))
    return fig


def _label(p: dict) -> str:
    if p.get("grid") == "emulated":
        return (f"{p['cluster']} {p['token_strategy']}/{p['expert_sync']} {p['placement']} "
                f"over {p['oversubscription']:g} skew {p['skew']:g}")
    if p.get("grid") == "gpu":
        return f"GPU x{p['world']} page {p['page_size']} heat {p['heat']}"
    return f"x{p['world']} {p['token_strategy']}/{p['expert_sync']} cf={p['capacity_factor']}"


def miss_reason(p: dict, threshold: float) -> str:
    """Which stage is off, by how much and why, for a point whose error exceeds ``threshold``."""
    if abs(p["rel_error"]) <= threshold or not p["worst_stage"]:
        return ""
    st = p["stages"][p["worst_stage"]]
    return (f"{p['worst_stage']} off by {st['error_s'] * 1e3:+.2f} ms "
            f"({_ms(st['simulated_s'])} vs {_ms(st['measured_s'])}): {WHY.get(p['worst_stage'], '')}")


def profile_section(result: dict) -> str:
    """The profile the simulator used, how it was made (calibration shapes included), its
    fitted library latency, and the shapes the validation points used."""
    profile = load_profile(result["profile"])
    prof_rows = [["name", profile.name], ["machine", profile.machine], ["date", profile.date],
                 ["versions", ", ".join(f"{k} {v}" for k, v in profile.versions.items())],
                 ["how it was made (calibration shapes included)", profile.source], ["file", result["profile"]]]
    measured = [[r["world"], f"{r['call_us']:.0f}", f"{r['step_us']:.0f}"] for r in profile.measured.collective_latency]
    shapes = sorted({p["shape"] for p in result["points"] if p.get("shape")})
    return (table_html(["", ""], prof_rows)
            + "<h3>Validation shapes (hidden x ffn x tokens per rank x experts)</h3>"
            + table_html(["shape", "points"], [[sh, sum(p.get("shape") == sh for p in result["points"])] for sh in shapes])
            + "<h3>Fitted library latency (the only fitted collective figures; bytes are timed by the network model)</h3>"
            + table_html(["world", "us per call", "us per algorithm step"], measured))


def write_validation_report(result: dict, output: str | Path) -> Path:
    points, pairs = result["points"], result["speedup_pairs"]
    goals = result["goals"]
    head = [
        ["median |step-time error|", f"{100 * result['median_abs_error']:.1f}%", f"<= {100 * goals['median_abs_error']:.0f}%"],
        ["worst |step-time error|", f"{100 * result['max_abs_error']:.1f}%", f"<= {100 * goals['max_abs_error']:.0f}%"],
        ["speedup rank agreement", _fraction(result["speedup_rank_agreement"]),
         f"= {goals['speedup_rank_agreement']} ({result['scored_pairs']} of {result['pairs']} pairs scored)"],
        ["rank agreement, all pairs", _fraction(result["speedup_rank_agreement_all_pairs"]), "(ties included)"],
        ["run-to-run spread of measurements (median)", f"{100 * result['median_run_to_run_spread']:.1f}%",
         f"{result['repeats']} real runs per point; pairs within {100 * result['tie']:.0f}% are ties"],
    ]
    rows = [[_label(p), _ms(p["measured_step_s"]), _ms(p["simulated_step_s"]), f"{100 * p['rel_error']:+.1f}%",
             p["worst_stage"] or "", miss_reason(p, goals["median_abs_error"]), p["real_run"], p["sim_run"]]
            for p in points]
    pair_rows = [[q["a"], q["b"], f"x{q['world']}", f"{q['measured_speedup']:.3f}", f"{q['simulated_speedup']:.3f}",
                  "yes" if q["agree"] else "NO", "scored" if q["scored"] else "tie (not scored)"] for q in pairs]
    profile = load_profile(result["profile"])
    note = ("Each point ran on the real backend (measured) and on the simulator replaying that run's routing "
            "with the profile below (simulated); error = (simulated - measured) / measured of the median step "
            "time. The profile was calibrated in a separate run (testbed calibrate); none of these points was "
            "used to fit it. Speedup pairs whose measured times differ by less than the tie threshold are shown "
            "but not scored.")
    sections = [
        ("Result against the goals", table_html(["figure", "value", "goal"], head)),
        ("Figures", figures_html([scatter_figure(points), stage_error_figure(points)])),
        ("Points", table_html(["point", "measured ms", "simulated ms", "error", "stage most off",
                               "why (where the point misses)", "real run", "simulated run"], rows)),
        ("Speedups (time of b / time of a)", table_html(["a", "b", "ranks", "measured", "simulated", "same order",
                                                         ""], pair_rows)),
        ("Profile used, and the shapes of calibration and validation", profile_section(result)),
    ]
    return write_page(output, "Simulated vs measured: " + profile.name, note, sections)
