"""``testbed regress``: the tuning choices, regression-tested on the simulator.

A suite of small simulator sweeps (``SUITE``) is run with the sweep engine, each into a
fresh run store (a temporary folder unless ``--output-dir``), and each sweep's
**decisions** (the best capacity factor per skew, the best page size, the best heat
weights, the ranking of the token x sync strategies, the ranking of placements per EP
size) and key **metrics** (the best point's step time, dropped slots, peak memory,
bytes, page moves, ...; every capacity factor's dropped slots and every heat weights'
page moves) are compared with the golden file ``testbed/study/golden/regress.json``. The
simulator with synthetic routing (M4) and built-in profiles is deterministic, so the
same code gives the same numbers on every machine: a change is a change of the model or
of a policy, and simulated figures are compared to 1e-9.

Each decision is recorded with its margin (the best's lead over the runner-up in step
time) and its ties: candidates within ``testbed.study.decisions.TIE_WITHIN`` (1%) of a better
one are tied, so a best that wins by less is recorded as a tie of the named candidates
and holds whichever of them is best; a decision with one candidate (one capacity factor
within the drop budget) is recorded as carrying no information. Every metric carries its
tolerance and a one-line reason for it (``testbed.study.golden``: the file;
``testbed.study.golden_compare``: comparing, the table and the diff).

- every entry within its tolerance: a short table (each decision with its margin, tie or
  "no information"), exit 0;
- a decision that does not hold, a metric outside its tolerance, an entry only on one
  side, or a sweep defined differently from the golden one: a table of what moved
  (name, golden, now, change, tolerance), exit 1;
- ``--update`` (``testbed regress --update``, the one command that regenerates the golden
  file): write the golden file from this run and print what changed (old -> new);
- a missing or unreadable golden file: one line naming it, exit 2.

The decision rules are those of ``testbed.study.decisions``; this module holds the suite.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.core.errors import ScenarioError
from testbed.run.store import scenario_hash
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario
from testbed.study import decisions as D
from testbed.study.golden import BYTES, COUNT, FRACTION, MEMORY, RATIO, TIME, Entry, Tol, load_golden
from testbed.study.golden_compare import check, update
from testbed.study.sweep import Sweep, point_label, run_sweep, with_keys

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden" / "regress.json"

CF, SKEW = "router.capacity_factor", "workload.skew"
PAGE = "pager.page_size_bytes"
ALPHA, BETA, GAMMA = "heat.alpha", "heat.beta", "heat.gamma"
TOKEN, SYNC = "comm.token_strategy", "comm.expert_sync"
PLACE, EP = "parallelism.placement", "parallelism.ep_size"
STEP = "sim_step_s"


# ---- the suite ---------------------------------------------------------------------------
@dataclass
class SuiteSweep:
    """One sweep of the suite: a base (a config file with keys set on it), a grid, and
    what to read off its points (``analyse``: points -> (decisions, metrics)). Every entry
    it names begins with the sweep's name (``<name>.`` or ``<name>[``)."""

    name: str
    question: str
    config: str  # relative to the repository root
    set: dict[str, Any]
    analyse: Callable[[list[dict]], tuple[dict[str, D.Decision], dict[str, Entry]]]
    axes: dict[str, list] = field(default_factory=dict)
    points: list[dict[str, Any]] | None = None

    def definition(self) -> dict:
        """What the golden file records of the sweep (and compares: a sweep defined
        differently has no comparable golden values)."""
        out = {"question": self.question, "config": self.config, "set": dict(self.set), "backend": "sim"}
        if self.points is not None:
            out["points"] = [dict(p) for p in self.points]
        else:
            out["axes"] = {k: list(v) for k, v in self.axes.items()}
        return out

    def base(self, output_dir: Path) -> Scenario:
        s = load_scenario(ROOT / self.config)
        return with_keys(s, {**self.set, "run.output_dir": str(output_dir)})

    def sweep(self, output_dir: Path) -> Sweep:
        return Sweep(self.name, self.base(output_dir), axes=dict(self.axes), points=self.points, backends=("sim",))


def _s(key: str) -> str:
    return f"summary.{key}"


