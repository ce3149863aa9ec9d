"""Which heat weights (compute, memory, communication) and update interval should the heat map use?

Heat weights alpha, beta, gamma (M19) on a simplex grid x heat update interval (M18) on
``configs/heat-drift.toml`` (skewed, drifting popularity; heat updated often enough that
cold migration (M13), freezing (M19), wake-up (M20) and prefetch (M14) all fire within
the run) -> step time, peak memory, page stall, the largest share of frozen experts, and
counts of cold migrations, wake-ups and prefetched pages. Best weights: the shortest
step, per interval, on each backend. The claim it tests: C10 (updating heat every step
costs 12%, every 10 steps 0.3%).

    python experiments/sweep_heat_weights.py --quick --json
"""

from __future__ import annotations

import itertools
import sys

import plotly.graph_objects as go

from testbed.cli.experiment import PEAK_MEMORY_COLUMN, ROOT, Experiment, both, experiment_main, figure
from testbed.report.html_page import category_ticks, legend_below, series_color
from testbed.study.decisions import best_per_group

A, B, G, INTERVAL = "heat.alpha", "heat.beta", "heat.gamma", "heat.update_interval"
CONFIG = ROOT / "configs" / "heat-drift.toml"
SEED_WEIGHTS = (0.5, 0.3, 0.2)  # the seed's default (M19)
EVENTS = ("cold", "wake", "prefetch")


def simplex(step: float) -> list[tuple[float, float, float]]:
    """Every (alpha, beta, gamma) >= 0 summing to 1 on a grid of ``step``."""
    n = round(1 / step)
    return [(i / n, j / n, (n - i - j) / n) for i, j in itertools.product(range(n + 1), repeat=2) if i + j <= n]


def build(opts):
    base = opts.base(CONFIG)
    if opts.quick:
        weights = [SEED_WEIGHTS, (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)]
        intervals = [1, 2]
    else:
        weights = [SEED_WEIGHTS] + [w for w in simplex(0.25) if w != SEED_WEIGHTS]
        intervals = [1, 2, 5]
    points = [{A: a, B: b, G: g, INTERVAL: k} for k in intervals for a, b, g in weights]
    return opts.sweep("sweep_heat_weights", base, points=points,
                      baseline={A: SEED_WEIGHTS[0], B: SEED_WEIGHTS[1], G: SEED_WEIGHTS[2], INTERVAL: intervals[0]})



def events(p: dict, backend: str) -> dict[str, int]:
    moves = figure(p, backend, "moves_by_reason") or {}
    return {e: int(moves.get(e, 0)) for e in EVENTS}


def analyse(result) -> dict:
    pts = result.points()
    head = {}
    for backend, key in (("sim", "sim_step_s"), ("real", "measured_step_s")):
        sel = [p for p in pts if p[key] is not None]
        if not sel:
            continue
        head[f"best_weights_{backend}"] = {f"interval={k}": [q[A], q[B], q[G]]
                                           for k, q in best_per_group(sel, INTERVAL, key).items()}
        fired = {e: sum(events(p, backend)[e] for p in sel) for e in EVENTS}
        fired["frozen_share_max"] = max(figure(p, backend, "max_frozen_fraction") or 0 for p in sel)
        fired["heat_updates_min"] = min(figure(p, backend, "heat_updates") or 0 for p in sel)
        head[f"events_{backend}"] = fired
    return head


def figures(result, headline) -> list:
    pts = result.points()
    labels = [p["label"] for p in pts]
    figs = []
    for backend, name in (("sim", "simulated"), ("real", "measured")):
        if not any(p.get(backend) for p in pts):
            continue
        fig = go.Figure()
        for i, e in enumerate(EVENTS):
            fig.add_trace(go.Bar(x=labels, y=[events(p, backend)[e] for p in pts], name=e,
                                 marker_color=series_color(i)))
        fig.update_xaxes(category_ticks(labels))
        fig.update_yaxes(title="page-move rows over the run (all ranks)")
        figs.append(legend_below(fig, f"Heat events per point, {name}", 480, barmode="group"))
    return figs


EXPERIMENT = Experiment(
    name="sweep_heat_weights", question=__doc__.split("\n")[0], build=build, analyse=analyse, figures=figures,
    note="Events are page-move rows over the whole run, all ranks: cold (M13 migration to host), wake (M20 "
         "wake-up loads), prefetch (M14 first pages of a frozen expert that gets tokens again). Frozen share: the "
         "largest fraction of experts in the Cold state after any heat update.",
    columns=[("cold / wake / prefetch (sim)", lambda p: "{cold} / {wake} / {prefetch}".format(**events(p, "sim"))),
             ("cold / wake / prefetch (real)", lambda p: "{cold} / {wake} / {prefetch}".format(**events(p, "real"))),
             PEAK_MEMORY_COLUMN,
             ("stall sim / real", lambda p: both(p, "page_stall_s", lambda v: f"{1e3 * v:.2f} ms")),
             ("frozen max sim / real", lambda p: both(p, "max_frozen_fraction", lambda v: f"{100 * v:.0f}%")),
             ("heat stage sim / real", lambda p: both(p, "stage_time_s", lambda v: f"{1e3 * v.get('heat', 0):.2f} ms"))])

if __name__ == "__main__":
    sys.exit(experiment_main(EXPERIMENT))
