"""``testbed regress``: the suite passes against the shipped golden file; a flipped decision
or a metric past its tolerance exits 1 naming it; ``--update`` rewrites and prints the
diff; a missing golden file is one line and exit 2. The decision rules of
``testbed.decisions``.

The suite's sweeps run once per module (``suite``: the CLI run against the shipped golden
file, with the current values it computed kept); the other tests compare those values
with edited copies of the golden file, the CLI's ``run_suite`` replaced by the kept values.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json

import pytest

from testbed import cli, regress
from testbed import decisions as D
from testbed import golden as golden_file


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
        rc = cli.main(["regress", "--no-progress"])
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "current": kept.get("current")}


@pytest.fixture
def golden():
    """A fresh copy of the shipped golden mapping to edit."""
    return json.loads(regress.GOLDEN.read_text())


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


def _other(values, current):
    return next(v for v in values if v != current)


# ---- (1) the shipped golden file ---------------------------------------------------------
def test_regress_passes_against_the_shipped_golden_file(suite, golden):
    assert suite["rc"] == 0, suite["out"] + suite["err"]
    assert "regress: ok" in suite["out"]
    for name in golden["decisions"]:  # the short table lists every decision
        assert name in suite["out"]
    # the suite covers every decision the brief asks for, and runs in well under 2 minutes
    assert {"capacity_factor.best[skew=0]", "capacity_factor.best[skew=1.5]", "page_size.best", "heat_weights.best",
            "strategies.ranking", "placement.ranking[ep=2]"} <= set(golden["decisions"])
    assert len(golden["decisions"]["strategies.ranking"]["value"]) == 6
    assert suite["current"]["wall_s"] < 120
    # every entry carries its tolerance and a reason; every sweep its scenario keys
    for section in ("decisions", "metrics"):
        for name, e in golden[section].items():
            assert isinstance(e["tolerance"], (int, float)) and e["reason"], name
    for name, s in golden["sweeps"].items():
        assert s["config"] and "set" in s and ("axes" in s or "points" in s), name


def test_the_golden_file_is_what_update_writes_now(suite, golden):
    # rerunning --update would change nothing: the suite is deterministic and the file current
    assert json.loads(golden_file.golden_text(golden_file.golden_from(suite["current"]))) == golden


# ---- (2) a decision flipped by hand ------------------------------------------------------
def test_a_flipped_decision_exits_1_and_the_table_names_it(cached, golden, tmp_path, capsys):
    name = "capacity_factor.best[skew=0]"
    factors = golden["sweeps"]["capacity_factor"]["axes"]["router.capacity_factor"]
    golden["decisions"][name]["value"] = _other(factors, golden["decisions"][name]["value"])
    assert cli.main(["regress", "--golden", str(_write(tmp_path, golden)), "--no-progress"]) == 1
    out = capsys.readouterr().out
    moved = [line for line in out.splitlines() if line.startswith(name)]
    assert moved and "flipped" in moved[0] and "exact" in moved[0]
    assert "name" in out and "golden" in out and "tolerance" in out  # the table's header
    assert "strategies.ranking" not in out  # only what moved


def test_two_strategies_swapped_in_the_ranking_exits_1(cached, golden, tmp_path, capsys):
    ranking = golden["decisions"]["strategies.ranking"]["value"]
    ranking[1], ranking[2] = ranking[2], ranking[1]
    assert cli.main(["regress", "--golden", str(_write(tmp_path, golden)), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith("strategies.ranking") and "reordered" in line for line in out.splitlines())


def test_compare_is_pure_over_the_current_values(cached, golden):
    # the comparison the CLI prints, on mappings alone: all rows ok, then one flipped
    assert all(r.ok for r in golden_file.compare(cached, golden))
    edited = copy.deepcopy(golden)
    edited["decisions"]["placement.ranking[ep=2]"]["value"].reverse()
    bad = [r for r in golden_file.compare(cached, edited) if not r.ok]
    assert [r.name for r in bad] == ["placement.ranking[ep=2]"] and bad[0].change == "reordered"


# ---- (3) a metric moved beyond its tolerance ---------------------------------------------
def test_a_metric_beyond_its_tolerance_exits_1(cached, golden, tmp_path, capsys):
    name = "page_size.best.sim_step_s"
    assert golden["metrics"][name]["tolerance"] == 0.02
    golden["metrics"][name]["value"] *= 1.05
    assert cli.main(["regress", "--golden", str(_write(tmp_path, golden)), "--no-progress"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(name)]
    assert lines and "2%" in lines[0] and "-4.76%" in lines[0]


def test_tolerances_come_from_the_golden_file(cached, golden, tmp_path):
    time_metric, bytes_metric = "page_size.best.sim_step_s", "strategies.best.bytes_by_level.spine"
    golden["metrics"][time_metric]["value"] *= 1.01  # inside 2%
    path = _write(tmp_path, golden)
    assert golden_file.check(cached, golden_file.load_golden(path), path, out=lambda *a: None) == 0
    golden["metrics"][bytes_metric]["value"] += 1  # bytes are exact: one byte is a move
    lines: list[str] = []
    assert golden_file.check(cached, golden, path, out=lines.append) == 1
    assert any(line.startswith(bytes_metric) for line in "\n".join(lines).splitlines())
    golden["metrics"][bytes_metric]["tolerance"] = 0.01  # loosened by hand in the file
    assert golden_file.check(cached, golden, path, out=lambda *a: None) == 0


def test_an_entry_missing_on_one_side_or_a_redefined_sweep_exits_1(cached, golden):
    edited = copy.deepcopy(golden)
    del edited["metrics"]["page_size.best.peak_memory_bytes"]
    edited["metrics"]["page_size.best.gone"] = {"value": 1, "tolerance": 0, "reason": "x"}
    edited["sweeps"]["page_size"]["axes"]["pager.page_size_bytes"].pop()
    bad = {r.name: r.change for r in golden_file.compare(cached, edited) if not r.ok}
    assert bad == {"page_size.best.peak_memory_bytes": "not in golden", "page_size.best.gone": "gone",
                   "sweep page_size": "redefined"}


# ---- (4) --update ------------------------------------------------------------------------
def test_update_rewrites_a_copy_and_prints_the_diff(cached, golden, tmp_path, capsys):
    old_factor = _other([1.0, 1.1, 1.5], golden["decisions"]["capacity_factor.best[skew=0]"]["value"])
    golden["decisions"]["capacity_factor.best[skew=0]"]["value"] = old_factor
    golden["metrics"]["heat_weights.best.sim_step_s"]["value"] *= 2
    path = _write(tmp_path, golden)
    assert cli.main(["regress", "--update", "--golden", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    now = cached["decisions"]["capacity_factor.best[skew=0]"].value
    assert f"capacity_factor.best[skew=0]: {golden_file.show(old_factor)} -> {golden_file.show(now)} (flipped)" in out
    assert "heat_weights.best.sim_step_s:" in out and "(-50%)" in out
    assert "2 changed" in out
    assert json.loads(path.read_text()) == golden_file.golden_from(cached)
    assert cli.main(["regress", "--golden", str(path), "--no-progress"]) == 0  # and it passes now
    assert "regress: ok" in capsys.readouterr().out


def test_update_writes_a_missing_golden_file(cached, tmp_path, capsys):
    path = tmp_path / "sub" / "new.json"
    assert cli.main(["regress", "--update", "--golden", str(path), "--no-progress"]) == 0
    assert "a new file" in capsys.readouterr().out
    assert golden_file.load_golden(path)["decisions"]


# ---- (5) a missing or unreadable golden file ---------------------------------------------
@pytest.mark.parametrize("content", [None, "{", '{"decisions": {}}'])
def test_a_missing_or_unreadable_golden_file_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, content):
    path = tmp_path / "golden.json"
    if content is not None:
        path.write_text(content)

    def no_sweeps(**kw):
        raise AssertionError("the sweeps ran before the golden file was read")

    monkeypatch.setattr(regress, "run_suite", no_sweeps)
    assert cli.main(["regress", "--golden", str(path), "--no-progress"]) == 2
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
