"""``testbed regress``: the shipped golden file is what ``testbed regress --update`` writes
now; every decision carries its margin and its ties, a single candidate is no
information; simulated figures are compared to 1e-9, so a deterministic 1.9% regression
fails; the heat-weights sweep moves pages, a different number for every weighting; a
perturbed policy (capacity rounding) fails the regress; a decision that does not hold or
a metric past its tolerance exits 1 naming it; ``--update`` rewrites and prints the diff;
a missing golden file is one line and exit 2. The decision rules of ``testbed.study.decisions``
(ties and the comparing of decisions: tests/testbed/study/test_regress_decisions.py).

The suite's sweeps run once per module (``suite``: the CLI run against the shipped golden
file, with the current values it computed kept). The other tests compare those values
with a golden mapping made from them (``golden``: so they hold while the shipped file is
out of date, which only the first test reports) and edited copies of it, the CLI's
``run_suite`` replaced by the kept values.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math

import pytest

from testbed.cli.main import main as cli_main
from testbed.policy import controller
from testbed.study import decisions as D
from testbed.study import golden as golden_file
from testbed.study import golden_compare, regress


@pytest.fixture(scope="module")
def suite():
    """Run ``testbed regress`` once (as CI does) and keep its exit code, output and the
    current values its sweeps gave."""
    kept = {}
    real = regress.run_suite

    def spy(**kw):
        kept["current"] = real(**kw)
        return kept["current"]

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setattr(regress, "run_suite", spy)
        rc = cli_main(["regress", "--no-progress"])
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "current": kept.get("current")}


@pytest.fixture
def golden(suite):
    """A golden mapping of this tree's current values, to edit (a fresh copy per test)."""
    assert suite["current"] is not None, suite["err"]
    return json.loads(json.dumps(golden_file.golden_from(suite["current"])))


@pytest.fixture
def cached(suite, monkeypatch):
    """The CLI with ``run_suite`` answering the module's current values (no sweep reruns)."""
    assert suite["current"] is not None, suite["err"]
    monkeypatch.setattr(regress, "run_suite", lambda **kw: suite["current"])
    return suite["current"]


