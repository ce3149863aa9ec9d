"""The golden file of ``testbed regress``: entries (a value, its relative tolerance and
the reason for it), reading and writing the file, comparing current values with it, the
table of what moved and the diff of an update.

The tolerance is relative (``abs(now - golden) <= tolerance * abs(golden)``); 0 means
exact (for floats: to a relative 1e-12, the rounding of a mean over steps). Decisions (a
chosen value, a ranking) are always exact.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.errors import ScenarioError
from testbed.files import write_atomic

FORMAT = 1
#: relative tolerance below which two floats are "exactly" equal (the rounding of a mean)
EXACT_RTOL = 1e-12


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