def _label(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _figure(p: dict, key: str):
    if key == STEP:
        return p[STEP]
    if key.startswith("moves_by_reason."):  # a reason with no move is absent from the summary
        return (p["summary"].get("moves_by_reason") or {}).get(key.split(".", 1)[1], 0)
    return D.value(p, _s(key))


def _metrics(prefix: str, p: dict, figures: dict[str, Tol]) -> dict[str, Entry]:
    return {f"{prefix}.{k}": Entry(_figure(p, k), t) for k, t in figures.items()}


#: capacity factors within the drop budget in step-time order, equal ones: fewer drops, then less memory
CF_TIEBREAK = [_s("dropped_token_fraction"), _s("peak_memory_bytes")]


def _capacity(points):
    dec, met = {}, {}
    feasible = D.at_most(_s("dropped_token_fraction"), D.DROP_BUDGET)
    for skew, sel in D.groups(points, SKEW).items():
        order = D.ordered(sel, STEP, feasible=feasible, tiebreak=CF_TIEBREAK)
        name = f"capacity_factor.best[skew={_label(skew)}]"
        dec[name] = D.decide(order, STEP, CF, alone="the only capacity factor within the drop budget")
        if order:
            met.update(_metrics(name, order[0], {STEP: TIME, "dropped_token_fraction": FRACTION,
                                                 "peak_memory_bytes": MEMORY}))
        for p in sel:  # what feasibility rests on, every factor's (a change in capacity rounding shows here)
            met.update(_metrics(f"capacity_factor[skew={_label(skew)},cf={_label(p[CF])}]", p,
                                {"dropped_token_fraction": FRACTION}))
    return dec, met


def _page_size(points):
    order = D.ordered(points, STEP, tiebreak=[_s("peak_memory_bytes")])
    name = "page_size.best"
    return ({name: D.decide(order, STEP, PAGE)},
            _metrics(name, order[0], {STEP: TIME, "peak_memory_bytes": MEMORY, "page_moves_per_step": COUNT,
                                      "bytes_by_stage.paging": BYTES, "stage_time_s.paging": TIME,
                                      "page_stall_s": TIME}))


HEAT_SIMPLEX = [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.5, 0.5, 0.0), (0.5, 0.0, 0.5),
                (0.0, 0.5, 0.5), (0.5, 0.3, 0.2), (1 / 3, 1 / 3, 1 / 3)]
HEAT_DEFAULT = {ALPHA: 0.5, BETA: 0.3, GAMMA: 0.2}
#: the order of heat weights with equal step times: fewer page moves (PCIe copies) per step
HEAT_TIEBREAK = "page_moves_per_step"
#: configs/heat-drift.toml with two-stage expert sync, where every weighting moves pages and each
#: its own count: under its allreduce every expert has the same communication heat (one all-reduce
#: per shard, shared equally), so gamma alone leaves every score equal, nothing is below the cold
#: level and the heat policies never act (the best weights then "won" by making no page move).
#: Two-stage sync gives each expert the bytes of its own sync among the replicas that used it (M9,
#: M18). 30 steps: cold migrations from the 5th heat update (step 4) on, a few seconds in CI.
HEAT_SET = {"comm.expert_sync": "two_stage", "run.steps": 30}


def _heat_label(p: dict) -> str:
    return point_label({k: p[k] for k in (ALPHA, BETA, GAMMA)})


def _heat(points):
    order = D.ordered(points, STEP, tiebreak=[_s(HEAT_TIEBREAK)])
    name = "heat_weights.best"
    moves = {"page_moves_per_step": COUNT, "moves_by_reason.cold": COUNT, "moves_by_reason.prefetch": COUNT,
             "moves_by_reason.wake": COUNT, "max_frozen_fraction": FRACTION}
    met = _metrics(name, order[0], {STEP: TIME, **moves})
    # the seed's default weights, whichever is best
    default = next(q for q in points if all(math.isclose(q[k], v) for k, v in HEAT_DEFAULT.items()))
    met.update(_metrics("heat_weights.default(0.5,0.3,0.2)", default, {STEP: TIME, **moves}))
    for p in points:  # what each weighting makes the policies do
        met.update(_metrics(f"heat_weights[{_heat_label(p)}]", p, {"page_moves_per_step": COUNT}))
    return {name: D.decide(order, STEP, _heat_label)}, met


def _strategies(points):
    label = D.joined(TOKEN, SYNC)
    order = D.ordered(points, STEP)
    name = "strategies.best"
    met = _metrics(name, order[0], {STEP: TIME, "peak_memory_bytes": MEMORY, "bytes_by_level.nvlink": BYTES,
                                    "bytes_by_level.leaf": BYTES, "bytes_by_level.spine": BYTES,
                                    "bytes_by_stage.expert_sync": BYTES})
    met["strategies.slowest_over_best"] = Entry(order[-1][STEP] / order[0][STEP], RATIO)
    return {"strategies.ranking": D.decide(order, STEP, label, ranking=True)}, met


