"""The simulated-vs-measured report (``experiments/validate_sim_vs_real.py``).

Every number on the page comes from the result the experiment passes in, which names
the run folders of each point (measured: a real run; simulated: the simulator replaying
that run's routing with the named profile). Times in milliseconds everywhere; stage
colours are the ones of every testbed report (``testbed.report.html_page.STAGE_COLORS``).
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from testbed.core.stages import STAGES, TOKEN_STAGES
from testbed.report.html_page import (
    category_ticks,
    figures_html,
    legend_below,
    series_color,
    shorten,
    spans_decade,
    stage_color,
    table_html,
    value_axis,
    write_page,
)
from testbed.scenario.profile import load_profile

#: where the simulated side's routing comes from, in every validation report
ROUTING_SOURCE = "the simulator replays each real run's routing (its routing.npz), so both sides route the same tokens"

#: stages whose work is a collective (a fitted host cost there adds to the network model's time)
COLLECTIVE_STAGES = TOKEN_STAGES + ("expert_sync", "dense_sync")


def _fraction(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def _series(p: dict) -> str:
    """The series a point is drawn in: its cluster shape (emulated grid) or rank count."""
    if p.get("cluster"):
        return f"{p['cluster']} ({p['world']} ranks)"
    return f"{p['world']} ranks"


def scatter_figure(points: list[dict]) -> go.Figure:
    """Simulated against measured median step time (ms), one colour per series, with the
    identity line; log axes when the times span more than 10x."""
    fig = go.Figure()
    for i, name in enumerate(dict.fromkeys(_series(p) for p in sorted(points, key=lambda p: p["world"]))):
        sel = [p for p in points if _series(p) == name]
        fig.add_trace(go.Scatter(
            x=[p["measured_step_s"] * 1e3 for p in sel], y=[p["simulated_step_s"] * 1e3 for p in sel],
            mode="markers", name=name, marker={"size": 10, "color": series_color(i)},
            text=[_label(p) for p in sel],
            hovertemplate="%{text}<br>measured %{x:.1f} ms<br>simulated %{y:.1f} ms<extra></extra>"))
    values = [p[k] * 1e3 for p in points for k in ("measured_step_s", "simulated_step_s")]
    identity_axes(fig, values, "ms")
    return legend_below(fig, "Simulated vs measured step time (median of measured steps)", 560)


def identity_axes(fig: go.Figure, values: list[float], unit: str) -> None:
    """The identity line (simulated = measured) over ``values``, and both axes in ``unit``
    (log when the values span more than 10x)."""
    if not values:
        return
    ends = [min(values) / 1.1, max(values) * 1.1] if spans_decade(values) else [0, max(values) * 1.1]
    fig.add_trace(go.Scatter(x=ends, y=ends, mode="lines", name="identity (simulated = measured)",
                             line={"dash": "dash", "color": "#888"}, hoverinfo="skip"))
    fig.update_xaxes(value_axis(f"measured {unit}", values))
    fig.update_yaxes(value_axis(f"simulated {unit}", values))


def stage_error_figure(points: list[dict]) -> go.Figure:
    """Signed error (simulated - measured) per stage and point, ms."""
    stages = [s for s in STAGES if any(s in p["stages"] for p in points)]
    z = [[p["stages"].get(s, {}).get("error_s", 0.0) * 1e3 for s in stages] for p in points]
    labels = [_label(p) for p in points]
    fig = go.Figure(go.Heatmap(z=z, x=stages, y=labels, colorscale="RdBu", zmid=0, colorbar={"title": "ms"},
                               hovertemplate="%{y}<br>%{x}: %{z:+.2f} ms<extra></extra>"))
    fig.update_yaxes(autorange="reversed", **category_ticks(labels))
    return legend_below(fig, "Error by stage: simulated minus measured", max(380, 26 * len(points) + 200),
                        subtitle="ms per step, mean over ranks; blue: simulated longer, red: simulated shorter")


def stage_time_figure(points: list[dict]) -> go.Figure:
    """Per point, the measured and the simulated step split by stage (ms), stacked in
    step order in the colours of every report; log axis when the totals span > 10x."""
    stages = [s for s in STAGES if any(s in p["stages"] for p in points)]
    rows = [(f"{_label(p)} · {side}", p, side) for p in points for side in ("measured", "simulated")]
    labels = [r[0] for r in rows]
    fig = go.Figure()
    for stage in stages:
        x = [1e3 * p["stages"].get(stage, {}).get(f"{side}_s", 0.0) for _, p, side in rows]
        fig.add_bar(name=stage, y=labels, x=x, orientation="h", marker_color=stage_color(stage), customdata=labels,
                    hovertemplate=f"%{{customdata}}<br>{stage}: %{{x:.2f}} ms<extra></extra>")
    totals = [sum(1e3 * st.get(f"{side}_s", 0.0) for st in p["stages"].values()) for _, p, side in rows]
    fig.update_xaxes(value_axis("ms per step (mean over ranks)", totals))
    # the point's label once, on its measured bar; its simulated bar follows right below
    texts = [f"{shorten(_label(p))} · measured" if side == "measured" else "simulated" for _, p, side in rows]
    fig.update_yaxes(autorange="reversed", **category_ticks(labels, texts))
    return legend_below(fig, "Stage times per point", 220 + 22 * len(rows), barmode="stack", bargap=0.25,
                        subtitle="each point's measured step, then its simulated step, split by stage")


def _label(p: dict) -> str:
    if p.get("grid") == "emulated":
        return (f"{p['cluster']} {p['token_strategy']}/{p['expert_sync']} {p['placement']} "
                f"over {p['oversubscription']:g} skew {p['skew']:g}")
    if p.get("grid") == "gpu":
        return f"GPU x{p['world']} page {p['page_size']} heat {p['heat']}"
    return f"x{p['world']} {p['token_strategy']}/{p['expert_sync']} cf={p['capacity_factor']}"


def miss_reason(p: dict, threshold: float) -> str:
    """For a point whose step error exceeds ``threshold``: the stage most off, by how much,
    its share of the stages' summed |error|, the next stage, and the step's error against
    its run-to-run spread, all from the point's own stage times."""
    if abs(p["rel_error"]) <= threshold or not p["worst_stage"]:
        return ""
    stages = p["stages"]
    worst = p["worst_stage"]
    st = stages[worst]
    gross = sum(abs(e["error_s"]) for e in stages.values())
    if gross <= 0:
        return f"no stage is off: the step's {100 * p['rel_error']:+.1f}% lies outside the stage times"
    side = "simulated longer" if st["error_s"] > 0 else "simulated shorter"
    text = (f"{worst} off by {st['error_s'] * 1e3:+.2f} ms ({_ms(st['simulated_s'])} vs {_ms(st['measured_s'])} ms, "
            f"{side}"
            + (f", {100 * st['error_s'] / st['measured_s']:+.0f}% of the stage" if st["measured_s"] > 0 else "")
            + f"): {100 * abs(st['error_s']) / gross:.0f}% of the stages' summed |error| of {gross * 1e3:.2f} ms")
    rest = sorted((s for s in stages if s != worst and stages[s]["error_s"]), key=lambda s: -abs(stages[s]["error_s"]))
    if rest:
        text += f"; next {rest[0]} {stages[rest[0]]['error_s'] * 1e3:+.2f} ms"
    spread = p.get("run_to_run_spread")
    if spread is not None:
        text += (f"; step error {100 * p['rel_error']:+.1f}% against a run-to-run spread of {100 * spread:.1f}%")
    return text


