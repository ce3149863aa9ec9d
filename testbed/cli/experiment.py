"""What every ``experiments/*.py`` script shares: its command line, the measured side, the
calibrated profile, and what it prints and writes.

An experiment declares a sweep (``build``), what its headline is (``analyse``: the
optimum, the best choice per setting) and its own figures; ``experiment_main`` does the
rest. The measured side (``--fabric``):

- ``emulated``: real CPU ranks on the emulated cluster (``real.network = emulated``;
  root), the default where this process may emulate;
- ``loopback``: real CPU ranks over this machine's loopback (no topology);
- on a machine with enough GPUs the real backend runs on them (``real.device = auto``).

The simulated side replays each real run's routing with a profile calibrated in a
separate run (``--profile``; default ``emulated-local`` or ``local``). Where that profile
does not exist yet, it is made first by ``testbed calibrate --quick`` (a few minutes, once;
its shapes are none of the experiments'), unless ``--no-calibrate`` is given.

Every experiment prints, per point, ``sim_speedup``, ``measured_speedup`` and the
measured spread (``--json``: one JSON object), and writes a report
(``reports/<name>.html``) with the tidy table of every run beside it (``<name>.csv``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from testbed.core.errors import ScenarioError, run_as_command
from testbed.report.sweep import write_sweep_report
from testbed.run.backend import BACKENDS, get_tool
from testbed.scenario.profile import find_profile
from testbed.study.experiments import ROOT, Options
from testbed.study.sweep import Sweep, SweepResult, run_sweep, write_table

FABRICS = ("auto", "emulated", "loopback")
#: the per-point figures printed and put into --json (beside the axes)
POINT_FIELDS = ("label", "baseline", "sim_step_s", "measured_step_s", "sim_speedup", "measured_speedup",
                "measured_spread", "measured_speedup_range")


@dataclass
class Experiment:
    name: str  # the script's name: reports/<name>.html
    question: str  # one line: what the experiment answers
    build: Callable[[Options], Sweep]
    analyse: Callable[[SweepResult], dict]  # headline figures (JSON-able)
    figures: Callable[[SweepResult, dict], list] = lambda result, headline: []
    note: str = ""  # how the numbers were made, for the report
    columns: list = field(default_factory=list)  # extra (header, point -> cell) columns of the report


def parser(exp: Experiment) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=exp.name, description=exp.question)
    p.add_argument("--quick", action="store_true", help="a small grid: a few minutes on a laptop")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--backends", default="sim,real", help="comma-separated: sim, real (default both)")
    p.add_argument("--fabric", default="auto", choices=FABRICS,
                   help="measured side: emulated cluster (root), loopback, or auto (emulated where possible)")
    p.add_argument("--profile", default=None, help="calibrated profile of both sides (default emulated-local, "
                   "loopback: local; sim alone: the scenario's own)")
    p.add_argument("--no-calibrate", action="store_true", help="refuse instead of calibrating a missing profile")
    p.add_argument("--repeats", type=int, default=2, help="real runs per point (default 2)")
    p.add_argument("--jobs", type=int, default=None, help="parallel simulator processes (default: every core)")
    p.add_argument("--executor", default="local", help="simulated points: local (joblib) or dask[=ADDRESS] "
                   "(a dask.distributed scheduler; without an address a local one)")
    p.add_argument("--output-dir", default=None, help="the run store (default: the scenario's run.output_dir, runs)")
    p.add_argument("--report", "--output", dest="report", default=None, metavar="FILE.html",
                   help=f"report path (default reports/{exp.name}.html); the CSV table goes beside it")
    p.add_argument("--fresh", action="store_true", help="run every point again, ignoring the sweep's index")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field of the base scenario (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def experiment_main(exp: Experiment, argv: list[str] | None = None) -> int:
    args = parser(exp).parse_args(argv)
    return run_as_command(exp.name, lambda: _run(exp, args), "stopped; rerun to resume (finished runs are kept)")


def resolve_options(args) -> Options:
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    for b in backends or ("",):
        if b not in BACKENDS:
            raise ScenarioError("--backends", b, "expected one of " + ", ".join(BACKENDS))
    fabric = args.fabric
    if "real" in backends and fabric in ("auto", "emulated"):
        try:
            get_tool("net-check")()
            fabric = "emulated"
        except ScenarioError as e:
            if fabric == "emulated":
                raise
            print(f"note: measuring over loopback, not an emulated cluster ({e})", file=sys.stderr)
            fabric = "loopback"
    elif fabric == "auto":
        fabric = "loopback"
    profile = args.profile
    if profile is None and "real" in backends:
        profile = "emulated-local" if fabric == "emulated" else "local"
    if profile is not None and "real" in backends:
        ensure_profile(profile, fabric, calibrate=not args.no_calibrate)
    return Options(quick=args.quick, backends=backends, fabric=fabric, profile=profile, repeats=args.repeats,
                   output_dir=args.output_dir, overrides=list(args.overrides))


def ensure_profile(name: str, fabric: str, calibrate: bool) -> None:
    """The calibrated profile ``name``, made now by a quick calibration of its own if it is
    missing (never from the experiment's points)."""
    try:
        find_profile(name)
        return
    except ScenarioError:
        if not calibrate:
            raise ScenarioError("--profile", name, f"no such profile: run `testbed calibrate --fabric {fabric} "
                                f"--name {name}` first") from None
    print(f"note: no profile {name!r}: calibrating it first (testbed calibrate --quick --fabric {fabric}, "
          "a few minutes, once)", file=sys.stderr, flush=True)
    get_tool("calibrate")(name, quick=True, fabric=fabric, log=lambda *a: print(*a, file=sys.stderr, flush=True))


def _executor(spec: str) -> tuple[str, str | None]:
    kind, _, address = spec.partition("=")
    return kind, (address or None)


def writable_report(path: str | Path) -> Path:
    """``path``, once its folder exists and takes files (checked before any run, so a sweep
    never finishes to find it cannot write its report)."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}."):
            pass
    except OSError as e:
        raise ScenarioError("--report", str(path), f"cannot write there ({e.strerror or e})") from None
    return out


def _run(exp: Experiment, args) -> int:
    report = writable_report(args.report or ROOT / "reports" / f"{exp.name}.html")
    opts = resolve_options(args)
    sweep = exp.build(opts)
    kind, address = _executor(args.executor)
    result = run_sweep(sweep, jobs=args.jobs, executor=kind, address=address, fresh=args.fresh,
                       progress=not args.no_progress)
    headline = exp.analyse(result)
    table = write_table(result.rows(), report.with_suffix(".csv"))
    note = (f"{exp.note}\n\nMeasured side: "
            + (f"real CPU ranks on the {opts.fabric} fabric, {opts.repeats} runs a point; the simulator replays "
               f"each point's first real run's routing" if "real" in opts.backends else "none (simulator only)")
            + (f", profile {opts.profile} (calibrated in a separate run)" if opts.profile else "")
            + ". Speedup: baseline step time / point step time.")
    write_sweep_report(result, report, exp.question, note, headline, exp.figures(result, headline), exp.columns,
                       table)
    points = [{k: p[k] for k in list(sweep.keys) + list(POINT_FIELDS) if k in p} for p in result.points()]
    out = {"experiment": exp.name, "question": exp.question, "backends": list(opts.backends), "fabric": opts.fabric,
           "profile": opts.profile, "repeats": opts.repeats, "points": points, "headline": headline,
           "skipped": [{"point": p, "reason": r} for p, r in result.skipped], "ran": result.ran,
           "wall_s": result.wall_s, "report": str(report), "table": str(table)}
    if args.json:
        print(json.dumps(out, default=str))
    else:
        for p in points:
            print(f"{p['label']:48s} sim {_fmt(p['sim_speedup'])}  measured {_fmt(p['measured_speedup'])} "
                  f"(spread {_fmt(p['measured_spread'], '%')})")
        for k, v in headline.items():
            print(f"{k}: {v}")
        print(f"wrote {report} and {table}")
    return 0


def _fmt(x, kind: str = "x") -> str:
    if x is None:
        return "—"
    return f"{100 * x:.1f}%" if kind == "%" else f"x{x:.3f}"


#: the experiments' default base: 4 CPU ranks as 2 nodes of 2 in one micro-cluster (EP 2
#: inside a node, 2 replicas of each expert across the nodes, so tokens cross "NVLink" and
#: expert sync crosses the leaf), a model small enough that a 6-step run on the emulated
#: cluster takes about 5 s on a 2-core machine, with paging under a budget of 3/4 of a
#: rank's experts and heat updates every 2 steps. Each experiment changes what it sweeps.
EXPERIMENT_BASE = {
    "model": {"hidden_size": 128, "ffn_hidden_size": 128, "num_layers": 2, "num_experts": 8, "top_k": 2},
    "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
    "parallelism": {"ep_size": 2},
    "pager": {"page_size_bytes": "16KiB", "gpu_budget_bytes": "192KiB"},
    "heat": {"window_steps": 4, "update_interval": 2},
    "workload": {"tokens_per_rank": 256},
    "run": {"steps": 6, "warmup_steps": 1},
}


def experiment_base(changes: dict | None = None) -> dict:
    """``EXPERIMENT_BASE`` with some sections' fields changed (a new mapping)."""
    out = {k: dict(v) for k, v in EXPERIMENT_BASE.items()}
    for section, fields in (changes or {}).items():
        out.setdefault(section, {}).update(fields)
    return out


def figure(point: dict, backend: str, key: str):
    """A summary figure of a point (``SweepResult.points()``) on ``backend`` (its mean over
    the point's runs), or None where the backend did not run it."""
    return (point.get(backend) or {}).get(key)


def both(point: dict, key: str, fmt: Callable[[float], str]) -> str:
    """``simulated / measured`` of one figure, each formatted by ``fmt`` (— where missing)."""
    return " / ".join("—" if (v := figure(point, b, key)) is None else fmt(v) for b in ("sim", "real"))


def bytes_by_level_figure(result, title: str):
    """A stacked bar chart of the simulated bytes per link level (MiB per step, all ranks)
    of every point of a sweep: the planner's payload for the routing each point ran."""
    import plotly.graph_objects as go

    from testbed.report.html_page import LEVEL_COLORS, category_ticks, legend_below
    from testbed.scenario.topology import LEVELS

    pts = result.points()
    labels = [p["label"] for p in pts]
    fig = go.Figure()
    for lv in LEVELS[:3]:
        fig.add_trace(go.Bar(x=labels, y=[(figure(p, "sim", "bytes_by_level") or {}).get(lv, 0) / 2**20 for p in pts],
                             name=lv, marker_color=LEVEL_COLORS[lv]))
    fig.update_xaxes(category_ticks(labels))
    fig.update_yaxes(title="MiB per step (planner payload, all ranks)")
    return legend_below(fig, title, 480, barmode="stack")


#: the report column of peak memory per GPU (MiB), simulated / measured
PEAK_MEMORY_COLUMN = ("peak memory sim / real (the measured peak leaves out comm buffers and communicators)",
                      lambda p: both(p, "peak_memory_bytes", lambda v: f"{v / 2**20:.2f} MiB"))
