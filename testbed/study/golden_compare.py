"""Comparing current values with the golden file of ``testbed regress`` (the file itself, its
entries and its reading and writing: ``testbed.study.golden``): one row per sweep definition,
decision and metric, the table of what moved, the short table of the decisions, and the diff
of an update.

A metric holds within its relative tolerance: ``abs(now - golden) <= tolerance *
abs(golden)``; 0 means exact (for floats: to a relative 1e-12, ``EXACT_RTOL``). A decision
holds when the current candidates, cut into tiers at the golden ``tie_within``, give the same
outcome and the same tied candidates (in any order within a tie): so a tie passes whichever
of its candidates is best now, and fails when it breaks beyond the margin, widens to
another candidate, or another candidate wins.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.core.errors import ScenarioError
from testbed.study import decisions as D
from testbed.study.golden import OUTCOMES, UPDATE_COMMAND, Entry, golden_from, load_golden, write_golden

#: relative tolerance below which two floats are "exactly" equal (the rounding of a mean)
EXACT_RTOL = 1e-12


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
    floats to a relative 1e-12). Non-numbers must be equal."""
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


def _change(golden, now) -> str:
    if _number(golden) and _number(now):
        if golden == now:
            return "0"
        if golden == 0:
            return f"{now - golden:+.6g} (from 0)"
        return f"{100 * (now - golden) / abs(golden):+.3g}%"
    return "same" if _norm(golden) == _norm(now) else "changed"


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _tol_text(rel: float) -> str:
    if rel <= 0:
        return "exact"
    return f"{100 * rel:g}%" if rel >= 1e-4 else f"{rel:.0e} rel"


# ---- decisions ---------------------------------------------------------------------------
def decision_at(entry: dict, tie_within: float) -> dict:
    """A decision entry (golden form) with its candidates cut into tiers at ``tie_within``:
    ``{"outcome", "value", "kind"}`` as ``decision_json`` would give them."""
    d = D.Decision(entry.get("figure", ""), tuple((c[0], c[1]) for c in entry["candidates"]),
                   ranking=entry.get("kind") == "ranking", tie_within=tie_within)
    return {"outcome": d.outcome, "value": _norm(d.value), "kind": entry.get("kind", "best")}


def _key(label) -> str:
    return json.dumps(_norm(label), sort_keys=True)


def _set(labels) -> frozenset[str]:
    return frozenset(_key(x) for x in labels)


def decision_holds(golden: dict, now: dict) -> tuple[bool, str]:
    """Whether the current decision ``now`` is the ``golden`` one (the module doc): the
    current candidates cut into tiers at the golden ``tie_within`` give the golden outcome
    and the same candidates in each decided tier (any order within a tie). The second
    item says what changed, in words."""
    cur = decision_at(now, float(golden.get("tie_within", D.TIE_WITHIN)))
    g_out, g_val, n_out, n_val = golden["outcome"], golden["value"], cur["outcome"], cur["value"]
    ranking = golden.get("kind") == "ranking"
    if ranking:
        same = [_set(t) for t in g_val] == [_set(t) for t in n_val]
    else:
        same = _set(g_val) == _set(n_val)
    if same and g_out == n_out:
        return True, "same"
    if g_out == D.NO_INFORMATION:
        return False, f"carries information now ({len(now['candidates'])} candidates)"
    if n_out == D.NO_INFORMATION:
        return False, "no information now (" + ("one candidate" if now["candidates"] else "no candidate") + ")"
    if ranking:
        flat_g, flat_n = [x for t in g_val for x in t], [x for t in n_val for x in t]
        if _set(flat_g) != _set(flat_n):
            return False, "changed"
        return False, "ties changed" if _compatible(g_val, n_val) else "reordered"
    g, n = _set(g_val), _set(n_val)
    if n < g:
        gone = [show(x) for x in g_val if _key(x) not in n]
        return False, f"tie broken: {', '.join(gone)} now beyond {_pct(golden.get('tie_within', D.TIE_WITHIN))}"
    if g < n:
        extra = [show(x) for x in n_val if _key(x) not in g]
        return False, ("now a tie with " if g_out == D.CHOICE else "tie widened to ") + ", ".join(extra)
    return False, "flipped"