def _write(tmp_path, data, name="golden.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _run(path, capsys, *extra):
    rc = cli_main(["regress", "--golden", str(path), "--no-progress", *extra])
    return rc, capsys.readouterr().out


def _lines(out: str, name: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(name + " ")]


# ---- (1) the shipped golden file ---------------------------------------------------------
@pytest.mark.slow
def test_the_shipped_golden_file_is_what_update_writes_now(suite):
    # the one test that reads the shipped file: after a change of the model, a profile or a
    # policy it is out of date until regenerated (and the diff reviewed)
    shipped = json.loads(regress.GOLDEN.read_text())
    now = json.loads(golden_file.golden_text(golden_file.golden_from(suite["current"])))
    if shipped != now or suite["rc"] != 0:
        diff = (golden_compare.update_diff(shipped, now) if shipped.get("format") == golden_file.FORMAT
                else [f"format {shipped.get('format')} -> {golden_file.FORMAT}"])
        pytest.fail(f"{regress.GOLDEN} is out of date: regenerate it with `{golden_file.UPDATE_COMMAND}` and "
                    "review its diff:\n" + "\n".join(diff[:20]) + "\n" + suite["out"][-3000:] + suite["err"][-2000:])
    assert "regress: ok" in suite["out"]


def test_the_suite_covers_the_decisions_and_every_entry_has_its_reason(suite, golden):
    for name in golden["decisions"]:  # the short table lists every decision
        assert name in suite["out"]
    assert {"capacity_factor.best[skew=0]", "capacity_factor.best[skew=1.5]", "page_size.best", "heat_weights.best",
            "strategies.ranking", "placement.ranking[ep=2]", "placement.ranking[ep=4]"} == set(golden["decisions"])
    assert len(golden["decisions"]["strategies.ranking"]["candidates"]) == 6
    for name, e in golden["metrics"].items():
        assert isinstance(e["tolerance"], (int, float)) and e["reason"], name
    for name, e in golden["decisions"].items():
        assert e["tie_within"] == D.TIE_WITHIN and e["reason"] == D.TIE_REASON, name
    for name, s in golden["sweeps"].items():
        assert s["config"] and "set" in s and ("axes" in s or "points" in s), name
    # every entry begins with the name of the one sweep that makes it
    for section in ("decisions", "metrics"):
        for name in golden[section]:
            owners = [s for s in golden["sweeps"] if name.startswith((s + ".", s + "["))]
            assert len(owners) == 1, name


# ---- (2) decisions with their margins, ties and no information ---------------------------
def test_every_decision_records_its_margin_in_its_figure(golden):
    for name, e in golden["decisions"].items():
        figs = [fig for _, fig in e["candidates"]]
        assert e["figure"] == "sim_step_s" and figs == sorted(figs), name
        if len(figs) < 2:
            assert e["outcome"] == "no information" and e["margin"] is None, name
            continue
        assert e["runner_up"] == e["candidates"][1][0], name
        assert math.isclose(e["margin"], (figs[1] - figs[0]) / figs[0], rel_tol=1e-12), name
        assert math.isclose(e["margin_abs"], figs[1] - figs[0], rel_tol=1e-12), name
        # the best's tier: every candidate within 1% of the best's step, no other
        top = [label for label, fig in e["candidates"] if fig <= figs[0] * (1 + D.TIE_WITHIN)]
        decided = e["value"][0] if e["kind"] == "ranking" else e["value"]
        assert decided == top, name
        if e["kind"] == "best":
            assert e["outcome"] == ("tie" if len(top) > 1 else "choice"), name


def test_a_decision_with_one_feasible_candidate_is_no_information(suite, golden):
    # at skew 1.5 every capped factor drops more than 1% of the slots: dropless is the only
    # candidate, which is no choice, and the output says so
    e = golden["decisions"]["capacity_factor.best[skew=1.5]"]
    assert e["outcome"] == "no information" and e["value"] == [0.0] and len(e["candidates"]) == 1
    assert "within the drop budget" in e["why"]
    line = _lines(suite["out"], "capacity_factor.best[skew=1.5]")
    assert line and "no information" in line[0]
    for name, e in golden["decisions"].items():  # only decisions with two candidates or more are choices
        assert (e["outcome"] == "no information") == (len(e["candidates"]) < 2), name
    assert "with no information" in suite["out"].splitlines()[-1]


def test_a_tie_holds_whichever_tied_candidate_is_best_and_fails_when_it_breaks(cached, golden, tmp_path, capsys):
    # page_size: a golden run where the runner-up had led by the same margin, and both were
    # tied (tie_within wider than the margin): now's best is the other tied one, which holds
    name = "page_size.best"
    e = golden["decisions"][name]
    (best, t0), (second, t1) = e["candidates"][:2]
    assert t1 > t0
    e["tie_within"] = 1.5 * e["margin"]
    e["candidates"][:2] = [[second, t0], [best, t1]]
    tied = golden_compare.decision_at(e, e["tie_within"])
    assert tied["outcome"] == "tie" and tied["value"][:2] == [second, best]
    e.update(tied)
    rc, out = _run(_write(tmp_path, golden), capsys)
    assert rc == 0, out
    assert "regress: ok" in out
    # the same golden tie with a margin narrower than the lead: the tie broke, a failure
    e["tie_within"] = e["margin"] / 2
    rc, out = _run(_write(tmp_path, golden), capsys)
    assert rc == 1
    moved = _lines(out, name)
    assert moved and "tie broken" in moved[0] and "tie within" in moved[0]


def test_a_choice_that_became_a_tie_or_a_candidate_that_now_wins_exits_1(cached, golden, tmp_path, capsys):
    # page_size with a tie margin of half the best's lead: a choice, and it holds
    name = "page_size.best"
    e = golden["decisions"][name]
    e["tie_within"] = e["margin"] / 2
    e.update(golden_compare.decision_at(e, e["tie_within"]))
    assert e["outcome"] == "choice"
    assert _run(_write(tmp_path, golden), capsys)[0] == 0
    edited = copy.deepcopy(golden)
    edited["decisions"][name]["tie_within"] = 2 * e["margin"]  # the runner-up is inside the margin now
    rc, out = _run(_write(tmp_path, edited), capsys)
    assert rc == 1 and "now a tie with" in _lines(out, name)[0]
    edited = copy.deepcopy(golden)
    edited["decisions"][name]["value"] = [e["runner_up"]]  # the golden run had chosen the runner-up
    rc, out = _run(_write(tmp_path, edited), capsys)
    assert rc == 1 and "flipped" in _lines(out, name)[0]


# ---- (3) tolerances: simulated figures are deterministic ---------------------------------
def test_every_simulated_figure_is_compared_to_1e_9(golden):
    for name, e in golden["metrics"].items():
        assert 0 <= e["tolerance"] <= 1e-9, name


def test_a_deterministic_1_9_percent_step_time_regression_fails(cached, golden):
    name = "page_size.best.sim_step_s"
    now = copy.deepcopy(golden)
    now["metrics"][name]["value"] *= 1.019  # what a 2% tolerance let through
    bad = [r for r in golden_compare.compare(now, golden) if not r.ok]
    assert [r.name for r in bad] == [name] and bad[0].change == "+1.9%"
    now["metrics"][name]["value"] = golden["metrics"][name]["value"] * (1 + 1e-10)  # float rounding: within
    assert all(r.ok for r in golden_compare.compare(now, golden))


def test_a_metric_beyond_its_tolerance_exits_1(cached, golden, tmp_path, capsys):
    name = "page_size.best.sim_step_s"
    golden["metrics"][name]["value"] *= 1.05
    rc, out = _run(_write(tmp_path, golden), capsys)
    assert rc == 1
    lines = _lines(out, name)
    assert lines and "1e-09 rel" in lines[0] and "-4.76%" in lines[0]


def test_tolerances_come_from_the_golden_file(cached, golden, tmp_path):
    time_metric, bytes_metric = "page_size.best.sim_step_s", "strategies.best.bytes_by_level.spine"
    golden["metrics"][time_metric]["value"] *= 1.01
    path = _write(tmp_path, golden)
    assert golden_compare.check(cached, golden_file.load_golden(path), path, out=lambda *a: None) == 1
    golden["metrics"][time_metric]["tolerance"] = 0.02  # loosened by hand in the file (say a noisy source)
    assert golden_compare.check(cached, golden, path, out=lambda *a: None) == 0
    golden["metrics"][bytes_metric]["value"] += 1  # bytes are exact: one byte is a move
    lines: list[str] = []
    assert golden_compare.check(cached, golden, path, out=lines.append) == 1
    assert any(line.startswith(bytes_metric) for line in "\n".join(lines).splitlines())


# ---- (4) the heat-weights sweep: the policies act ----------------------------------------
def test_the_heat_weights_sweep_moves_pages_and_each_weighting_its_own_count(golden):
    m = golden["metrics"]
    # the best weights act: cold migrations (M13) and their reloads, not an idle policy
    assert m["heat_weights.best.page_moves_per_step"]["value"] > 0
    assert m["heat_weights.best.moves_by_reason.cold"]["value"] > 0
    assert m["heat_weights.best.moves_by_reason.prefetch"]["value"] > 0
    per = {k: e["value"] for k, e in m.items() if k.startswith("heat_weights[")}
    assert len(per) == len(regress.HEAT_SIMPLEX) == len(golden["decisions"]["heat_weights.best"]["candidates"])
    assert all(v > 0 for v in per.values())
    assert len(set(per.values())) == len(per), per  # every weighting moves a different number of pages


# ---- (5) a perturbed policy fails the regress --------------------------------------------
def _floor_capacity(tokens, top_k, num_experts, capacity_factor, ep_size=1, pad_to_ep=False):
    """M2's capacity rounded down instead of up (``testbed.policy.capacity.expert_capacity``)."""
    if capacity_factor == 0:
        return None
    return max(1, math.floor(tokens * top_k / num_experts * capacity_factor))


@pytest.mark.slow
def test_capacity_rounded_down_fails_the_regress(suite, tmp_path, monkeypatch, capsys):
    # the capacity-factor sweep alone, rerun in this process (jobs 1: the patch reaches it)
    # against the golden entries of this tree's unpatched run
    gold = golden_file.golden_from(suite["current"])
    gold = {**gold, **{sec: {k: v for k, v in gold[sec].items() if k.startswith("capacity_factor")}
                       for sec in ("sweeps", "decisions", "metrics")}}
    path = _write(tmp_path, gold)
    monkeypatch.setattr(regress, "SUITE", [s for s in regress.SUITE if s.name == "capacity_factor"])
    monkeypatch.setattr(controller, "expert_capacity", _floor_capacity)
    rc, out = _run(path, capsys, "--jobs", "1")
    assert rc == 1, out
    moved = {line.split()[0] for line in out.splitlines() if line.startswith("capacity_factor")}
    # only the factor whose capacity is not whole (1.1 x 64 slots = 70.4) drops more slots;
    # every other figure is the unpatched run's, in another process layout, to 1e-9
    assert moved == {"capacity_factor[skew=0,cf=1.1].dropped_token_fraction",
                     "capacity_factor[skew=1.5,cf=1.1].dropped_token_fraction"}, out


# ---- (6) decisions and metrics edited by hand --------------------------------------------
def test_a_flipped_decision_exits_1_and_the_table_names_it(cached, golden, tmp_path, capsys):
    name = "placement.ranking[ep=2]"
    tiers = golden["decisions"][name]["value"]
    assert len(tiers) >= 2, tiers  # topology leads strided by ~9% (a100-seed, 2 x 2 x 2)
    golden["decisions"][name]["value"] = [tiers[-1]] + tiers[:-1]
    rc, out = _run(_write(tmp_path, golden), capsys)
    assert rc == 1
    moved = _lines(out, name)
    assert moved and "reordered" in moved[0] and "tie within 1%" in moved[0]
    assert "name" in out and "golden" in out and "tolerance" in out  # the table's header
    assert "strategies.ranking" not in out  # only what moved


def test_two_tiers_swapped_in_a_ranking_exits_1(cached, golden, tmp_path, capsys):
    tiers = golden["decisions"]["strategies.ranking"]["value"]
    assert len(tiers) >= 2
    tiers[0], tiers[1] = tiers[1], tiers[0]
    rc, out = _run(_write(tmp_path, golden), capsys)
    assert rc == 1
    assert any("reordered" in line for line in _lines(out, "strategies.ranking"))


def test_compare_is_pure_over_the_current_values(cached, golden):
    # the comparison the CLI prints, on mappings alone: all rows ok, then one reordered
    assert all(r.ok for r in golden_compare.compare(cached, golden))
    edited = copy.deepcopy(golden)
    edited["decisions"]["placement.ranking[ep=2]"]["value"].reverse()
    bad = [r for r in golden_compare.compare(cached, edited) if not r.ok]
    assert [r.name for r in bad] == ["placement.ranking[ep=2]"] and bad[0].change == "reordered"


def test_an_entry_missing_on_one_side_or_a_redefined_sweep_exits_1(cached, golden):
    edited = copy.deepcopy(golden)
    del edited["metrics"]["page_size.best.peak_memory_bytes"]
    edited["metrics"]["page_size.best.gone"] = {"value": 1, "tolerance": 0, "reason": "x"}
    edited["sweeps"]["page_size"]["axes"]["pager.page_size_bytes"].pop()
    bad = {r.name: r.change for r in golden_compare.compare(cached, edited) if not r.ok}
    assert bad == {"page_size.best.peak_memory_bytes": "not in golden", "page_size.best.gone": "gone",
                   "sweep page_size": "redefined"}


# ---- (7) --update ------------------------------------------------------------------------
def test_update_rewrites_a_copy_and_prints_the_diff(cached, golden, tmp_path, capsys):
    name = "placement.ranking[ep=2]"
    old = golden["decisions"][name]
    old["value"].reverse()
    golden["metrics"]["heat_weights.best.sim_step_s"]["value"] *= 2
    path = _write(tmp_path, golden)
    assert cli_main(["regress", "--update", "--golden", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    now = golden_file.decision_json(cached["decisions"][name])
    assert f"{name}: {golden_compare.show_decision(old)} -> {golden_compare.show_decision(now)} (reordered)" in out
    assert "heat_weights.best.sim_step_s:" in out and "(-50%)" in out
    assert "2 changed" in out
    assert json.loads(path.read_text()) == json.loads(json.dumps(golden_file.golden_from(cached)))
    assert cli_main(["regress", "--golden", str(path), "--no-progress"]) == 0  # and it passes now
    assert "regress: ok" in capsys.readouterr().out


def test_update_writes_a_missing_golden_file(cached, tmp_path, capsys):
    path = tmp_path / "sub" / "new.json"
    assert cli_main(["regress", "--update", "--golden", str(path), "--no-progress"]) == 0
    assert "a new file" in capsys.readouterr().out
    assert golden_file.load_golden(path)["decisions"]


# ---- (8) a missing or unreadable golden file ---------------------------------------------
@pytest.mark.parametrize("content", [None, "{", '{"decisions": {}}',
                                     '{"format": 1, "sweeps": {}, "decisions": {}, "metrics": {}}'])
def test_a_missing_or_unreadable_golden_file_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, content):
    path = tmp_path / "golden.json"
    if content is not None:
        path.write_text(content)

    def no_sweeps(**kw):
        raise AssertionError("the sweeps ran before the golden file was read")

    monkeypatch.setattr(regress, "run_suite", no_sweeps)
    assert cli_main(["regress", "--golden", str(path), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and lines[0].startswith("testbed: error: --golden")


# ---- the decision rules ------------------------------------------------------------------
POINTS = [
    {"point": 0, "router.capacity_factor": 1.0, "workload.skew": 0.0, "sim_step_s": 1.0,
     "sim": {"dropped_token_fraction": 0.05, "moves_by_reason": {"cold": 3}}},
    {"point": 1, "router.capacity_factor": 1.5, "workload.skew": 0.0, "sim_step_s": 2.0,
     "sim": {"dropped_token_fraction": 0.0, "moves_by_reason": {"cold": 1}}},
    {"point": 2, "router.capacity_factor": 0.0, "workload.skew": 0.0, "sim_step_s": 2.0,
     "sim": {"dropped_token_fraction": 0.0, "moves_by_reason": {"cold": 0}}},
    {"point": 3, "router.capacity_factor": 1.0, "workload.skew": 1.5, "sim_step_s": 0.5,
     "sim": {"dropped_token_fraction": 0.3}},
    {"point": 4, "router.capacity_factor": 0.0, "workload.skew": 1.5, "sim_step_s": None, "sim": None},
]


def test_value_reads_point_keys_and_nested_paths():
    p = POINTS[0]
    assert D.value(p, "router.capacity_factor") == 1.0  # a key with a dot in it
    assert D.value(p, "sim.dropped_token_fraction") == 0.05
    assert D.value(p, "sim.moves_by_reason.cold") == 3
    assert D.value(p, "sim.nothing") is None and D.value(POINTS[4], "sim.dropped_token_fraction") is None
    assert D.value(p, lambda q: q["point"] + 1) == 1


def test_best_point_feasibility_ties_and_nothing_feasible():
    drop_ok = D.at_most("sim.dropped_token_fraction", D.DROP_BUDGET)
    assert D.best_point(POINTS[:3], "sim_step_s")["point"] == 0
    assert D.best_point(POINTS[:3], "sim_step_s", feasible=drop_ok)["point"] == 1  # tie: grid order
    assert D.best_point(POINTS[:3], "sim_step_s", feasible=drop_ok, tiebreak=["sim.moves_by_reason.cold"])["point"] == 2
    assert D.best_point(POINTS[3:], "sim_step_s", feasible=drop_ok) is None  # the unmeasured point takes no part
    assert D.best_capacity_factor(POINTS[:3]) == 1.5 and D.best_capacity_factor(POINTS[3:]) is None


def test_ranking_and_per_group_rules():
    assert D.ranking(POINTS[:3], "router.capacity_factor", "sim_step_s") == [1.0, 1.5, 0.0]
    label = D.joined("workload.skew", "router.capacity_factor")
    assert D.ranking(POINTS, label, "sim_step_s") == ["1.5/1.0", "0.0/1.0", "0.0/1.5", "0.0/0.0"]
    best = D.best_per_group(POINTS, "workload.skew", "sim_step_s",
                            feasible=D.at_most("sim.dropped_token_fraction", D.DROP_BUDGET))
    assert list(best) == [0.0, 1.5] and best[0.0]["point"] == 1 and best[1.5] is None
    per = D.ranking_per_group(POINTS, "workload.skew", "router.capacity_factor", "sim_step_s")
    assert per == {0.0: [1.0, 1.5, 0.0], 1.5: [1.0]}
    assert D.gaps(D.ordered(POINTS[:3], "sim_step_s"), "sim_step_s") == [1.0, 0.0]
