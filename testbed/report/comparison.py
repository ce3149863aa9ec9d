"""One self-contained HTML page that compares run folders (``testbed.run.store``).

The page embeds plotly.js once, inline, so it works offline. Every number on it is
read from the run folders given: ``summary.json`` (medians and means over the measured
steps, see ``testbed.run.results.summarize``), ``steps.jsonl`` (step time per step) and
``scenario.toml`` (the labels). Only complete runs are shown: a folder without a
readable summary, or whose summary says ``"complete": false``, is skipped with a notice.

Units: times in milliseconds (stored in seconds); traffic and memory in bytes with
binary units (tables: ``testbed.core.units.format_bytes``, figures: MiB = 2^20 bytes), traffic
per step summed over all ranks, memory the peak of the fullest rank.
"""

from __future__ import annotations

import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from testbed.core.errors import ScenarioError
from testbed.core.stages import STAGES
from testbed.core.units import format_bytes
from testbed.report.comparison_findings import comparison_findings
from testbed.report.html_page import (
    MiB,
    category_ticks,
    figures_html,
    legend_below,
    series_color,
    shorten,
    spans_decade,
    stage_color,
    table_html,
    value_axis,
    wrap,
    write_page,
)
from testbed.run.results import StepRecord
from testbed.scenario.topology import LEVELS

#: scenario fields never used in labels (where results go, free text)
_LABEL_IGNORE = {"run.output_dir", "notes"}
_SEP = " · "
#: values that leave a field out of a label: nothing to show
_UNSET = (None, "", [], {})
#: the longest last part of a path shown in a label (a run id ends in its time and a random tag)
_PATH_CHARS = 20


@dataclass
class Run:
    """One complete run folder as the report reads it."""

    dir: Path
    scenario: dict
    summary: dict
    steps: list[StepRecord]
    label: str = ""

    @property
    def backend(self) -> str:
        return str(self.summary.get("backend") or "unknown backend")


def load_report_run(run_dir: str | Path) -> Run:
    """Read a complete run folder; raise ``ScenarioError("RUN_DIR", ...)`` saying why
    when it is not one (no summary, a stopped run, unreadable files)."""
    d = Path(run_dir)
    if not (d / "summary.json").is_file():
        raise ScenarioError("RUN_DIR", str(run_dir), "not a run folder (no summary.json)")
    try:
        summary = json.loads((d / "summary.json").read_text())
        if not isinstance(summary, dict):
            raise ValueError("summary.json does not hold an object")
        scenario = tomllib.loads((d / "scenario.toml").read_text()) if (d / "scenario.toml").is_file() else {}
        lines = (d / "steps.jsonl").read_text().splitlines() if (d / "steps.jsonl").is_file() else []
        steps = [StepRecord.from_dict(json.loads(line)) for line in lines if line.strip()]
    except (ValueError, TypeError, OSError) as e:
        raise ScenarioError("RUN_DIR", str(run_dir), f"unreadable run folder: {e}") from None
    if summary.get("complete", True) is False:
        raise ScenarioError("RUN_DIR", str(run_dir), "incomplete run (its summary says complete: false)")
    return Run(d, scenario, summary, steps)


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _show(name: str, value) -> str | None:
    """A field as a part of a label, or None when it has no value to show: a string
    speaks for itself ("alltoall"), a path by its last part (shortened), other values
    carry their key."""
    if value in _UNSET:
        return None
    key = name.rsplit(".", 1)[-1]
    if isinstance(value, str):
        return f"{key}={shorten(Path(value).name, _PATH_CHARS)}" if "/" in value else value
    return f"{key}={json.dumps(value)}"


def run_label(scenario_dicts: list[dict], backends: list[str] | None = None) -> list[str]:
    """Short labels: the backend, then the scenario fields whose values differ between runs.

    Fields in file order; ``run.output_dir`` and ``notes`` left out, and so is a field a
    run leaves unset (no "key=" parts). Equal labels get " #1", " #2", ... so that every
    run keeps its own bar.
    """
    flat = [_flatten(d) for d in scenario_dicts]
    keys: list[str] = []
    for f in flat:
        keys += [k for k in f if k not in keys and k not in _LABEL_IGNORE]
    differing = [k for k in keys if len({json.dumps(_shown(f.get(k)), default=repr) for f in flat}) > 1]
    labels = []
    for i, f in enumerate(flat):
        parts = [backends[i]] if backends else []
        parts += [p for k in differing if (p := _show(k, f.get(k))) is not None]
        labels.append(_SEP.join(parts) or "run")
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(f"{label} #{seen[label]}" if labels.count(label) > 1 else label)
    return out


