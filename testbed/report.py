"""One self-contained HTML page that compares run folders (``testbed.runs``).

The page embeds plotly.js once, inline, so it works offline. Every number on it is
read from the run folders given: ``summary.json`` (medians and means over the measured
steps, see ``testbed.results.summarize``), ``steps.jsonl`` (step time per step) and
``scenario.toml`` (the labels). Units: times are shown in milliseconds (stored in
seconds), traffic and memory in bytes (per step, summed over all ranks; memory is the
peak of the fullest rank).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go
import tomllib

from testbed.errors import ScenarioError
from testbed.html_page import figures_html, write_page
from testbed.results import StepRecord
from testbed.stages import STAGES
from testbed.topology import LEVELS
from testbed.units import format_bytes

#: scenario fields never used in labels (where results go, free text)
_LABEL_IGNORE = {"run.output_dir", "notes"}
_SEP = " · "


@dataclass
class Run:
    """One run folder as the report reads it."""

    dir: Path
    scenario: dict
    summary: dict
    steps: list[StepRecord]
    label: str = ""

    @property
    def complete(self) -> bool:
        return bool(self.summary.get("complete", True))


def load_report_run(run_dir: str | Path) -> Run:
    """Read a run folder; raise ``ScenarioError("RUN_DIR", ...)`` when it is not one."""
    d = Path(run_dir)
    if not (d / "summary.json").is_file():
        raise ScenarioError("RUN_DIR", str(run_dir), "not a run folder (no summary.json)")
    try:
        summary = json.loads((d / "summary.json").read_text())
        scenario = tomllib.loads((d / "scenario.toml").read_text()) if (d / "scenario.toml").is_file() else {}
        lines = (d / "steps.jsonl").read_text().splitlines() if (d / "steps.jsonl").is_file() else []
        steps = [StepRecord.from_dict(json.loads(line)) for line in lines if line.strip()]
    except (ValueError, TypeError, OSError) as e:
        raise ScenarioError("RUN_DIR", str(run_dir), f"unreadable run folder: {e}") from None
    return Run(d, scenario, summary, steps)


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _show(name: str, value) -> str:
    """A string value speaks for itself ("alltoall"); others carry their key."""
    if isinstance(value, str) and value:
        return value
    text = json.dumps(value) if value is not None else "unset"
    return f"{name.rsplit('.', 1)[-1]}={text}"


def run_label(scenario_dicts: list[dict], backends: list[str] | None = None) -> list[str]:
    """Short labels: the backend, then the scenario fields whose values differ between runs.

    Fields in file order; ``run.output_dir`` and ``notes`` left out. Equal labels get
    " #1", " #2", ... so that every run keeps its own bar.
    """
    flat = [_flatten(d) for d in scenario_dicts]
    keys: list[str] = []
    for f in flat:
        keys += [k for k in f if k not in keys and k not in _LABEL_IGNORE]
    missing = object()
    differing = [k for k in keys if len({json.dumps(f.get(k, missing), default=repr) for f in flat}) > 1]
    labels = []
    for i, f in enumerate(flat):
        parts = [backends[i]] if backends else []
        parts += [_show(k, f.get(k)) for k in differing]
        labels.append(_SEP.join(parts) or "run")
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(f"{label} #{seen[label]}" if labels.count(label) > 1 else label)
    return out


def load_runs(run_dirs: list[str | Path]) -> list[Run]:
    """Read every run folder and give each its label ("(incomplete)" for stopped runs)."""
    if not run_dirs:
        raise ScenarioError("RUN_DIR", "", "give at least one run folder")
    runs = [load_report_run(d) for d in run_dirs]
    labels = run_label([r.scenario for r in runs], [str(r.summary.get("backend", "?")) for r in runs])
    for run, label in zip(runs, labels):
        run.label = label if run.complete else f"{label} (incomplete)"
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


def _table(runs: list[Run]) -> str:
    head = ["run", "folder", "measured steps", "step time (median)", "peak memory",
            "dropped tokens", "page moves / step", "group-cache hits", "loss first → last"]
    rows = []
    for r in runs:
        s = r.summary
        cells = [r.label, str(r.dir), str(s.get("measured_steps", len(r.steps))), _ms(s.get("step_time_s")),
                 format_bytes(s.get("peak_memory_bytes", 0)), _pct(s.get("dropped_token_fraction")),
                 f"{s.get('page_moves_per_step', 0.0):.1f}", _pct(s.get("group_cache_hit_rate")), _loss(s)]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    return f"<table>\n{header}\n" + "\n".join(rows) + "\n</table>"


# ---- figures --------------------------------------------------------------------------
def _layout(fig: go.Figure, title: str, height: int, **kw) -> go.Figure:
    fig.update_layout(title=title, height=height, margin=dict(l=20, r=20, t=50, b=40), **kw)
    fig.update_xaxes(automargin=True)  # room for long run labels
    return fig


def stage_time_figure(runs: list[Run]) -> go.Figure:
    """Median time per stage (ms), stacked, one horizontal bar per run; zero stages left out."""
    labels = [r.label for r in runs]
    fig = go.Figure()
    for stage in STAGES:
        x = [1e3 * r.summary.get("stage_time_s", {}).get(stage, 0.0) for r in runs]
        if any(x):
            fig.add_bar(name=stage, y=labels, x=x, orientation="h")
    return _layout(fig, "Step time by stage (median of measured steps)", 120 + 40 * len(runs),
                   barmode="stack", xaxis_title="ms", yaxis=dict(autorange="reversed", automargin=True))


def level_bytes_figure(runs: list[Run]) -> go.Figure:
    """Bytes per step on each link level, grouped: one bar per run in each level."""
    fig = go.Figure()
    for r in runs:
        y = [r.summary.get("bytes_by_level", {}).get(lv, 0) for lv in LEVELS]
        fig.add_bar(name=r.label, x=list(LEVELS), y=y, hovertext=[format_bytes(v) for v in y])
    return _layout(fig, "Bytes per step by link level (mean per measured step, all ranks)", 420,
                   barmode="group", yaxis=dict(title="bytes", tickformat=".3s"))


def stage_bytes_figure(runs: list[Run]) -> go.Figure:
    """Bytes per step by stage, stacked, one bar per run; zero stages left out."""
    labels = [r.label for r in runs]
    fig = go.Figure()
    for stage in STAGES:
        y = [r.summary.get("bytes_by_stage", {}).get(stage, 0) for r in runs]
        if any(y):
            fig.add_bar(name=stage, x=labels, y=y, hovertext=[format_bytes(v) for v in y])
    return _layout(fig, "Bytes per step by stage (mean per measured step, all ranks)", 460,
                   barmode="stack", yaxis=dict(title="bytes", tickformat=".3s"))


def memory_figure(runs: list[Run]) -> go.Figure:
    """Peak memory of the fullest rank, bytes, one bar per run."""
    y = [r.summary.get("peak_memory_bytes", 0) for r in runs]
    fig = go.Figure(go.Bar(x=[r.label for r in runs], y=y, hovertext=[format_bytes(v) for v in y]))
    return _layout(fig, "Peak memory (fullest rank, whole run)", 420, yaxis=dict(title="bytes", tickformat=".3s"))


def step_time_figure(runs: list[Run]) -> go.Figure:
    """Step time (ms) of every step from steps.jsonl, one line per run; warm-up shaded."""
    fig = go.Figure()
    for r in runs:
        fig.add_scatter(name=r.label, mode="lines+markers", x=[s.step for s in r.steps],
                        y=[1e3 * s.step_time_s for s in r.steps])
    warmups = {r.scenario.get("run", {}).get("warmup_steps") for r in runs}
    if len(warmups) == 1 and (w := warmups.pop()):
        fig.add_vrect(x0=-0.5, x1=w - 0.5, fillcolor="grey", opacity=0.15, line_width=0,
                      annotation_text="warm-up", annotation_position="top left")
    return _layout(fig, "Step time over steps", 420, xaxis_title="step", yaxis_title="ms")


# ---- page -----------------------------------------------------------------------------
_NOTE = ("This page compares {n} run(s) of the MoE testbed, read from their run folders. "
         "Times are the median of measured steps (warm-up steps left out); stage times are "
         "medians per stage, so their sum need not equal the median step time. Bytes are the "
         "mean per measured step, all ranks, on the wire of every collective and page copy. "
         "Peak memory is the largest over ranks and over the whole run.")


def write_comparison_report(run_dirs: list[str | Path], output: str | Path, title: str | None = None) -> Path:
    """Write the comparison page of ``run_dirs`` to ``output`` and return its path."""
    runs = load_runs(run_dirs)
    title = title or f"Comparison of {len(runs)} run(s)"
    figures = [stage_time_figure(runs), level_bytes_figure(runs), stage_bytes_figure(runs),
               memory_figure(runs), step_time_figure(runs)]
    return write_page(output, title, _NOTE.format(n=len(runs)),
                      [("Runs", _table(runs)), ("Figures", figures_html(figures))])
