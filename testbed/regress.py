"""``testbed regress``: the tuning choices, regression-tested on the simulator.

A suite of small simulator sweeps (``SUITE``) is run with the sweep engine, each into a
fresh run store (a temporary folder unless ``--output-dir``), and each sweep's
**decisions** (the best capacity factor per skew, the best page size, the best heat
weights, the ranking of the token x sync strategies, the ranking of placements per EP
size) and key **metrics** (the best point's step time, dropped slots, peak memory,
bytes, page moves, ...) are compared with the golden file
``testbed/golden/regress.json``. The simulator with synthetic routing (M4) and built-in
profiles is deterministic, so the same code gives the same numbers on every machine:
a change is a change of the model or of a policy.

Every entry of the golden file carries its value, its tolerance and a one-line reason
for it. The tolerance is relative (``abs(now - golden) <= tolerance * abs(golden)``);
0 means exact (for floats: to a relative 1e-12, the rounding of a mean over steps).
Decisions (a chosen value, a ranking) are always exact.

- every entry within its tolerance: a short table, exit 0;
- a decision flipped, a metric outside its tolerance, an entry only on one side, or a
  sweep defined differently from the golden one: a table of what moved (name, golden,
  now, change, tolerance), exit 1;
- ``--update``: write the golden file from this run and print what changed (old -> new);
- a missing or unreadable golden file: one line naming it, exit 2.

The decision rules are those of ``testbed.decisions``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import decisions as D
from testbed.errors import ScenarioError
from testbed.files import write_atomic
from testbed.runs import scenario_hash
from testbed.scenario import Scenario
from testbed.scenario_file import load_scenario
from testbed.sweep import Sweep, point_label, run_sweep, with_keys

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden" / "regress.json"
FORMAT = 1
#: relative tolerance below which two floats are "exactly" equal (the rounding of a mean)
EXACT_RTOL = 1e-12

CF, SKEW = "router.capacity_factor", "workload.skew"
PAGE = "pager.page_size_bytes"
ALPHA, BETA, GAMMA = "heat.alpha", "heat.beta", "heat.gamma"
TOKEN, SYNC = "comm.token_strategy", "comm.expert_sync"
PLACE, EP = "parallelism.placement", "parallelism.ep_size"
STEP = "sim_step_s"


# ---- tolerances --------------------------------------------------------------------------
@dataclass(frozen=True)
class Tol:
    rel: float  # relative tolerance; 0 = exact
    reason: str


DECISION = Tol(0, "a decision: any change of the chosen value or order is a flip")
TIME = Tol(0.02, "simulated seconds are deterministic; 2% lets small model refinements through (decisions are "
                 "checked exactly on their own)")
RATIO = Tol(0.02, "a ratio of simulated times: as for times")
BYTES = Tol(0, "bytes are counted from deterministic routing: any change is a change in what moves")
MEMORY = Tol(0, "peak bytes of a deterministic memory model: any change is a change in what is held")
COUNT = Tol(0, "counts of the deterministic synthetic routing and policies")
FRACTION = Tol(0, "a ratio of counts of the deterministic synthetic routing and policies")


@dataclass
class Entry:
    value: Any
    tol: Tol
    margin: str | None = None  # decisions: how close the runner-up came (informational, never compared)

    def to_json(self) -> dict:
        out = {"value": self.value, "tolerance": self.tol.rel, "reason": self.tol.reason}
        if self.margin is not None:
            out["margin"] = self.margin
        return out


# ---- the suite ---------------------------------------------------------------------------
@dataclass
class SuiteSweep:
    """One sweep of the suite: a base (a config file with keys set on it), a grid, and
    what to read off its points (``analyse``: points -> (decisions, metrics))."""

    name: str
    question: str
    config: str  # relative to the repository root
    set: dict[str, Any]
    analyse: Callable[[list[dict]], tuple[dict[str, Entry], dict[str, Entry]]]
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


def _runner_up(order: list[dict], label: Callable[[dict], str]) -> str | None:
    """``next: LABEL +x.xx%`` (the runner-up and how much slower its step is)."""
    if len(order) < 2:
        return "the only point that qualifies" if order else None
    gap = D.gaps(order[:2], STEP)[0]
    return f"next: {label(order[1])} {100 * gap:+.3g}%" + (" (tie, broken by the secondary metric or grid order)"
                                                            if gap == 0 else "")


def _closest(order: list[dict], label: Callable[[dict], str]) -> str | None:
    """``closest: A vs B +x.xx%`` (the neighbours of a ranking nearest to swapping)."""
    g = D.gaps(order, STEP)
    if not g:
        return None
    i = min(range(len(g)), key=g.__getitem__)
    return f"closest: {label(order[i])} vs {label(order[i + 1])} {100 * g[i]:+.3g}%"


#: capacity factors within the drop budget that tie on step time: fewer drops, then less memory
CF_TIEBREAK = [_s("dropped_token_fraction"), _s("peak_memory_bytes")]


def _capacity(points):
    dec, met = {}, {}
    feasible = D.at_most(_s("dropped_token_fraction"), D.DROP_BUDGET)
    for skew, sel in D.groups(points, SKEW).items():
        order = D.ordered(sel, STEP, feasible=feasible, tiebreak=CF_TIEBREAK)
        name = f"capacity_factor.best[skew={_label(skew)}]"
        dec[name] = Entry(order[0][CF] if order else None, DECISION,
                          _runner_up(order, lambda p: f"capacity_factor={_label(p[CF])}"))
        if order:
            met.update(_metrics(name, order[0], {STEP: TIME, "dropped_token_fraction": FRACTION,
                                                 "peak_memory_bytes": MEMORY}))
    return dec, met


def _page_size(points):
    order = D.ordered(points, STEP, tiebreak=[_s("peak_memory_bytes")])
    name = "page_size.best"
    return ({name: Entry(order[0][PAGE], DECISION, _runner_up(order, lambda p: f"{p[PAGE] // 1024}KiB"))},
            _metrics(name, order[0], {STEP: TIME, "peak_memory_bytes": MEMORY, "page_moves_per_step": COUNT,
                                      "bytes_by_stage.paging": BYTES, "stage_time_s.paging": TIME,
                                      "page_stall_s": TIME}))


HEAT_SIMPLEX = [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.5, 0.5, 0.0), (0.5, 0.0, 0.5),
                (0.0, 0.5, 0.5), (0.5, 0.3, 0.2), (1 / 3, 1 / 3, 1 / 3)]
HEAT_DEFAULT = {ALPHA: 0.5, BETA: 0.3, GAMMA: 0.2}
#: the secondary metric of the heat weights: fewer page moves (PCIe copies) per step
HEAT_TIEBREAK = "page_moves_per_step"


def _heat_label(p: dict) -> str:
    return point_label({k: p[k] for k in (ALPHA, BETA, GAMMA)})


def _heat(points):
    order = D.ordered(points, STEP, tiebreak=[_s(HEAT_TIEBREAK)])
    name = "heat_weights.best"
    moves = {"page_moves_per_step": COUNT, "moves_by_reason.cold": COUNT, "moves_by_reason.prefetch": COUNT,
             "moves_by_reason.wake": COUNT, "max_frozen_fraction": FRACTION}
    met = _metrics(name, order[0], {STEP: TIME, **moves})
    # the best weights may leave the heat policies idle: the default weights keep them regression-tested
    default = next(q for q in points if all(math.isclose(q[k], v) for k, v in HEAT_DEFAULT.items()))
    met.update(_metrics("heat_weights.default(0.5,0.3,0.2)", default, {STEP: TIME, **moves}))
    return {name: Entry(_heat_label(order[0]), DECISION, _runner_up(order, _heat_label))}, met


def _strategies(points):
    label = D.joined(TOKEN, SYNC)
    order = D.ordered(points, STEP)
    name = "strategies.best"
    met = _metrics(name, order[0], {STEP: TIME, "peak_memory_bytes": MEMORY, "bytes_by_level.nvlink": BYTES,
                                    "bytes_by_level.leaf": BYTES, "bytes_by_level.spine": BYTES,
                                    "bytes_by_stage.expert_sync": BYTES})
    met["strategies.slowest_over_best"] = Entry(order[-1][STEP] / order[0][STEP], RATIO)
    return {"strategies.ranking": Entry([label(p) for p in order], DECISION, _closest(order, label))}, met


def _placement(points):
    dec, met = {}, {}
    for ep, sel in D.groups(points, EP).items():
        order = D.ordered(sel, STEP)
        dec[f"placement.ranking[ep={ep}]"] = Entry([p[PLACE] for p in order], DECISION,
                                                   _closest(order, lambda p: p[PLACE]))
        met.update(_metrics(f"placement.best[ep={ep}]", order[0], {STEP: TIME}))
        met[f"placement.slowest_over_best[ep={ep}]"] = Entry(order[-1][STEP] / order[0][STEP], RATIO)
        for p in sel:
            met.update(_metrics(f"placement.{p[PLACE]}[ep={ep}]", p, {"bytes_by_level.spine": BYTES}))
    return dec, met


SUITE: list[SuiteSweep] = [
    SuiteSweep(
        "capacity_factor", "best capacity factor per routing skew (at most 1% of routed slots dropped; 0 = dropless)",
        "configs/quickstart.toml", {"run.steps": 4, "run.warmup_steps": 1}, _capacity,
        axes={SKEW: [0.0, 1.5], CF: [1.0, 1.1, 1.25, 1.5, 2.0, 0.0]}),
    SuiteSweep(
        "page_size", "best page size under paging pressure (shortest step; ties: lower peak memory)",
        "configs/paging-pressure.toml", {"run.steps": 5, "run.warmup_steps": 2}, _page_size,
        axes={PAGE: [4096 * 2 ** i for i in range(7)]}),
    SuiteSweep(
        "heat_weights", f"best heat weights on a simplex grid (shortest step; ties: fewer {HEAT_TIEBREAK})",
        "configs/heat-drift.toml", {}, _heat,
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
    ``{"sweeps": {name: definition + base_scenario_hash}, "decisions": {name: Entry},
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


# ---- the golden file ---------------------------------------------------------------------
ABOUT = ("testbed regress: tuning decisions and key metrics of small simulator sweeps (testbed/regress.py). "
         "Written by `testbed regress --update`. tolerance: relative, abs(now - golden) <= tolerance * abs(golden); "
         "0 = exact. Sweeps: the scenario keys each sweep sets on its config and its grid.")


def golden_from(current: dict) -> dict:
    """The golden file's contents for ``current`` (a ``run_suite`` result)."""
    return {"about": ABOUT, "format": FORMAT,
            "sweeps": current["sweeps"],
            "decisions": {k: _jsonable(e) for k, e in current["decisions"].items()},
            "metrics": {k: _jsonable(e) for k, e in current["metrics"].items()}}