def _compatible(a: list[list], b: list[list]) -> bool:
    """No two candidates are strictly ordered one way by tiers ``a`` and the other by ``b``
    (only ties formed or broke)."""
    rank_a = {_key(x): i for i, t in enumerate(a) for x in t}
    rank_b = {_key(x): i for i, t in enumerate(b) for x in t}
    keys = list(rank_a)
    return not any((rank_a[x] - rank_a[y]) * (rank_b[x] - rank_b[y]) < 0 for x in keys for y in keys)


def show_decision(e: dict) -> str:
    """A decision as the tables print it: ``a > b ~ c`` (a ranking; ``~`` ties), ``tie: a ~
    b``, ``a`` (a choice), ``a (no information)``."""
    value, outcome = e["value"], e["outcome"]
    if e.get("kind") == "ranking":
        return " > ".join(" ~ ".join(show(x) for x in t) for t in value)
    if outcome == D.TIE:
        return "tie: " + " ~ ".join(show(x) for x in value)
    text = show(value[0]) if value else "—"
    return f"{text} (no information)" if outcome == D.NO_INFORMATION else text


def _decision_note(e: dict) -> str:
    """The short table's note on a decision: its margin, its tie margin, or why it carries
    no information."""
    tie = _pct(e.get("tie_within", D.TIE_WITHIN))
    if e["outcome"] == D.NO_INFORMATION:
        return f"no information: {e.get('why', 'one candidate')}"
    lead = f"leads {show(e['runner_up'])} by {_pct(e['margin'])}"
    if e["outcome"] == D.RANKING:
        return f"ties within {tie}; neighbours apart " + ", ".join(f"+{_pct(g)}" for g in e.get("gaps", []))
    if e["outcome"] == D.TIE:
        return f"a tie within {tie}, no choice: {show(e['candidates'][0][0])} {lead}"
    return f"{lead}; ties within {tie}"


def compare(current: dict, golden: dict) -> list[Row]:
    """One row per sweep definition, decision and metric of either side; ``ok`` False for
    a decision that does not hold (``decision_holds``), a metric outside the golden
    tolerance, an entry only on one side or a sweep defined differently. Pure: ``current``
    is a ``run_suite`` result (or its golden form), ``golden`` a golden mapping."""
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
    ge, ce = golden.get("decisions", {}), cur.get("decisions", {})
    for name in _names(ge, ce):
        g, c = ge.get(name), ce.get(name)
        tie = float((g or c).get("tie_within", D.TIE_WITHIN))
        if g is None or c is None:
            rows.append(Row(name, "—" if g is None else show_decision(g), "—" if c is None else show_decision(c),
                            "not in golden" if g is None else "gone", f"tie within {_pct(tie)}", False, "decision"))
            continue
        ok, change = decision_holds(g, c)
        rows.append(Row(name, show_decision(g), show_decision(decision_at(c, tie)), change, f"tie within {_pct(tie)}",
                        ok, "decision"))
    ge, ce = golden.get("metrics", {}), cur.get("metrics", {})
    for name in _names(ge, ce):
        g, c = ge.get(name), ce.get(name)
        if g is None or c is None:
            rows.append(Row(name, None if g is None else g["value"], None if c is None else c["value"],
                            "not in golden" if g is None else "gone", _tol_text((g or c).get("tolerance", 0)),
                            False, "metric"))
            continue
        rel = float(g.get("tolerance", 0))
        rows.append(Row(name, g["value"], c["value"], _change(g["value"], c["value"]), _tol_text(rel),
                        within(g["value"], c["value"], rel), "metric"))
    return rows


def notes(current: dict, golden: dict) -> list[str]:
    """Lines that explain, not fail: a sweep whose resolved base scenario differs from
    the golden one (its config file, its machine profile or a scenario default changed)."""
    out = []
    for name, c in current.get("sweeps", {}).items():
        g = golden.get("sweeps", {}).get(name) or {}
        if g.get("base_scenario_hash") and c.get("base_scenario_hash") != g["base_scenario_hash"]:
            out.append(f"note: the base scenario of sweep {name} differs from the golden one's "
                       f"({c.get('config')}, its machine profile or a scenario default changed)")
    return out