def _shown(value):
    """Unset, empty and missing are one value to a label."""
    return None if value in _UNSET else value


def load_runs(run_dirs: list[str | Path]) -> list[Run]:
    """Read every complete run folder and give each its label; every other folder is
    skipped with a one-line notice on stderr. Raise ``ScenarioError`` when none is left."""
    if not run_dirs:
        raise ScenarioError("RUN_DIR", "", "give at least one run folder")
    runs = []
    for d in run_dirs:
        try:
            runs.append(load_report_run(d))
        except ScenarioError as e:
            print(f"testbed report: skipping {d}: {e.reason}", file=sys.stderr)
    if not runs:
        given = " ".join(str(d) for d in run_dirs[:3]) + (" ..." if len(run_dirs) > 3 else "")
        raise ScenarioError("RUN_DIR", given, f"no complete run among the {len(run_dirs)} given")
    for run, label in zip(runs, run_label([r.scenario for r in runs], [r.backend for r in runs])):
        run.label = label
    return runs


# ---- formatting ----------------------------------------------------------------------
def _ms(seconds) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _loss(s: dict) -> str:
    if s.get("loss_first") is None:
        return "—"
    return f"{s['loss_first']:.4f} → {s['loss_last']:.4f}"


def profile_name(s: dict) -> str:
    return str(s.get("profile") or "unknown")


def calibrated_here(s: dict) -> str:
    """Whether the run's profile was calibrated on this machine: yes, no or unknown."""
    return {True: "yes", False: "no"}.get(s.get("profile_calibrated_here"), "unknown")


def routing_source(s: dict) -> str:
    return str(s.get("routing_source") or "unknown")


def _table(runs: list[Run]) -> str:
    head = ["run", "folder", "measured steps", "step time (median)", "peak memory",
            "dropped tokens", "page moves / step", "group-cache hits", "loss first → last"]
    rows = []
    for r in runs:
        s = r.summary
        rows.append([r.label, str(r.dir), str(s.get("measured_steps", len(r.steps))), _ms(s.get("step_time_s")),
                     format_bytes(s.get("peak_memory_bytes", 0)), _pct(s.get("dropped_token_fraction")),
                     f"{s.get('page_moves_per_step', 0.0):.1f}", _pct(s.get("group_cache_hit_rate")), _loss(s)])
    return table_html(head, rows)


def _sources_table(runs: list[Run]) -> str:
    """Per run: the machine profile it was timed with and where its routing came from."""
    head = ["run", "backend", "machine profile", "profile source", "profile calibrated on this machine",
            "routing source"]
    rows = [[r.label, r.backend, profile_name(r.summary), str(r.summary.get("profile_source") or "unknown"),
             calibrated_here(r.summary), routing_source(r.summary)] for r in runs]
    return table_html(head, rows)


# ---- figures --------------------------------------------------------------------------
def _panels(runs: list[Run], totals: list[float], unit: str) -> list[tuple[str, list[Run]]]:
    """Runs grouped so that no panel's totals span more than 10x: one panel when they do
    not, else one per backend (a 6 ms simulated step beside a 170 ms measured one), and
    within a backend one per band of totals within 10x of each other. Stacked bars stay
    on linear axes: on a log axis a stack's segments would not show their share."""
    if not spans_decade(totals):
        return [("", runs)]
    panels = []
    for backend in dict.fromkeys(r.backend for r in runs):
        mine = [(i, t) for i, (r, t) in enumerate(zip(runs, totals)) if r.backend == backend]
        bands: list[list[tuple[int, float]]] = []
        for i, t in sorted(mine, key=lambda x: x[1]):
            if bands and t <= 10 * bands[-1][0][1]:
                bands[-1].append((i, t))
            else:
                bands.append([(i, t)])
        for band in bands:
            lo, hi = _round(band[0][1]), _round(band[-1][1])
            title = backend if len(bands) == 1 else f"{backend}: {lo if lo == hi else f'{lo} to {hi}'} {unit}"
            panels.append((title, [runs[i] for i in sorted(i for i, _ in band)]))
    return panels


