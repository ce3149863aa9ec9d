"""The golden file of ``testbed regress``: its entries (a value, its relative tolerance and
the reason for it), the form it records decisions in, and reading and writing the file.
Comparing current values with it, the table of what moved and the diff of an update are
``testbed.study.golden_compare``.

Metrics: the tolerance is relative (``abs(now - golden) <= tolerance * abs(golden)``); 0
means exact (for floats: to a relative 1e-12, the rounding of a mean over steps). The
simulator is deterministic, so its figures (seconds, bytes, counts) get 1e-9 at most; a
figure from a real run or another noisy source would get a tolerance from its measured
run-to-run spread (the suite has none).

Decisions (``testbed.study.decisions.Decision``): the outcome (``choice``, ``tie``, ``ranking``,
``no information``), what was decided (the best's tier of tied candidates, or every tier
of a ranking), the margin (the best's lead over the runner-up in the decision's figure),
the tie margin ``tie_within`` and the candidates with their figures.

The golden file is written by ``testbed regress --update`` (and only by it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.core.errors import ScenarioError
from testbed.core.files import write_atomic
from testbed.study import decisions as D

FORMAT = 2
#: the command that writes the golden file (after a reviewed change of the model or a policy)
UPDATE_COMMAND = "testbed regress --update"


# ---- tolerances --------------------------------------------------------------------------
@dataclass(frozen=True)
class Tol:
    rel: float  # relative tolerance; 0 = exact
    reason: str


TIME = Tol(1e-9, "simulated seconds: the simulator is deterministic (same scenario and seed, same numbers); 1e-9 "
                 "leaves room for float rounding only (summation order), so any model or policy change shows")
RATIO = Tol(1e-9, "a ratio of simulated times: as for times")
BYTES = Tol(0, "bytes are counted from deterministic routing: any change is a change in what moves")
MEMORY = Tol(0, "peak bytes of a deterministic memory model: any change is a change in what is held")
COUNT = Tol(0, "counts of the deterministic synthetic routing and policies")
FRACTION = Tol(0, "a ratio of counts of the deterministic synthetic routing and policies")


@dataclass
class Entry:
    """A metric: its value and tolerance."""

    value: Any
    tol: Tol

    def to_json(self) -> dict:
        return {"value": self.value, "tolerance": self.tol.rel, "reason": self.tol.reason}


def decision_json(d: D.Decision) -> dict:
    """A decision as the golden file records it (see the module doc)."""
    out = {"outcome": d.outcome, "value": d.value, "kind": "ranking" if d.ranking else "best",
           "figure": d.figure, "margin": d.margin, "margin_abs": d.margin_abs, "runner_up": d.runner_up,
           "tie_within": d.tie_within, "reason": D.TIE_REASON}
    if d.outcome == D.NO_INFORMATION:
        out["why"] = d.alone if d.candidates else "no candidate qualifies"
    if d.ranking:
        out["gaps"] = d.gaps
    out["candidates"] = [[label, fig] for label, fig in d.candidates]
    return out


# ---- the golden file ---------------------------------------------------------------------
ABOUT = ("testbed regress: tuning decisions and key metrics of small simulator sweeps (testbed/study/regress.py). "
         f"Written by `{UPDATE_COMMAND}`. Metrics: tolerance relative, abs(now - golden) <= tolerance * "
         "abs(golden); 0 = exact. Decisions: value = the best's tier of candidates tied within tie_within (relative, "
         "in the decision's figure) or every tier of a ranking; margin = the best's lead over the runner-up "
         "(relative; margin_abs in the figure's unit); a decision holds when the same candidates tie at the top "
         "(a ranking: in every tier). Sweeps: the scenario keys each sweep sets on its config and its grid.")


def golden_from(current: dict) -> dict:
    """The golden file's contents for ``current`` (a ``run_suite`` result)."""
    return {"about": ABOUT, "format": FORMAT,
            "sweeps": current["sweeps"],
            "decisions": {k: _jsonable(e) for k, e in current["decisions"].items()},
            "metrics": {k: _jsonable(e) for k, e in current["metrics"].items()}}


def _jsonable(e) -> dict:
    if isinstance(e, Entry):
        return e.to_json()
    if isinstance(e, D.Decision):
        return decision_json(e)
    return dict(e)


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
    if data.get("format") != FORMAT:
        raise ScenarioError("--golden", str(path), f"format {data.get('format')!r}, expected {FORMAT} "
                            f"(rewrite it with `{UPDATE_COMMAND}`)")
    for name, e in data["metrics"].items():
        if not isinstance(e, dict) or "value" not in e or not isinstance(e.get("tolerance", 0), (int, float)):
            raise ScenarioError("--golden", str(path), f"metrics entry {name!r} has no value or a bad tolerance")
    for name, e in data["decisions"].items():
        if (not isinstance(e, dict) or "value" not in e or e.get("outcome") not in OUTCOMES
                or not isinstance(e.get("tie_within", 0), (int, float)) or not isinstance(e.get("candidates"), list)):
            raise ScenarioError("--golden", str(path), f"decisions entry {name!r} has no value, outcome, tie_within "
                                "or candidates")
    return data


OUTCOMES = (D.CHOICE, D.TIE, D.RANKING, D.NO_INFORMATION)


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
    return data
