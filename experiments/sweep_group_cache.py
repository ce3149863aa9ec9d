"""How large must the expert group cache be for two-stage sync to pay?

Group cache size (M10: active groups A_e kept as communicators, least recently used
evicted) with two-stage expert sync (M9) on 8 ranks, 4 replicas of each expert -> hit
rate, seconds spent creating communicators, step time and memory. The claim it tests: C5
(a hit rate of 99.2%).

    python experiments/sweep_group_cache.py --quick --json
"""

from __future__ import annotations

import sys

import plotly.graph_objects as go

from testbed.cli.experiment import PEAK_MEMORY_COLUMN, Experiment, both, experiment_base, experiment_main, figure
from testbed.report.html_page import legend_below, series_color

SIZE = "comm.group_cache_size"


def build(opts):
    base = opts.base(data=experiment_base({
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 2},
        "comm": {"expert_sync": "two_stage"}, "run": {"steps": 8, "warmup_steps": 1}}))
    axes = {SIZE: [1, 4, 64] if opts.quick else [1, 2, 4, 8, 16, 32, 64, 100]}
    return opts.sweep("sweep_group_cache", base, axes=axes, baseline={SIZE: axes[SIZE][-1]})



def analyse(result) -> dict:
    pts = result.points()
    head = {}
    for backend in ("sim", "real"):
        rates = {p[SIZE]: rate for p in pts if (rate := figure(p, backend, "group_cache_hit_rate")) is not None}
        if rates:
            head[f"hit_rate_{backend}"] = rates
            best = max(rates.values())
            head[f"smallest_size_within_1pp_of_best_{backend}"] = min(k for k, v in rates.items() if v >= best - 0.01)
    return head


def figures(result, headline) -> list:
    pts = sorted(result.points(), key=lambda p: p[SIZE])
    fig = go.Figure()
    for i, (backend, name) in enumerate((("sim", "simulated"), ("real", "measured"))):
        sel = [p for p in pts if figure(p, backend, "group_cache_hit_rate") is not None]
        if sel:
            fig.add_trace(go.Scatter(x=[p[SIZE] for p in sel],
                                     y=[100 * figure(p, backend, "group_cache_hit_rate") for p in sel],
                                     mode="lines+markers", name=name, marker_color=series_color(i)))
    sizes = [p[SIZE] for p in pts]
    fig.update_xaxes(title="group cache size, groups (log scale)", type="log", tickvals=sizes,
                     ticktext=[str(x) for x in sizes])
    fig.update_yaxes(title="hit rate, % of lookups", range=[0, 101])
    return [legend_below(fig, "Group cache hit rate vs size", 440)]


EXPERIMENT = Experiment(
    name="sweep_group_cache", question=__doc__.split("\n")[0], build=build, analyse=analyse, figures=figures,
    note="Hit rate: cache hits / lookups over the measured steps. Creation: seconds the real ranks spent in "
         "new_group for cached groups over the whole run (gloo; NCCL's communicators cost far more).",
    columns=[("hit rate sim / real", lambda p: both(p, "group_cache_hit_rate", lambda v: f"{100 * v:.1f}%")),
             ("creation (real)", lambda p: f"{1e3 * (figure(p, 'real', 'group_create_s') or 0):.1f} ms"),
             PEAK_MEMORY_COLUMN])

if __name__ == "__main__":
    sys.exit(experiment_main(EXPERIMENT))
