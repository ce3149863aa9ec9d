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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import pairwise
from typing import Any

Key = str | Callable[[dict], Any]

#: the largest fraction of routed (token, expert) slots a "best" capacity factor may drop
#: (the same budget as experiments/sweep_capacity_factor.py)
DROP_BUDGET = 0.01


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
    vals = [value(p, metric) for p in ordered_points]
    return [(b - a) / a if a else (0.0 if b == a else float("inf")) for a, b in pairwise(vals)]


def best_capacity_factor(points: Iterable[dict], time_key: Key = "sim_step_s",
                         drop_key: Key = "sim.dropped_token_fraction", budget: float = DROP_BUDGET,
                         factor_key: Key = "router.capacity_factor") -> float | None:
    """The capacity factor with the shortest step among those dropping at most ``budget``
    of the routed slots (0 = dropless); None when every factor drops more."""
    best = best_point(points, time_key, feasible=at_most(drop_key, budget))
    return None if best is None else value(best, factor_key)