def _round(x: float) -> str:
    """A total for a panel title: three significant digits, whole numbers from 100."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


#: heights in figures (px): a bar, and a line of its label, the gap between panels (tick
#: labels, axis title, the next panel's title), one row of the stage legend
_BAR_PX, _LINE_PX, _GAP_PX, _LEGEND_ROW_PX = 20, 14, 95, 22


def _bar_px(runs: list[Run]) -> int:
    """Height of one run's bar: room for its label's lines (``wrap``)."""
    return _BAR_PX + _LINE_PX * max(wrap(r.label).count("<br>") + 1 for r in runs)


def _stacked_by_stage(runs: list[Run], values, unit: str, title: str) -> go.Figure:
    """Horizontal bars, one per run, stacked by stage in step order; stages that are zero
    in every run left out. ``values(run)`` gives {stage: value in ``unit``}."""
    per_run = {r.label: values(r) for r in runs}
    panels = _panels(runs, [sum(v.values()) for v in per_run.values()], unit)
    stages = [st for st in STAGES if any(v.get(st, 0) for v in per_run.values())]
    plot_px = _bar_px(runs) * len(runs) + _GAP_PX * (len(panels) - 1) + 20 * len(panels)
    fig = make_subplots(rows=len(panels), cols=1, row_heights=[len(p) for _, p in panels],
                        vertical_spacing=_GAP_PX / plot_px if len(panels) > 1 else 0,
                        subplot_titles=[t for t, _ in panels] if len(panels) > 1 else None)
    for row, (_, panel) in enumerate(panels, start=1):
        labels = [r.label for r in panel]
        for stage in stages:
            x = [per_run[lb].get(stage, 0) for lb in labels]
            fig.add_bar(name=stage, y=labels, x=x, orientation="h", marker_color=stage_color(stage),
                        legendgroup=stage, showlegend=row == 1, customdata=labels,
                        hovertemplate=f"%{{customdata}}<br>{stage}: %{{x:.3f}} {unit}<extra></extra>", row=row, col=1)
        fig.update_xaxes(title=unit, rangemode="tozero", row=row, col=1)
        fig.update_yaxes(autorange="reversed", **category_ticks(labels), row=row, col=1)
    height = plot_px + 130 + _LEGEND_ROW_PX * (len(stages) // 6 + 1)
    return legend_below(fig, title, height, barmode="stack")


def stage_time_figure(runs: list[Run]) -> go.Figure:
    """Median time per stage (ms), stacked, one horizontal bar per run; zero stages left out."""
    return _stacked_by_stage(runs, lambda r: {k: 1e3 * v for k, v in r.summary.get("stage_time_s", {}).items()},
                             "ms", "Step time by stage (median of measured steps)")


def stage_bytes_figure(runs: list[Run]) -> go.Figure:
    """Bytes per step by stage (MiB), stacked, one horizontal bar per run; zero stages left out."""
    return _stacked_by_stage(runs, lambda r: {k: v / MiB for k, v in r.summary.get("bytes_by_stage", {}).items()},
                             "MiB", "Bytes per step by stage (mean per measured step, all ranks)")


def level_bytes_figure(runs: list[Run]) -> go.Figure:
    """Bytes per step on each link level (MiB), grouped: one bar per run in each level."""
    fig = go.Figure()
    values = []
    for i, r in enumerate(runs):
        y = [r.summary.get("bytes_by_level", {}).get(lv, 0) for lv in LEVELS]
        values += [v / MiB for v in y]
        fig.add_bar(name=wrap(r.label), x=list(LEVELS), y=[v / MiB for v in y], marker_color=series_color(i),
                    customdata=[[r.label, format_bytes(v)] for v in y],
                    hovertemplate="%{customdata[0]}<br>%{x}: %{customdata[1]}<extra></extra>")
    fig.update_yaxes(value_axis("MiB per step", values))
    return legend_below(fig, "Bytes per step by link level (mean per measured step, all ranks)", 460, barmode="group")


def memory_figure(runs: list[Run]) -> go.Figure:
    """Peak memory of the fullest rank (MiB), one horizontal bar per run."""
    labels = [r.label for r in runs]
    y = [r.summary.get("peak_memory_bytes", 0) for r in runs]
    fig = go.Figure(go.Bar(y=labels, x=[v / MiB for v in y], orientation="h",
                           marker_color=[series_color(i) for i in range(len(runs))],
                           customdata=[[lb, format_bytes(v)] for lb, v in zip(labels, y)],
                           hovertemplate="%{customdata[0]}<br>%{customdata[1]}<extra></extra>"))
    fig.update_xaxes(value_axis("MiB", [v / MiB for v in y]))
    fig.update_yaxes(autorange="reversed", **category_ticks(labels))
    return legend_below(fig, "Peak memory (fullest rank, whole run)", 140 + _bar_px(runs) * len(runs),
                        showlegend=False)


def step_time_figure(runs: list[Run]) -> go.Figure:
    """Step time (ms) of every step from steps.jsonl, one line per run; warm-up shaded."""
    fig = go.Figure()
    values = []
    for i, r in enumerate(runs):
        y = [1e3 * s.step_time_s for s in r.steps]
        values += y
        fig.add_scatter(name=wrap(r.label), mode="lines+markers", x=[s.step for s in r.steps], y=y,
                        line_color=series_color(i), customdata=[r.label] * len(y),
                        hovertemplate="%{customdata}<br>step %{x}: %{y:.3f} ms<extra></extra>")
    warmups = {r.scenario.get("run", {}).get("warmup_steps") for r in runs}
    if len(warmups) == 1 and (w := warmups.pop()):
        fig.add_vrect(x0=-0.5, x1=w - 0.5, fillcolor="grey", opacity=0.15, line_width=0,
                      annotation_text="warm-up", annotation_position="top left")
    fig.update_xaxes(title="step")
    fig.update_yaxes(value_axis("ms", values))
    return legend_below(fig, "Step time over steps", 460)


# ---- page -----------------------------------------------------------------------------
_NOTE = ("This page compares {n} complete run(s) of the MoE testbed, read from their run folders. "
         "Times are the median of measured steps (warm-up steps left out); stage times are "
         "medians per stage, so their sum need not equal the median step time. Bytes are the "
         "mean per measured step, all ranks, on the wire of every collective and page copy. "
         "Peak memory is the largest over ranks and over the whole run.\n\n"
         "Units: times in milliseconds (ms) everywhere; bytes in binary units (1 KiB = 2^10 bytes, "
         "1 MiB = 2^20 bytes): tables pick KiB, MiB or GiB, figures are in MiB. An axis marked "
         "\"log scale\" is logarithmic because its values span more than 10x; where the runs' totals do, "
         "stacked figures get one panel per backend instead (and, within a backend, one per band of totals "
         "within 10x), each on a linear axis. Every stage has one colour in every figure; every run has one "
         "colour in the figures of runs. Hover over a bar or point for its numbers.\n\n"
         "{sources}")


def _count(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def sources_note(runs: list[Run]) -> str:
    """The machine profiles and routing sources of the runs, for the page note."""
    profiles: dict[str, int] = {}
    for r in runs:
        s = r.summary
        key = (f"{profile_name(s)} ({s.get('profile_source') or 'source unknown'}; calibrated on this machine: "
               f"{calibrated_here(s)})")
        profiles[key] = profiles.get(key, 0) + 1
    routing: dict[str, int] = {}
    for r in runs:
        routing[routing_source(r.summary)] = routing.get(routing_source(r.summary), 0) + 1
    return ("Machine profile: " + "; ".join(f"{k} in {_count(n)}" for k, n in profiles.items()) + ". "
            "Routing source: " + "; ".join(f"{k} in {_count(n)}" for k, n in routing.items()) + ".")


def write_comparison_report(run_dirs: list[str | Path], output: str | Path, title: str | None = None) -> Path:
    """Write the comparison page of the complete runs among ``run_dirs`` to ``output`` and
    return its path (see ``load_runs`` for what is skipped)."""
    runs = load_runs(run_dirs)
    title = title or f"Comparison of {len(runs)} run(s)"
    figures = [stage_time_figure(runs), level_bytes_figure(runs), stage_bytes_figure(runs),
               memory_figure(runs), step_time_figure(runs)]
    return write_page(output, title, _NOTE.format(n=len(runs), sources=sources_note(runs)),
                      [("Runs", _table(runs)), ("Machine profile and routing source of each run", _sources_table(runs)),
                       ("Figures", figures_html(figures))], findings=comparison_findings(runs))