def calibrated_here(result: dict) -> str | None:
    """Whether the profile was calibrated on this machine, in words; None when the result
    does not say."""
    here = result.get("profile_calibrated_here")
    if here is None:
        return None
    return "calibrated on this machine" if here else "not calibrated on this machine"


def sources_note(result: dict) -> str:
    """The page note's sentence on the machine profile and the routing source."""
    here = calibrated_here(result)
    name = load_profile(result["profile"]).name
    return (f"Machine profile: {name}" + (f" ({here})" if here else "") + f". Routing source: {ROUTING_SOURCE}.")


def fitted_figures(profile) -> list[str]:
    """What ``profile`` holds that was fitted (``measured``), one sentence each, computed
    from its rows; empty when nothing was."""
    m = profile.measured

    def worlds(rows) -> str:
        return ", ".join(str(w) for w in sorted({r["world"] for r in rows}))

    out = []
    if m.collective_latency:
        out.append(f"library latency per call and per algorithm step at worlds {worlds(m.collective_latency)} "
                   "(measured.collective_latency; the bytes are timed by the network model)")
    if m.compute_scale:
        out.append(f"compute contention at worlds {worlds(m.compute_scale)} (measured.compute_scale)")
    if m.stage_us:
        comm = sorted({r["stage"] for r in m.stage_us if r["stage"] in COLLECTIVE_STAGES})
        out.append(f"host cost per stage call, {len(m.stage_us)} entries at worlds {worlds(m.stage_us)} "
                   "(measured.stage_us)" + (f", of which the collective stages {', '.join(comm)} add a fixed cost "
                                            "per call to the network model's time" if comm else ""))
    return out