def _placement(points):
    dec, met = {}, {}
    for ep, sel in D.groups(points, EP).items():
        order = D.ordered(sel, STEP)
        dec[f"placement.ranking[ep={ep}]"] = D.decide(order, STEP, PLACE, ranking=True)
        met.update(_metrics(f"placement.best[ep={ep}]", order[0], {STEP: TIME}))
        met[f"placement.slowest_over_best[ep={ep}]"] = Entry(order[-1][STEP] / order[0][STEP], RATIO)
        for p in sel:
            met.update(_metrics(f"placement.{p[PLACE]}[ep={ep}]", p, {"bytes_by_level.spine": BYTES}))
    return dec, met


SUITE: list[SuiteSweep] = [
    SuiteSweep(
        "capacity_factor", "best capacity factor per routing skew (at most 1% of routed slots dropped; 0 = dropless; "
        "equal steps: fewer drops)",
        "configs/quickstart.toml", {"run.steps": 4, "run.warmup_steps": 1}, _capacity,
        axes={SKEW: [0.0, 1.5], CF: [1.0, 1.1, 1.25, 1.5, 2.0, 0.0]}),
    SuiteSweep(
        "page_size", "best page size under paging pressure (shortest step; ties: lower peak memory)",
        "configs/paging-pressure.toml", {"run.steps": 5, "run.warmup_steps": 2}, _page_size,
        axes={PAGE: [4096 * 2 ** i for i in range(7)]}),
    SuiteSweep(
        "heat_weights", f"best heat weights on a simplex grid, two-stage sync (shortest step; equal steps: fewer "
        f"{HEAT_TIEBREAK})", "configs/heat-drift.toml", HEAT_SET, _heat,
        points=[{ALPHA: a, BETA: b, GAMMA: g} for a, b, g in HEAT_SIMPLEX]),
    SuiteSweep(
        "strategies", "ranking of token strategy x expert sync (shortest step first)",
        "configs/quickstart.toml", {"run.steps": 5, "run.warmup_steps": 1}, _strategies,
        axes={TOKEN: ["alltoall", "allgather", "hierarchical"], SYNC: ["allreduce", "two_stage"]}),
    SuiteSweep(
        "placement", "ranking of placements per EP size on 2 x 2 x 2 GPUs, a100-seed, no paging (shortest step first)",
        "configs/quickstart.toml",
        {"cluster.profile": "a100-seed", "pager.gpu_budget_bytes": 0, "workload.tokens_per_rank": 1024,
         "run.steps": 4, "run.warmup_steps": 1}, _placement,
        axes={EP: [2, 4], PLACE: ["topology", "strided", "random"]}),
]


# ---- running -----------------------------------------------------------------------------
def run_suite(output_dir: str | Path | None = None, progress: bool = True, jobs: int | None = None,
              suite: list[SuiteSweep] | None = None) -> dict:
    """Run every sweep of the suite (fresh, into ``output_dir`` or a temporary folder that
    is removed afterwards) and return the current values:
    ``{"sweeps": {name: definition + base_scenario_hash}, "decisions": {name: Decision},
    "metrics": {name: Entry}, "wall_s": seconds}``."""
    start = time.perf_counter()
    tmp = None
    if output_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="testbed-regress-")
        output_dir = tmp.name
    out_dir = Path(output_dir).resolve()
    current: dict[str, Any] = {"sweeps": {}, "decisions": {}, "metrics": {}}
    try:
        for s in suite or SUITE:
            sweep = s.sweep(out_dir)
            result = run_sweep(sweep, jobs=jobs, fresh=True, progress=progress)
            if result.skipped:
                raise ScenarioError(f"regress sweep {s.name}", point_label(result.skipped[0][0]), result.skipped[0][1])
            points = result.points()
            for p in points:
                p["summary"] = result.summaries[(p["point"], "sim", 0)]
            dec, met = s.analyse(points)
            current["sweeps"][s.name] = {**s.definition(), "base_scenario_hash": scenario_hash(sweep.base)}
            current["decisions"].update(dec)
            current["metrics"].update(met)
    finally:
        if tmp is not None:
            tmp.cleanup()
    current["wall_s"] = time.perf_counter() - start
    return current


def main(golden: str | Path | None = None, update_golden: bool = False, output_dir: str | Path | None = None,
         progress: bool = True, jobs: int | None = None, out=print) -> int:
    """``testbed regress``: read the golden file first (a missing one is an error before any
    sweep runs, except with ``update_golden``), run the suite, compare or update
    (``testbed regress --update`` is the one command that writes the golden file)."""
    path = Path(golden) if golden is not None else GOLDEN
    gold = None if update_golden else load_golden(path)
    current = run_suite(output_dir=output_dir, progress=progress, jobs=jobs)
    if progress:
        print(f"regress: {len(current['sweeps'])} sweeps in {current['wall_s']:.1f} s", file=sys.stderr)
    if update_golden:
        return update(current, path, out=out)
    return check(current, gold, path, out=out)