def _jsonable(e) -> dict:
    return e.to_json() if isinstance(e, Entry) else dict(e)


def load_golden(path: str | Path) -> dict:
    """The golden file at ``path``; a ScenarioError naming it when it is missing,
    unreadable or not a golden file."""
    p = Path(path)
    if not p.is_file():
        raise ScenarioError("--golden", str(path), "no such file (write one with `testbed regress --update`)"
                            if not p.exists() else "not a file")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ScenarioError("--golden", str(path), f"cannot read it: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in ("sweeps", "decisions", "metrics")):
        raise ScenarioError("--golden", str(path), "not a regress golden file (no sweeps, decisions and metrics)")
    for section in ("decisions", "metrics"):
        for name, e in data[section].items():
            if not isinstance(e, dict) or "value" not in e or not isinstance(e.get("tolerance", 0), (int, float)):
                raise ScenarioError("--golden", str(path), f"{section} entry {name!r} has no value or a bad tolerance")
    return data


def golden_text(data: dict) -> str:
    """The golden mapping as JSON with one line per sweep and per entry (diffs in review
    show what moved)."""
    def one(v) -> str:
        return json.dumps(v, ensure_ascii=False)

    parts = []
    for k, v in data.items():
        if isinstance(v, dict) and k in ("sweeps", "decisions", "metrics"):
            inner = ",\n".join(f"    {one(name)}: {one(e)}" for name, e in v.items())
            parts.append(f"  {one(k)}: {{\n{inner}\n  }}" if v else f"  {one(k)}: {{}}")
        else:
            parts.append(f"  {one(k)}: {one(v)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_golden(path: str | Path, current: dict) -> dict:
    data = golden_from(current)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(p, golden_text(data))
    os.chmod(p, 0o644)  # a file kept in git, not a private one (write_atomic's temporary file is 0600)
    return data


# ---- comparing ---------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    golden: Any
    now: Any
    change: str
    tolerance: str
    ok: bool
    kind: str  # decision, metric, sweep


def within(golden: Any, now: Any, rel: float) -> bool:
    """``now`` agrees with ``golden`` within the relative tolerance ``rel`` (0: exact; two
    floats to a relative 1e-12). Non-numbers (decisions, rankings) must be equal."""
    if _number(golden) and _number(now):
        if rel <= 0:
            return golden == now or math.isclose(golden, now, rel_tol=EXACT_RTOL, abs_tol=0.0)
        return abs(now - golden) <= rel * abs(golden) + EXACT_RTOL * abs(golden)
    return _norm(golden) == _norm(now)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _norm(v):
    # JSON turns tuples into lists; compare as JSON sees them
    return json.loads(json.dumps(v))


def _change(golden, now, kind: str) -> str:
    if kind == "decision" and _norm(golden) != _norm(now):
        lists = isinstance(golden, list) and isinstance(now, list)
        return "reordered" if lists and sorted(map(str, golden)) == sorted(map(str, now)) else "flipped"
    if _number(golden) and _number(now):
        if golden == now:
            return "0"
        if golden == 0:
            return f"{now - golden:+.6g} (from 0)"
        return f"{100 * (now - golden) / abs(golden):+.3g}%"
    if _norm(golden) == _norm(now):
        return "same"
    if isinstance(golden, list) and isinstance(now, list):
        return "reordered" if sorted(map(str, golden)) == sorted(map(str, now)) else "changed"
    return "flipped" if kind == "decision" else "changed"


def _tol_text(rel: float, kind: str) -> str:
    if kind == "decision" or rel <= 0:
        return "exact"
    return f"{100 * rel:g}%"


def compare(current: dict, golden: dict) -> list[Row]:
    """One row per sweep definition, decision and metric of either side; ``ok`` False for
    a flipped decision, a metric outside the golden tolerance, an entry only on one side
    or a sweep defined differently. Pure: ``current`` is a ``run_suite`` result (or its
    golden form), ``golden`` a golden mapping."""
    rows: list[Row] = []
    cur = golden_from(current) if _has_entries(current) else current
    gs, cs = golden.get("sweeps", {}), cur.get("sweeps", {})
    for name in _names(gs, cs):
        g, c = gs.get(name), cs.get(name)
        gd, cd = _definition(g), _definition(c)
        ok = gd is not None and cd is not None and _norm(gd) == _norm(cd)
        rows.append(Row(f"sweep {name}", _short(gd), _short(cd),
                        "same" if ok else ("not in golden" if g is None else "gone" if c is None else "redefined"),
                        "exact", ok, "sweep"))
    for section, kind in (("decisions", "decision"), ("metrics", "metric")):
        ge, ce = golden.get(section, {}), cur.get(section, {})
        for name in _names(ge, ce):
            g, c = ge.get(name), ce.get(name)
            if g is None or c is None:
                rows.append(Row(name, None if g is None else g["value"], None if c is None else c["value"],
                                "not in golden" if g is None else "gone", _tol_text((g or c).get("tolerance", 0), kind),
                                False, kind))
                continue
            rel = 0.0 if kind == "decision" else float(g.get("tolerance", 0))
            rows.append(Row(name, g["value"], c["value"], _change(g["value"], c["value"], kind), _tol_text(rel, kind),
                            within(g["value"], c["value"], rel), kind))
    return rows


def notes(current: dict, golden: dict) -> list[str]:
    """Lines that explain, not fail: a sweep whose resolved base scenario differs from
    the golden one (its config file or a scenario default changed)."""
    out = []
    for name, c in current.get("sweeps", {}).items():
        g = golden.get("sweeps", {}).get(name) or {}
        if g.get("base_scenario_hash") and c.get("base_scenario_hash") != g["base_scenario_hash"]:
            out.append(f"note: the base scenario of sweep {name} differs from the golden one's "
                       f"({c.get('config')} or a scenario default changed)")
    return out


def _has_entries(d: dict) -> bool:
    return any(isinstance(e, Entry) for sec in ("decisions", "metrics") for e in d.get(sec, {}).values())


def _names(a: dict, b: dict) -> list[str]:
    return list(a) + [k for k in b if k not in a]


def _definition(sweep: dict | None) -> dict | None:
    if sweep is None:
        return None
    return {k: v for k, v in sweep.items() if k not in ("base_scenario_hash", "question")}


def _short(v, width: int = 60) -> str:
    if v is None:
        return "—"
    text = json.dumps(v, separators=(",", ":"))
    return text if len(text) <= width else text[:width - 1] + "…"


def show(v) -> str:
    """A value as the tables print it (whole numbers in full: bytes and counts)."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.0f}" if v.is_integer() and abs(v) >= 1e6 else f"{v:.6g}"
    if isinstance(v, list):
        return " > ".join(show(x) for x in v)
    return str(v)


def _pair(golden, now) -> tuple[str, str]:
    """Both values as printed; in full precision where the short forms would look equal."""
    g, n = show(golden), show(now)
    if g == n and _number(golden) and _number(now) and golden != now:
        return repr(golden), repr(now)
    return g, n


WRAP = 48  # the widest a golden / now cell gets; a longer value (a ranking) goes on several lines


def _wrap(text: str, width: int = WRAP) -> list[str]:
    if len(text) <= width:
        return [text]
    lines, cur = [], ""
    for word in text.split(" "):
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    return lines + [cur]


def table(rows: list[Row]) -> str:
    """name, golden, now, change, tolerance as aligned columns (long values wrapped)."""
    head = ("name", "golden", "now", "change", "tolerance")
    cells = [[[h] for h in head]]
    for r in rows:
        g, n = (r.golden, r.now) if r.kind == "sweep" else _pair(r.golden, r.now)
        cells.append([[r.name], _wrap(g), _wrap(n), [r.change], [r.tolerance]])
    widths = [max(len(line) for c in cells for line in c[i]) for i in range(len(head))]
    out = []
    for c in cells:
        for k in range(max(len(col) for col in c)):
            out.append("  ".join((col[k] if k < len(col) else "").ljust(widths[i])
                                 for i, col in enumerate(c)).rstrip())
    return "\n".join(out)


def check(current: dict, golden: dict, golden_path: str | Path = "golden", out=print) -> int:
    """Compare and print: the table of what moved and exit code 1, or a short table of
    the decisions and exit code 0."""
    rows = compare(current, golden)
    for line in notes(golden_from(current) if _has_entries(current) else current, golden):
        out(line)
    moved = [r for r in rows if not r.ok]
    if moved:
        out(table(moved))
        out(f"regress: {len(moved)} of {len(rows)} entries moved beyond their tolerance against {golden_path} "
            "(rerun with --update to accept them)")
        return 1
    out(_short_table(rows, current))
    n_met = sum(r.kind == "metric" for r in rows)
    worst = max((r for r in rows if r.kind == "metric" and _number(r.golden) and _number(r.now) and r.golden),
                key=lambda r: abs(r.now - r.golden) / abs(r.golden), default=None)
    tail = f"; largest change {worst.change} ({worst.name})" if worst and worst.change != "0" else ""
    out(f"regress: ok, {sum(r.kind == 'decision' for r in rows)} decisions unchanged and {n_met} metrics within "
        f"their tolerance against {golden_path}{tail}")
    return 0


def _short_table(rows: list[Row], current: dict) -> str:
    dec = [r for r in rows if r.kind == "decision"]
    margins = {k: _jsonable(e).get("margin") for k, e in current.get("decisions", {}).items()}
    width = max((len(r.name) for r in dec), default=0)
    return "\n".join(f"{r.name.ljust(width)}  {show(r.now)}" + (f"  ({margins[r.name]})" if margins.get(r.name) else "")
                     for r in dec)


def update_diff(old: dict | None, new: dict) -> list[str]:
    """``name: old -> new`` for every entry (value or tolerance) and sweep definition that
    differs between two golden mappings (``old`` None: every entry is new)."""
    old = old or {"sweeps": {}, "decisions": {}, "metrics": {}}
    lines = []
    for name in _names(old.get("sweeps", {}), new["sweeps"]):
        o, n = old.get("sweeps", {}).get(name), new["sweeps"].get(name)
        if _norm(o) != _norm(n):
            lines.append(f"sweep {name}: {_short(_definition(o))} -> {_short(_definition(n))}")
    for section in ("decisions", "metrics"):
        for name in _names(old.get(section, {}), new[section]):
            o, n = old.get(section, {}).get(name), new[section].get(name)
            ov, nv = (show(o["value"]) if o else "(new)"), (show(n["value"]) if n else "(removed)")
            if o and n and within(o["value"], n["value"], 0):
                if o.get("tolerance") != n.get("tolerance"):
                    lines.append(f"{name}: tolerance {_tol_text(o.get('tolerance', 0), '')} -> "
                                 f"{_tol_text(n.get('tolerance', 0), '')}")
                continue
            change = f" ({_change(o['value'], n['value'], section[:-1])})" if o and n else ""
            lines.append(f"{name}: {ov} -> {nv}{change}")
    return lines


def update(current: dict, golden_path: str | Path, out=print) -> int:
    """Rewrite the golden file from ``current`` and print the diff; exit code 0."""
    old = None
    try:
        old = load_golden(golden_path)
    except ScenarioError as e:
        if Path(golden_path).exists():
            out(f"note: replacing an unreadable golden file ({e})")
    new = write_golden(golden_path, current)
    lines = update_diff(old, new)
    for line in lines:
        out(line)
    n = len(new["decisions"]) + len(new["metrics"])
    what = "a new file" if old is None else f"{len(lines)} changed" if lines else "no changes"
    out(f"regress: wrote {golden_path} ({n} entries, {what})")
    return 0


def main(golden: str | Path | None = None, update_golden: bool = False, output_dir: str | Path | None = None,
         progress: bool = True, jobs: int | None = None, out=print) -> int:
    """``testbed regress``: read the golden file first (a missing one is an error before any
    sweep runs, except with ``update_golden``), run the suite, compare or update."""
    path = Path(golden) if golden is not None else GOLDEN
    gold = None if update_golden else load_golden(path)
    current = run_suite(output_dir=output_dir, progress=progress, jobs=jobs)
    if progress:
        print(f"regress: {len(current['sweeps'])} sweeps in {current['wall_s']:.1f} s", file=sys.stderr)
    if update_golden:
        return update(current, path, out=out)
    return check(current, gold, path, out=out)
