"""Which page size is best for expert paging under a device-memory budget?

Page size (M12) x device page budget on ``configs/paging-pressure.toml`` (a budget below
what each rank's experts need, so pages move every step) -> step time, page stall, page
copies and peak memory, with the page size of the shortest step marked per budget, on
each backend. The claim it tests: C8 (16 MB is the best page size; 8 MB has too much
page-table overhead, 32 MB loads too slowly) — at this scenario's scale the experts are
KiB, not GB, so the question is whether an interior optimum exists and what sets it.

    python experiments/sweep_page_size.py --quick --json
"""

from __future__ import annotations

import sys

import plotly.graph_objects as go

from testbed.cli.experiment import PEAK_MEMORY_COLUMN, ROOT, Experiment, both, experiment_main, figure
from testbed.core.units import parse_bytes
from testbed.report.html_page import legend_below, series_color
from testbed.study.decisions import best_per_group

PAGE, BUDGET = "pager.page_size_bytes", "pager.gpu_budget_bytes"
CONFIG = ROOT / "configs" / "paging-pressure.toml"


def build(opts):
    base = opts.base(CONFIG)
    axes = {PAGE: ["8KiB", "32KiB", "64KiB", "256KiB"] if opts.quick else
            ["4KiB", "8KiB", "16KiB", "32KiB", "64KiB", "128KiB", "256KiB"],
            BUDGET: ["2000KiB"] if opts.quick else ["1600KiB", "2000KiB", "2400KiB"]}
    return opts.sweep("sweep_page_size", base, axes=axes, baseline={PAGE: "64KiB", BUDGET: "2000KiB"})



def optimum(points: list[dict], time_key: str) -> dict[str, str | None]:
    """Budget -> the page size with the shortest step."""
    return {str(budget): None if best is None else best[PAGE]
            for budget, best in best_per_group(points, BUDGET, time_key).items()}


def analyse(result) -> dict:
    pts = result.points()
    head = {"best_page_size_sim": optimum(pts, "sim_step_s")}
    if any(p["measured_step_s"] is not None for p in pts):
        head["best_page_size_measured"] = optimum(pts, "measured_step_s")
    return head


def figures(result, headline) -> list:
    pts = result.points()
    figs = []
    for key, title, unit, scale in (("step_time_s", "Step time vs page size", "step time, ms", 1e3),
                                    ("page_stall_s", "Page stall vs page size", "page stall, ms", 1e3),
                                    ("page_moves_per_step", "Page moves per step vs page size", "page moves", 1),
                                    ("peak_memory_bytes", "Peak memory vs page size", "peak memory, MiB", 2**-20)):
        fig = go.Figure()
        k = 0
        for backend, dash, best in (("sim", "solid", headline.get("best_page_size_sim", {})),
                                    ("real", "dot", headline.get("best_page_size_measured", {}))):
            for budget in dict.fromkeys(p[BUDGET] for p in pts):
                sel = sorted((p for p in pts if p[BUDGET] == budget and figure(p, backend, key) is not None),
                             key=lambda p: parse_bytes(p[PAGE]))
                if not sel:
                    continue
                xs = [parse_bytes(p[PAGE]) / 1024 for p in sel]
                fig.add_trace(go.Scatter(x=xs, y=[figure(p, backend, key) * scale for p in sel], mode="lines+markers",
                                         line={"dash": dash, "color": series_color(k)},
                                         name=f"{'simulated' if backend == 'sim' else 'measured'}, budget {budget}"))
                opt = [p for p in sel if p[PAGE] == best.get(str(budget))]
                if key == "step_time_s" and opt:
                    fig.add_trace(go.Scatter(x=[parse_bytes(opt[0][PAGE]) / 1024],
                                             y=[figure(opt[0], backend, key) * scale],
                                             mode="markers", marker={"symbol": "star", "size": 16,
                                                                     "color": series_color(k)},
                                             name=f"optimum ({'simulated' if backend == 'sim' else 'measured'}, "
                                                  f"budget {budget})"))
                k += 1
        sizes = sorted({parse_bytes(p[PAGE]) / 1024 for p in pts})
        fig.update_xaxes(title="page size, KiB (log scale)", type="log", tickvals=sizes,
                         ticktext=[f"{x:g}" for x in sizes])
        fig.update_yaxes(title=unit, rangemode="tozero")
        figs.append(legend_below(fig, title, 460, "solid: simulated, dotted: measured; star: shortest step"))
    return figs


EXPERIMENT = Experiment(
    name="sweep_page_size", question=__doc__.split("\n")[0], build=build, analyse=analyse, figures=figures,
    note="Optimum: the page size with the shortest median step per budget, on each backend. Page moves: pages "
         "loaded, written back or dropped per step over all ranks. Peak memory: the largest over ranks.",
    columns=[("page moves sim / real", lambda p: both(p, "page_moves_per_step", lambda v: f"{v:.0f}")),
             ("stall sim / real", lambda p: both(p, "page_stall_s", lambda v: f"{1e3 * v:.2f} ms")),
             PEAK_MEMORY_COLUMN])

if __name__ == "__main__":
    sys.exit(experiment_main(EXPERIMENT))
