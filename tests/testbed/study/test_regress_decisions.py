"""Decisions with their margins and ties (``testbed.study.decisions.Decision``) and how the
golden file compares them (``testbed.study.golden_compare.decision_holds``): a tie holds whichever of
its candidates is best and fails when it breaks beyond its margin, widens, or another
candidate wins; a single candidate carries no information; a ranking holds tier by tier.
Pure: made-up candidates, no sweep runs."""

from __future__ import annotations

import json

import pytest

from testbed.study import decisions as D
from testbed.study import golden as G
from testbed.study import golden_compare as C


def _best(*cands, tie=0.01, ranking=False):
    """A decision's golden-file entry from (label, seconds) candidates, best first."""
    return json.loads(json.dumps(G.decision_json(D.Decision("sim_step_s", tuple(cands), ranking=ranking,
                                                            tie_within=tie))))


def test_tiers_start_at_a_leader_and_take_what_is_within_the_margin():
    assert D.tiers([1.0, 1.005, 1.0099, 1.02, 1.025, 2.0], 0.01) == [[0, 1, 2], [3, 4], [5]]
    assert D.tiers([1.0, 1.0, 1.001], 0.0) == [[0, 1], [2]]  # no margin: only equal figures tie
    assert D.tiers([], 0.01) == []


def test_a_decision_records_its_margin_ties_and_no_information():
    choice = D.Decision("sim_step_s", (("a", 1.0), ("b", 1.02), ("c", 1.5)))
    assert choice.outcome == "choice" and choice.value == ["a"] and choice.runner_up == "b"
    assert choice.margin == pytest.approx(0.02, rel=1e-12) and choice.margin_abs == pytest.approx(0.02, rel=1e-12)
    tie = D.Decision("sim_step_s", (("a", 1.0), ("b", 1.00035), ("c", 1.5)))
    assert tie.outcome == "tie" and tie.value == ["a", "b"] and tie.margin == pytest.approx(3.5e-4, rel=1e-9)
    alone = D.Decision("sim_step_s", (("a", 1.0),), alone="the only factor within the drop budget")
    assert alone.outcome == "no information" and alone.value == ["a"] and alone.margin is None
    assert G.decision_json(alone)["why"] == "the only factor within the drop budget"
    assert D.Decision("sim_step_s", ()).outcome == "no information"
    ranking = D.Decision("sim_step_s", (("a", 1.0), ("b", 1.1), ("c", 1.105)), ranking=True)
    assert ranking.outcome == "ranking" and ranking.value == [["a"], ["b", "c"]]
    assert ranking.gaps == pytest.approx([0.1, 0.005 / 1.1], rel=1e-9)


def test_decide_reads_labels_and_figures_off_ordered_points():
    pts = [{"x": 2, "t": 1.0}, {"x": 1, "t": 1.001}, {"x": 3, "t": 1.5}]
    d = D.decide(pts, "t", "x")
    assert d.figure == "t" and d.candidates == ((2, 1.0), (1, 1.001), (3, 1.5)) and d.value == [2, 1]


# ---- a tie holds whichever tied candidate is best ----------------------------------------
GOLDEN_TIE = _best(("a", 1.0), ("b", 1.00035), ("c", 1.05))


@pytest.mark.parametrize("now, holds, change", [
    ((("a", 2.0), ("b", 2.001), ("c", 2.2)), True, "same"),            # figures moved, the same tie
    ((("b", 1.0), ("a", 1.003), ("c", 1.05)), True, "same"),           # the other tied one is best now
    ((("a", 1.0), ("b", 1.02), ("c", 1.05)), False, "tie broken: b now beyond 1%"),
    ((("a", 1.0), ("b", 1.001), ("c", 1.002)), False, "tie widened to c"),
    ((("c", 1.0), ("a", 1.03), ("b", 1.031)), False, "flipped"),        # another candidate wins
    ((("c", 1.0), ("a", 1.003), ("b", 1.1)), False, "flipped"),         # ... inside the margin of a tied one
    ((("a", 1.0),), False, "no information now (one candidate)"),
])
def test_a_golden_tie(now, holds, change):
    assert C.decision_holds(GOLDEN_TIE, _best(*now)) == (holds, change)


def test_a_golden_choice_fails_when_it_becomes_a_tie_or_another_wins():
    golden = _best(("a", 1.0), ("b", 1.05))
    assert C.decision_holds(golden, _best(("a", 1.0), ("b", 1.03))) == (True, "same")
    assert C.decision_holds(golden, _best(("a", 1.0), ("b", 1.005))) == (False, "now a tie with b")
    assert C.decision_holds(golden, _best(("b", 1.0), ("a", 1.05))) == (False, "flipped")


def test_no_information_must_stay_so():
    golden = _best((0.0, 1.0))
    assert C.decision_holds(golden, _best((0.0, 2.0))) == (True, "same")
    assert C.decision_holds(golden, _best((0.0, 1.0), (2.0, 1.5))) == (False, "carries information now (2 candidates)")


def test_the_golden_tie_margin_cuts_the_current_candidates():
    # a tie margin loosened by hand in the file: the current candidates are cut at it
    golden = _best(("a", 1.0), ("b", 1.02), tie=0.01)
    now = _best(("b", 1.0), ("a", 1.02), tie=0.01)
    assert not C.decision_holds(golden, now)[0]
    golden = {**golden, "tie_within": 0.05, "outcome": "tie", "value": ["a", "b"]}
    assert C.decision_holds(golden, now) == (True, "same")


def test_a_ranking_holds_tier_by_tier():
    golden = _best(("x", 1.0), ("y", 1.1), ("z", 1.105), ranking=True)  # x > y ~ z
    assert C.decision_holds(golden, _best(("x", 1.0), ("z", 1.1), ("y", 1.104), ranking=True)) == (True, "same")
    assert C.decision_holds(golden, _best(("x", 1.0), ("y", 1.1), ("z", 1.2), ranking=True)) == (False, "ties changed")
    assert C.decision_holds(golden, _best(("y", 1.0), ("x", 1.1), ("z", 1.2), ranking=True)) == (False, "reordered")
    assert C.decision_holds(golden, _best(("x", 1.0), ("y", 1.1), ranking=True)) == (False, "changed")


def test_the_tables_show_ties_choices_and_no_information():
    assert C.show_decision(GOLDEN_TIE) == "tie: a ~ b"
    assert C.show_decision(_best(("a", 1.0), ("b", 1.5))) == "a"
    assert C.show_decision(_best((0.0, 1.0))) == "0 (no information)"
    assert C.show_decision(_best(("x", 1.0), ("y", 1.1), ("z", 1.105), ranking=True)) == "x > y ~ z"