def _has_entries(d: dict) -> bool:
    return any(isinstance(e, (Entry, D.Decision)) for sec in ("decisions", "metrics") for e in d.get(sec, {}).values())


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
        g, n = (r.golden, r.now) if r.kind in ("sweep", "decision") else _pair(r.golden, r.now)
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
    the decisions (with their margins, ties and no-information ones) and exit code 0."""
    cur = golden_from(current) if _has_entries(current) else current
    rows = compare(cur, golden)
    for line in notes(cur, golden):
        out(line)
    moved = [r for r in rows if not r.ok]
    if moved:
        out(table(moved))
        out(f"regress: {len(moved)} of {len(rows)} entries moved beyond their tolerance against {golden_path} "
            f"(after a reviewed change of the model or a policy, accept them with `{UPDATE_COMMAND}`)")
        return 1
    out(_short_table(cur))
    n_met = sum(r.kind == "metric" for r in rows)
    worst = max((r for r in rows if r.kind == "metric" and _number(r.golden) and _number(r.now) and r.golden),
                key=lambda r: abs(r.now - r.golden) / abs(r.golden), default=None)
    tail = f"; largest change {worst.change} ({worst.name})" if worst and worst.change != "0" else ""
    outcomes = [e["outcome"] for e in cur.get("decisions", {}).values()]
    plural = {D.CHOICE: "choices", D.TIE: "ties", D.RANKING: "rankings", D.NO_INFORMATION: "with no information"}
    kinds = ", ".join(f"{n} {o if n == 1 and o != D.NO_INFORMATION else plural[o]}"
                      for o in OUTCOMES if (n := outcomes.count(o)))
    out(f"regress: ok, {len(outcomes)} decisions unchanged ({kinds}) and {n_met} metrics within their tolerance "
        f"against {golden_path}{tail}")
    return 0


def _short_table(cur: dict) -> str:
    dec = cur.get("decisions", {})
    width = max((len(name) for name in dec), default=0)
    return "\n".join(f"{name.ljust(width)}  {show_decision(e)}  ({_decision_note(e)})" for name, e in dec.items())


def update_diff(old: dict | None, new: dict) -> list[str]:
    """``name: old -> new`` for every entry (value, tolerance or tie margin) and sweep
    definition that differs between two golden mappings (``old`` None: every entry is new)."""
    old = old or {"sweeps": {}, "decisions": {}, "metrics": {}}
    lines = []
    for name in _names(old.get("sweeps", {}), new["sweeps"]):
        o, n = old.get("sweeps", {}).get(name), new["sweeps"].get(name)
        if _norm(o) != _norm(n):
            lines.append(f"sweep {name}: {_short(_definition(o))} -> {_short(_definition(n))}")
    for name in _names(old.get("decisions", {}), new["decisions"]):
        o, n = old.get("decisions", {}).get(name), new["decisions"].get(name)
        if o and n:
            ok, change = decision_holds(o, n)
            if ok and o.get("tie_within") == n.get("tie_within"):
                continue
            if ok:
                lines.append(f"{name}: tie within {_pct(o.get('tie_within', 0))} -> {_pct(n.get('tie_within', 0))}")
                continue
            lines.append(f"{name}: {show_decision(o)} -> {show_decision(n)} ({change})")
        else:
            lines.append(f"{name}: {show_decision(o) if o else '(new)'} -> {show_decision(n) if n else '(removed)'}")
    for name in _names(old.get("metrics", {}), new["metrics"]):
        o, n = old.get("metrics", {}).get(name), new["metrics"].get(name)
        ov, nv = (show(o["value"]) if o else "(new)"), (show(n["value"]) if n else "(removed)")
        if o and n and within(o["value"], n["value"], 0):
            if o.get("tolerance") != n.get("tolerance"):
                lines.append(f"{name}: tolerance {_tol_text(o.get('tolerance', 0))} -> "
                             f"{_tol_text(n.get('tolerance', 0))}")
            continue
        change = f" ({_change(o['value'], n['value'])})" if o and n else ""
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
