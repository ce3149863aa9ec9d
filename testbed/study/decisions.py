"""Decision rules over a sweep's points: the best point, a ranking, the best per group.

Small pure functions over the list ``SweepResult.points()`` returns (or any list of
dicts), so that ``testbed regress`` and the ``experiments/*.py`` scripts pick "the best
capacity factor" or "the ranking of the strategies" by the same rule.

A **key** names a figure of a point: one of the point's own keys (``"sim_step_s"``,
``"router.capacity_factor"``), a dotted path into its nested dicts
(``"sim.dropped_token_fraction"``, ``"sim.moves_by_reason.cold"``), or a callable
``point -> value``. A point whose metric is ``None`` (not measured on that backend, or
missing) takes no part. Ties are broken by the ``tiebreak`` keys in order, then by the
point's position in the list (the sweep's grid order), so every rule is deterministic.

A ``Decision`` is what a rule chose, with how much it rests on: its candidates best first
with their figure, the **margin** (how far the best is ahead of the runner-up, in that
figure), and **ties**: candidates within ``TIE_WITHIN`` of their tier leader's figure are
tied (``tiers``), so a best that wins by less is a tie of the named candidates, not a choice.
A decision with a single candidate carries no information.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

Key = str | Callable[[dict], Any]

#: the largest fraction of routed (token, expert) slots a "best" capacity factor may drop
#: (the same budget as experiments/sweep_capacity_factor.py)
DROP_BUDGET = 0.01

#: a candidate whose figure is within this fraction of its tier's leader's is tied with it (``tiers``,
#: TIE_REASON)
TIE_WITHIN = 0.01
TIE_REASON = ("step times within 1% of a tier's leader (the best, for the top tier) are a tie (assumed): the "
              "built-in profiles' constants are specs or assumptions, not measurements to 1%, so a choice resting on "
              "less would not carry over to a machine (the figures themselves are checked to 1e-9 as metrics)")

#: outcomes of a decision
CHOICE, TIE, RANKING, NO_INFORMATION = "choice", "tie", "ranking", "no information"


def value(point: dict, key: Key) -> Any:
    """The figure ``key`` names in ``point`` (see the module doc); None where it is absent."""
    if callable(key):
        return key(point)
    return _lookup(point, key.split("."))


def _lookup(node: Any, parts: list[str]) -> Any:
    # the longest prefix of the remaining parts that is a key first: point keys hold dots
    # themselves ("router.capacity_factor"), nested summary keys do not
    if not parts:
        return node
    if not isinstance(node, dict):
        return None
    for n in range(len(parts), 0, -1):
        k = ".".join(parts[:n])
        if k in node:
            found = _lookup(node[k], parts[n:])
            if found is not None:
                return found
    return None


def at_most(key: Key, limit: float) -> Callable[[dict], bool]:
    """A feasibility rule: the point's ``key`` is known and at most ``limit``
    (``at_most("sim.dropped_token_fraction", DROP_BUDGET)``)."""
    def ok(point: dict) -> bool:
        v = value(point, key)
        return v is not None and v <= limit
    return ok


def joined(*keys: Key, sep: str = "/") -> Callable[[dict], str]:
    """A label made of several keys' values: ``joined("comm.token_strategy",
    "comm.expert_sync")`` gives ``"alltoall/allreduce"``."""
    return lambda point: sep.join(str(value(point, k)) for k in keys)


def ordered(points: Iterable[dict], metric: Key, feasible: Callable[[dict], bool] | None = None,
            tiebreak: Iterable[Key] = ()) -> list[dict]:
    """The points that have ``metric`` (and pass ``feasible``), smallest ``metric`` first;
    ties by ``tiebreak`` keys (smaller first), then by position in ``points``."""
    tiebreak = tuple(tiebreak)
    cands = [(i, p) for i, p in enumerate(points)
             if value(p, metric) is not None and (feasible is None or feasible(p))]

    def sort_key(item):
        i, p = item
        extra = []
        for t in tiebreak:
            v = value(p, t)
            extra.append((v is None, v if v is not None else 0))  # unknown last
        return (value(p, metric), *extra, i)

    return [p for _, p in sorted(cands, key=sort_key)]


def best_point(points: Iterable[dict], metric: Key, feasible: Callable[[dict], bool] | None = None,
               tiebreak: Iterable[Key] = ()) -> dict | None:
    """The point with the smallest ``metric`` among those ``feasible`` admits (all, by
    default); None when no point qualifies. Ties: see ``ordered``."""
    out = ordered(points, metric, feasible, tiebreak)
    return out[0] if out else None


def ranking(points: Iterable[dict], label_key: Key, metric: Key, tiebreak: Iterable[Key] = ()) -> list:
    """The points' labels (``label_key``), best (smallest ``metric``) first."""
    return [value(p, label_key) for p in ordered(points, metric, tiebreak=tiebreak)]


def groups(points: Iterable[dict], group_key: Key) -> dict[Any, list[dict]]:
    """Points by the value of ``group_key``, groups in order of first appearance."""
    out: dict[Any, list[dict]] = {}
    for p in points:
        out.setdefault(value(p, group_key), []).append(p)
    return out


