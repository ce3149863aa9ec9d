"""What capacity factor should I use, given my routing skew and aux-loss coefficient?

Capacity factor (M2) x aux-loss coefficient (M3) x routing skew (M4) -> step time, the
fraction of routed slots dropped, the loss after the run's steps, and peak memory. The
best factor of a (skew, aux-loss) setting is the one with the shortest step among those
that drop at most ``DROP_BUDGET`` of the routed slots (dropless, 0, when none does); it
is chosen separately on each backend. The claim it tests: C14 (a factor of 1.1-1.25
drops nothing once the aux loss is tuned).

    python experiments/sweep_capacity_factor.py --quick --json
"""

from __future__ import annotations

import sys

import plotly.graph_objects as go

from testbed.cli.experiment import PEAK_MEMORY_COLUMN, Experiment, both, experiment_base, experiment_main, figure
from testbed.report.html_page import legend_below, series_color
from testbed.study.decisions import DROP_BUDGET, best_capacity_factor, groups

CF, AUX, SKEW = "router.capacity_factor", "router.aux_loss_coef", "workload.skew"


def build(opts):
    quick = opts.quick
    base = opts.base(data=experiment_base({"run": {"steps": 8, "warmup_steps": 1}}))
    axes = {
        CF: [1.0, 1.25, 2.0, 0.0] if quick else [1.0, 1.1, 1.25, 1.5, 2.0, 0.0],
        AUX: [0.01] if quick else [0.001, 0.01, 0.1],
        SKEW: [0.0, 1.5] if quick else [0.0, 0.5, 1.0, 1.5],
    }
    return opts.sweep("sweep_capacity_factor", base, axes=axes, baseline={CF: 1.0, AUX: 0.01, SKEW: 0.0})



def best_factors(points: list[dict], backend: str, time_key: str) -> dict[str, float | None]:
    """Setting (skew, aux) -> the best capacity factor on ``backend`` (see module doc)."""
    by_setting = groups(points, lambda p: f"skew={p[SKEW]:g} aux={p[AUX]:g}")
    return {name: best_capacity_factor(sel, time_key, f"{backend}.dropped_token_fraction", DROP_BUDGET, CF)
            for name, sel in by_setting.items()}


def analyse(result) -> dict:
    pts = result.points()
    head = {"drop_budget": DROP_BUDGET,
            "best_capacity_factor_sim": best_factors(pts, "sim", "sim_step_s")}
    if any(p["measured_step_s"] is not None for p in pts):
        head["best_capacity_factor_measured"] = best_factors(pts, "real", "measured_step_s")
    # C14: drops at 1.1-1.25 (the claim's range), per backend
    for backend in ("sim", "real"):
        drops = [figure(p, backend, "dropped_token_fraction") for p in pts if 1.1 <= p[CF] <= 1.25]
        drops = [d for d in drops if d is not None]
        if drops:
            head[f"max_drop_at_1.1_to_1.25_{backend}"] = max(drops)
    return head


def figures(result, headline) -> list:
    pts = result.points()
    figs = []
    for key, title, scale in (("dropped_token_fraction", "Dropped slots vs capacity factor", 100),
                              ("loss_last", "Loss after the run vs capacity factor", 1),
                              ("step_time_s", "Step time vs capacity factor", 1e3)):
        fig = go.Figure()
        k = 0
        for backend, dash in (("sim", "solid"), ("real", "dot")):
            for skew in sorted({p[SKEW] for p in pts}):
                for aux in sorted({p[AUX] for p in pts}):
                    sel = sorted((p for p in pts if p[SKEW] == skew and p[AUX] == aux and p[CF] > 0
                                  and figure(p, backend, key) is not None), key=lambda p: p[CF])
                    if not sel:
                        continue
                    fig.add_trace(go.Scatter(x=[p[CF] for p in sel], y=[figure(p, backend, key) * scale for p in sel],
                                             mode="lines+markers", line={"dash": dash, "color": series_color(k)},
                                             name=f"{'simulated' if backend == 'sim' else 'measured'} skew {skew:g} "
                                                  f"aux {aux:g}"))
                    k += 1
        unit = {"dropped_token_fraction": "dropped slots, %", "loss_last": "loss (last step)",
                "step_time_s": "step time, ms"}[key]
        fig.update_xaxes(title="capacity factor (M2)")
        fig.update_yaxes(title=unit, rangemode="tozero")
        figs.append(legend_below(fig, title, 460, "solid: simulated, dotted: measured"))
    return figs


EXPERIMENT = Experiment(
    name="sweep_capacity_factor", question=__doc__.split("\n")[0], build=build, analyse=analyse, figures=figures,
    note=f"The best factor of a setting: the shortest step among factors that drop at most {100 * DROP_BUDGET:g}% "
         "of routed slots. Capacity factor 0 is dropless. Loss is the task loss of the last step.",
    columns=[("dropped sim / real", lambda p: both(p, "dropped_token_fraction", lambda v: f"{100 * v:.2f}%")),
             ("loss last sim / real", lambda p: both(p, "loss_last", lambda v: f"{v:.4f}")),
             PEAK_MEMORY_COLUMN])

if __name__ == "__main__":
    sys.exit(experiment_main(EXPERIMENT))