def provenance_rows(result: dict) -> list[list[str]]:
    """The report's statements on how each profile was made and what calibration and
    validation share, as the experiment computed them (``testbed.run.sources``); none when the
    result does not carry them."""
    rows = []
    for entry in result.get("provenance", []):
        rows.append([f"{entry['grid']}: how the profile was made", entry["made"]])
        rows.append([f"{entry['grid']}: out of sample", entry["out_of_sample"]])
        shared = entry.get("shared") or []
        rows.append([f"{entry['grid']}: shared by calibration and validation",
                     "; ".join(shared) if shared else "nothing recorded (the profile has no calibration record)"])
    if result.get("left_out"):
        rows.append(["left out", "; ".join(result["left_out"])])
    return rows


def profile_section(result: dict) -> str:
    """The profile the simulator used, how it was made (calibration shapes included),
    whether it was calibrated on this machine, the routing source, what calibration and
    validation share (computed), its fitted figures, and the shapes the validation
    points used."""
    profile = load_profile(result["profile"])
    prof_rows = [["name", profile.name], ["machine", profile.machine], ["date", profile.date],
                 ["versions", ", ".join(f"{k} {v}" for k, v in profile.versions.items())],
                 ["how it was made (calibration shapes included)", profile.source], ["file", result["profile"]]]
    if calibrated_here(result) is not None:
        prof_rows.append(["calibrated on this machine", "yes" if result["profile_calibrated_here"] else "no"])
    prof_rows.append(["routing source", ROUTING_SOURCE])
    prof_rows += provenance_rows(result)
    fitted = fitted_figures(profile)
    prof_rows.append(["fitted figures", "; ".join(fitted) if fitted else "none (nothing in measured)"])
    measured = [[r["world"], f"{r['call_us']:.0f}", f"{r['step_us']:.0f}"] for r in profile.measured.collective_latency]
    shapes = sorted({p["shape"] for p in result["points"] if p.get("shape")})
    return (table_html(["", ""], prof_rows)
            + "<h3>Validation shapes (hidden x ffn x tokens per rank x experts)</h3>"
            + table_html(["shape", "points"], [[sh, sum(p.get("shape") == sh for p in result["points"])] for sh in shapes])
            + ("<h3>Fitted library latency (measured.collective_latency; bytes are timed by the network model)</h3>"
               + table_html(["world", "us per call", "us per algorithm step"], measured) if measured else ""))


def out_of_sample_note(result: dict) -> str:
    """The page note's sentence on how the profile was made and whether the points are out
    of sample, as computed for this result; empty when the result does not say."""
    return " ".join(f"{e['made']} {e['out_of_sample']}" for e in result.get("provenance", []))


def validation_findings(result: dict) -> list[str]:
    """What a validation's figures show, in two or three sentences computed from its
    result: the median and worst step-time error against their goals, the direction the
    simulator errs in, and how many speedup pairs it orders as measured."""
    points, goals = result["points"], result["goals"]
    if not points:
        return ["No point was judged."]
    worst = max(points, key=lambda p: abs(p["rel_error"]))
    out = [f"Over {len(points)} points the simulated step is off by {100 * result['median_abs_error']:.1f}% at the "
           f"median (goal {100 * goals['median_abs_error']:.0f}%) and by {100 * worst['rel_error']:+.1f}% at worst, "
           f"at {_label(worst)} (goal {100 * goals['max_abs_error']:.0f}%), against a measured run-to-run spread "
           f"of {100 * result['median_run_to_run_spread']:.1f}%."]
    under = sum(p["rel_error"] < 0 for p in points)
    if under in (0, len(points)):
        out.append(f"Every point is {'under' if under else 'over'}-predicted: the error is a bias, not noise.")
    else:
        out.append(f"{under} of {len(points)} points are under-predicted, {len(points) - under} over-predicted.")
    scored = [q for q in result["speedup_pairs"] if q["scored"]]
    if scored:
        agree = sum(q["agree"] for q in scored)
        out.append(f"The simulator orders {agree} of {len(scored)} scored speedup pairs as measured.")
    return out


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
            "time. " + (out_of_sample_note(result) + " " if result.get("provenance") else "")
            + "Speedup pairs whose measured times differ by less than the tie threshold are shown "
            "but not scored.\n\n" + sources_note(result) + " Times in milliseconds everywhere; an axis marked "
            "\"log scale\" is logarithmic because its values span more than 10x. Stages have the colours of every "
            "testbed report.")
    sections = [
        ("Result against the goals", table_html(["figure", "value", "goal"], head)),
        ("Figures", figures_html([scatter_figure(points), stage_error_figure(points), stage_time_figure(points)])),
        ("Points", table_html(["point", "measured ms", "simulated ms", "error", "stage most off",
                               "why (where the point misses)", "real run", "simulated run"], rows)),
        ("Speedups (time of b / time of a)", table_html(["a", "b", "ranks", "measured", "simulated", "same order",
                                                         ""], pair_rows)),
        ("Profile used, and the shapes of calibration and validation", profile_section(result)),
    ]
    return write_page(output, "Simulated vs measured: " + profile.name, note, sections,
                      findings=validation_findings(result))