def best_per_group(points: Iterable[dict], group_key: Key, metric: Key,
                   feasible: Callable[[dict], bool] | None = None,
                   tiebreak: Iterable[Key] = ()) -> dict[Any, dict | None]:
    """Group value -> its best point (``best_point`` within the group; None where no point
    of the group is feasible). E.g. the best capacity factor per skew setting."""
    return {g: best_point(sel, metric, feasible, tiebreak) for g, sel in groups(points, group_key).items()}


def ranking_per_group(points: Iterable[dict], group_key: Key, label_key: Key, metric: Key,
                      tiebreak: Iterable[Key] = ()) -> dict[Any, list]:
    """Group value -> ``ranking`` of the group's points. E.g. placements per EP size."""
    return {g: ranking(sel, label_key, metric, tiebreak) for g, sel in groups(points, group_key).items()}


def gaps(ordered_points: list[dict], metric: Key) -> list[float]:
    """Relative gaps between neighbours of an ``ordered`` list: ``(next - this) / this``
    for each pair (how close a decision came to flipping: a gap of 0 is a tie broken by
    the tiebreak keys or the grid order)."""
    return _relative_gaps([value(p, metric) for p in ordered_points])


def _relative_gaps(vals: list[float]) -> list[float]:
    return [(b - a) / a if a else (0.0 if b == a else float("inf")) for a, b in pairwise(vals)]


def tiers(values: Sequence[float], tie_within: float = TIE_WITHIN) -> list[list[int]]:
    """Positions of ``values`` (ascending: the figures of an ``ordered`` list) in tiers of
    ties, best tier first: a tier is a leader (the first value in no tier yet) and every
    following value within ``tie_within`` of it (``v <= leader + tie_within * |leader|``).
    ``tie_within = 0``: only equal values tie."""
    out: list[list[int]] = []
    i = 0
    while i < len(values):
        limit = values[i] + tie_within * abs(values[i])
        j = i + 1
        while j < len(values) and values[j] <= limit:
            j += 1
        out.append(list(range(i, j)))
        i = j
    return out


@dataclass(frozen=True)
class Decision:
    """A decision among candidates by one figure (smaller is better).

    ``candidates``: (label, figure) best first, as ``ordered`` gives them (ties of equal
    figures in tiebreak and grid order); ``figure`` names it (``"sim_step_s"``: seconds).
    ``ranking``: the whole order is the decision (in tiers of ties); otherwise only the
    best (the top tier). ``alone``: what a single candidate is (it is then no choice)."""

    figure: str
    candidates: tuple[tuple[Any, float], ...]
    ranking: bool = False
    tie_within: float = TIE_WITHIN
    alone: str = "the only candidate"

    @property
    def tiers(self) -> list[list]:
        """The candidates' labels in tiers of ties (``tiers``), best first."""
        labels = [c[0] for c in self.candidates]
        return [[labels[i] for i in t] for t in tiers([c[1] for c in self.candidates], self.tie_within)]

    @property
    def outcome(self) -> str:
        """``no information`` (fewer than two candidates), ``ranking``, ``tie`` (the best
        is within the tie margin of another) or ``choice``."""
        if len(self.candidates) < 2:
            return NO_INFORMATION
        if self.ranking:
            return RANKING
        return TIE if len(self.tiers[0]) > 1 else CHOICE

    @property
    def value(self) -> list:
        """What was decided: the top tier's labels (a best), or every tier (a ranking)."""
        t = self.tiers
        return t if self.ranking else (t[0] if t else [])

    @property
    def margin(self) -> float | None:
        """How far the best is ahead of the runner-up: (runner-up - best) / best of the
        figure; None with fewer than two candidates."""
        return self.gaps[0] if len(self.candidates) > 1 else None

    @property
    def margin_abs(self) -> float | None:
        """The same lead in the figure's own unit (seconds for a step time)."""
        return self.candidates[1][1] - self.candidates[0][1] if len(self.candidates) > 1 else None

    @property
    def runner_up(self) -> Any:
        return self.candidates[1][0] if len(self.candidates) > 1 else None

    @property
    def gaps(self) -> list[float]:
        """Relative gaps between neighbouring candidates (``gaps``)."""
        return _relative_gaps([c[1] for c in self.candidates])


def decide(ordered_points: list[dict], metric: Key, label: Key, ranking: bool = False,
           tie_within: float = TIE_WITHIN, alone: str = "the only candidate") -> Decision:
    """The ``Decision`` an ``ordered`` list makes: each point labelled by ``label``, by
    its ``metric`` (a string key names the figure; a callable is named ``metric``)."""
    name = metric if isinstance(metric, str) else "metric"
    cands = tuple((value(p, label), value(p, metric)) for p in ordered_points)
    return Decision(name, cands, ranking=ranking, tie_within=tie_within, alone=alone)


def best_capacity_factor(points: Iterable[dict], time_key: Key = "sim_step_s",
                         drop_key: Key = "sim.dropped_token_fraction", budget: float = DROP_BUDGET,
                         factor_key: Key = "router.capacity_factor") -> float | None:
    """The capacity factor with the shortest step among those dropping at most ``budget``
    of the routed slots (0 = dropless); None when every factor drops more."""
    best = best_point(points, time_key, feasible=at_most(drop_key, budget))
    return None if best is None else value(best, factor_key)
