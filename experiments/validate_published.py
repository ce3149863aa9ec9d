"""The simulator's GPU-scale predictions against published MoE training runs (issue 26).

    python experiments/validate_published.py [--quick] [--json]

Simulates every row of ``docs/published.md`` (``testbed.study.published_runs``) from its
scenario in ``configs/published/`` (one measured step on the file's profile), and reports
per row the predicted throughput against the published one and the error, the stage
breakdown, the peak memory and whether it fits; per published comparison (folding, fp8,
strong scaling, Megatron-Core against TP+EP+DP) the published and the predicted ratio;
DeepEP's dispatch and combine bandwidths on the h800 profile (``sim.step.deepep_bandwidth``)
against DeepEP's README; and the sensitivity of each prediction to every assumed constant of
its profile, moved -20% and +20% (``testbed.study.profile_sensitivity``; ``--quick`` moves
them for the first row's scenario only). Beside the judged table, the rows whose sources leave a
setting unstated are simulated again at that setting's other sourced value
(``testbed.study.published_runs.UNSTATED``), with the comparisons and goals the table would
then give: what the unstated setup is worth, never the judged figure. Nothing is fitted to a published figure, so
``fitted_share`` is the largest share of any simulated step from fitted constants (0 for the
built-in profiles, which fit nothing).

Writes ``reports/published.html`` and ``reports/published.csv`` (one row per run of the sweep,
the sensitivity runs included); ``--json`` prints the result as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from sim.step.deepep_bandwidth import bandwidths_GBps
from testbed.cli.experiment import writable_report
from testbed.core.errors import ScenarioError, run_as_command
from testbed.report.published_report import write_published_report
from testbed.run.features import check_features
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import load_profile
from testbed.study.experiments import ROOT
from testbed.study.profile_sensitivity import assumed_constants, moved, moved_profile_file, unread_by
from testbed.study.published_runs import DEEPEP_COMPARISONS, DEEPEP_ROWS, ROWS, UNSTATED, row
from testbed.study.published_validation import (
    DEEPEP_GOAL,
    MOVE,
    RowResult,
    Sensitivity,
    Simulated,
    comparisons,
    explain_miss,
    goals,
    under_setting,
)
from testbed.study.sweep import Sweep, run_sweep, write_table

NAME = "validate_published"
PUBLISHED = ROOT / "configs" / "published"
STEPS = ["run.steps=2", "run.warmup_steps=1"]  # one measured step: the simulator's steps repeat


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=NAME, description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the assumed constants moved for the first row only")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--jobs", type=int, default=None, help="parallel simulator processes (default: every core)")
    p.add_argument("--output-dir", default="runs", help="the run store (default runs)")
    p.add_argument("--report", default=None, metavar="FILE.html", help="default reports/published.html")
    p.add_argument("--fresh", action="store_true", help="run every point again, ignoring the sweep's index")
    p.add_argument("--seed", type=int, default=0, help="seed of DeepEP's test routing (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _load(config: str, args, overrides=()):
    """The published scenario ``config`` for one measured step, with ``overrides``; raises
    ScenarioError when the simulator cannot run it."""
    s = load_scenario(PUBLISHED / config, STEPS + [f"run.output_dir={args.output_dir}", *overrides])
    check_features(s, "sim")
    return s


def _scenarios(args) -> tuple[list, dict, dict, dict, dict, dict]:
    """(scenarios to run, config -> its index, (config, key, factor) -> its index or why the
    moved profile is not valid, config -> why it cannot be simulated, (config, key) -> why the
    scenario does not read that constant: not run, its moves change nothing, (unstated
    setting id, config) -> the index of the scenario at that setting or why it cannot be run)."""
    configs = list(dict.fromkeys(r.config for r in ROWS))
    moved_for = configs[:1] if args.quick else configs
    scenarios, base_of, moved_of, missing, unread_of, unstated_of = [], {}, {}, {}, {}, {}
    profiles = Path(args.output_dir) / NAME / "profiles"
    for setting in UNSTATED:
        for config in dict.fromkeys(row(rid).config for rid in setting.rows):
            try:
                unstated_of[(setting.id, config)] = len(scenarios)
                scenarios.append(_load(config, args, setting.overrides))
            except ScenarioError as e:
                unstated_of[(setting.id, config)] = str(e)
    for config in configs:
        try:
            s = _load(config, args)
        except ScenarioError as e:
            missing[config] = str(e)
            continue
        base_of[config] = len(scenarios)
        scenarios.append(s)
        if config not in moved_for:
            continue
        profile = load_profile(s.cluster.profile)
        for c in assumed_constants(profile):
            if not c.movable:
                continue
            if why := unread_by(s, c.key):
                unread_of[(config, c.key)] = why
                continue
            for factor in (1 - MOVE, 1 + MOVE):
                try:
                    path = moved_profile_file(profile, c.key, factor, profiles)
                    moved = s.replace(cluster={"profile": str(path)})
                except ScenarioError as e:
                    moved_of[(config, c.key, factor)] = str(e)
                    continue
                moved_of[(config, c.key, factor)] = len(scenarios)
                scenarios.append(moved)
    return scenarios, base_of, moved_of, missing, unread_of, unstated_of


def _summaries(sweep: Sweep, result) -> dict[int, dict]:
    """Scenario index -> its run's summary (points the sweep skipped are absent)."""
    grid, k, out = result.grid, 0, {}
    for j, point in enumerate(sweep.grid()):
        if k < len(grid) and grid[k] == point:
            if (k, "sim", 0) in result.summaries:
                out[j] = result.summaries[(k, "sim", 0)]
            k += 1
    return out


#: what a DeepEP kernel can be bound by: (name in the report, the profile figures of it)
DEEPEP_BOUNDS = (("NVLink", ("links.nvlink.bandwidth_GBps",)), ("NIC", ("links.nic.bandwidth_GBps",)),
                 ("DeepEP's forwarding kernels", ("collectives.deepep_dispatch_GBps", "collectives.deepep_combine_GBps")))


#: the small cut that tells which figure binds at the profile's values (a -20% cut can make
#: a figure within 20% of binding bind as well)
PROBE = 0.01


def _cut(profile, keys, factor: float):
    for key in keys:
        profile = moved(profile, key, factor)
    return profile


def _bound_by(ep: int, profile, seed: int, got: dict[str, float]) -> dict:
    """What the simulated kernel is bound by: the one of ``DEEPEP_BOUNDS`` whose -1% cut
    (``PROBE``) moves the dispatch's bandwidth most, with the same routing (seed). Each
    one's change per stage at -MOVE (-20%, a fraction) says how hard it binds or how near
    it is to binding."""
    changes, probed = {}, {}
    for name, keys in DEEPEP_BOUNDS:
        for factor, out in ((1 - PROBE, probed), (1 - MOVE, changes)):
            cut_GBps = bandwidths_GBps(ep, _cut(profile, keys, factor), np.random.default_rng([seed, ep]))
            out[name] = {stage: cut_GBps[stage] / got[stage] - 1 for stage in got}
    name, keys = min(DEEPEP_BOUNDS, key=lambda nk: probed[nk[0]]["dispatch"])
    return {"bound_by": name, "bound_key": keys[0], "link_changes": changes}


def _deepep(seed: int) -> list[dict]:
    profile = load_profile("h800")
    out = []
    for r in DEEPEP_ROWS:
        got = bandwidths_GBps(r.ep, profile, np.random.default_rng([seed, r.ep]))
        row = {"id": r.id, "kind": r.kind, "ep": r.ep, "link": r.link,
               "published_dispatch_GBps": r.dispatch_GBps, "published_combine_GBps": r.combine_GBps,
               "dispatch_GBps": got["dispatch"], "combine_GBps": got["combine"],
               "dispatch_error": got["dispatch"] / r.dispatch_GBps - 1, "combine_error": got["combine"] / r.combine_GBps - 1}
        row.update(_bound_by(r.ep, profile, seed, got))
        row.update(_deepep_why(row, profile))
        out.append(row)
    return out


def _deepep_why(row: dict, profile) -> dict[str, str]:
    """Where a DeepEP row misses ``DEEPEP_GOAL``: ``why``, the link its simulated time is
    bound by (from the -20% cuts) and that link's figure, and ``why_source``, the figure's
    source entry; both empty where the row is within."""
    if max(abs(row["dispatch_error"]), abs(row["combine_error"])) <= DEEPEP_GOAL:
        return {"why": "", "why_source": ""}
    key = row["bound_key"]
    value = profile.to_dict()
    for part in key.split("."):
        value = value[part]
    moves = ", ".join(f"{name} -20% moves the dispatch {100 * c['dispatch']:+.1f}%"
                      for name, c in row["link_changes"].items())
    return {"why": f"bound by {row['bound_by']} ({moves}): the simulated kernel moves its bytes at "
                   f"{key} = {value:g} GB/s, which DeepEP's kernels do not reach here",
            "why_source": profile.source_of(key)}


def _deepep_comparisons(rows: list[dict]) -> list[dict]:
    by = {r["id"]: r for r in rows}
    out = []
    for cid, what, num, den in DEEPEP_COMPARISONS:
        for stage in ("dispatch", "combine"):
            pub = by[num][f"published_{stage}_GBps"] / by[den][f"published_{stage}_GBps"]
            pred = by[num][f"{stage}_GBps"] / by[den][f"{stage}_GBps"]
            out.append({"id": f"{cid}-{stage}", "what": f"{what} ({stage})", "published": pub, "predicted": pred,
                        "direction_agrees": (pred > 1) == (pub > 1), "magnitude_gap": abs(pred - pub)})
    return out


def run(args) -> int:
    report = writable_report(args.report or ROOT / "reports" / "published.html")
    scenarios, base_of, moved_of, missing, unread_of, unstated_of = _scenarios(args)
    sweep = Sweep.of_scenarios(NAME + ("_quick" if args.quick else ""), scenarios, backends=("sim",), repeats=1)
    result = run_sweep(sweep, jobs=args.jobs, fresh=args.fresh, progress=not args.no_progress)
    summaries = _summaries(sweep, result)
    skipped = {str(p): why for p, why in result.skipped}
    results: dict[str, RowResult] = {}
    for r in ROWS:
        i = base_of.get(r.config)
        if i is None or i not in summaries:
            results[r.id] = RowResult(r, None, missing.get(r.config) or skipped.get(str(sweep.grid()[i]), "not run"))
            continue
        base = summaries[i]
        rr = RowResult(r, Simulated.of_summary(base))
        for key in dict.fromkeys(k for (c, k, _) in moved_of if c == r.config):
            changes, why = [], ""
            for factor in (1 - MOVE, 1 + MOVE):
                j = moved_of[(r.config, key, factor)]
                if isinstance(j, str) or j not in summaries:
                    changes.append(None)
                    why = j if isinstance(j, str) else skipped.get(str(sweep.grid()[j]), "not run")
                else:
                    changes.append(summaries[j]["step_time_s"] / base["step_time_s"] - 1)
            rr.sensitivities.append(Sensitivity(key, changes[0], changes[1], why))
        rr.sensitivities += [Sensitivity(key, 0.0, 0.0, f"not read: {why}")
                             for (c, key), why in unread_of.items() if c == r.config]
        results[r.id] = rr
    comps = comparisons(results)
    unstated = [_unstated_json(under_setting(results, setting, _covered(setting, unstated_of, summaries)),
                               unstated_of, skipped, sweep)
                for setting in UNSTATED]
    deepep = _deepep(args.seed)
    deepep_errors = [e for d in deepep for e in (d["dispatch_error"], d["combine_error"])]
    verdict = goals(list(results.values()), comps, deepep_errors)
    fitted = [s.get("fitted_share") or 0.0 for s in summaries.values()]
    verdict["fitted_share"] = max(fitted) if fitted else None
    table = write_table(result.rows(), report.with_suffix(".csv"))
    rows_out = [_row_json(rr) for rr in results.values()]
    out = {"experiment": NAME, "quick": args.quick, "rows": rows_out,
           "comparisons": [{"id": c.id, "what": c.what, "published": c.published, "predicted": c.predicted,
                            "direction_agrees": c.direction_agrees, "magnitude_gap": c.magnitude_gap,
                            "holds": c.holds} for c in comps],
           "deepep": deepep, "deepep_comparisons": _deepep_comparisons(deepep), "goals": verdict,
           "unstated": unstated,
           "assumed_constants": _assumed(results), "ran": result.ran, "wall_s": result.wall_s,
           "report": str(report), "table": str(table)}
    write_published_report(report, out)
    if args.json:
        print(json.dumps(out, default=str))
    else:
        _print(out)
    return 0


def _covered(setting, unstated_of: dict, summaries: dict) -> dict[str, RowResult]:
    """Row id -> the row simulated at ``setting`` (the rows whose run finished)."""
    out = {}
    for rid in setting.rows:
        r = row(rid)
        j = unstated_of.get((setting.id, r.config))
        if isinstance(j, int) and j in summaries:
            out[rid] = RowResult(r, Simulated.of_summary(summaries[j]))
    return out


def _unstated_json(u, unstated_of: dict, skipped: dict, sweep: Sweep) -> dict:
    """An unstated setting's table (``published_validation.UnstatedResult``) as JSON."""
    s, rows = u.setting, []
    for rid in s.rows:
        rr = u.rows.get(rid)
        if rr is None:
            j = unstated_of.get((s.id, row(rid).config))
            why = j if isinstance(j, str) else skipped.get(str(sweep.grid()[j]), "not run")
            rows.append({"id": rid, "config": row(rid).config, "predicted": None, "error": None, "missing": why})
            continue
        rows.append({"id": rid, "config": rr.row.config, "unit": rr.row.unit, "published": rr.row.value,
                     "predicted": rr.predicted, "error": rr.error, "missing": "", "run_dir": rr.sim.run_dir,
                     "step_time_s": rr.sim.step_time_s, "bubble_fraction": rr.sim.bubble_fraction,
                     "peak_memory_bytes": rr.sim.peak_memory_bytes, "fits": rr.sim.fits})
    return {"id": s.id, "what": s.what, "overrides": list(s.overrides), "source": s.source, "rows": rows,
            "comparisons": [{"id": c.id, "what": c.what, "published": c.published, "predicted": c.predicted,
                             "direction_agrees": c.direction_agrees, "magnitude_gap": c.magnitude_gap,
                             "holds": c.holds} for c in u.comparisons],
            "goals": u.goals}


def _row_json(rr: RowResult) -> dict:
    r, s = rr.row, rr.sim
    d = {"id": r.id, "config": r.config, "unit": r.unit, "published": r.value, "source": r.source, "weak": r.weak,
         "predicted": rr.predicted, "error": rr.error, "missing": rr.missing, "explanation": explain_miss(rr)}
    if s is not None:
        d.update({"run_dir": s.run_dir, "step_time_s": s.step_time_s, "tokens_per_s_per_gpu": s.tokens_per_s_per_gpu,
                  "tflops_per_gpu": s.tflops_per_gpu, "stage_time_s": s.stage_time_s,
                  "peak_memory_bytes": s.peak_memory_bytes, "device_memory_bytes": s.device_memory_bytes,
                  "fits": s.fits, "bubble_fraction": s.bubble_fraction})
    d["sensitivities"] = [{"key": x.key, "minus": x.minus, "plus": x.plus, "why": x.why} for x in rr.sensitivities]
    return d


def _assumed(results: dict[str, RowResult]) -> list[dict]:
    """Every assumed constant moved, with its largest effect on any row's step time."""
    by: dict[str, dict] = {}
    for rr in results.values():
        for x in rr.sensitivities:
            e = by.setdefault(x.key, {"key": x.key, "largest": 0.0, "row": None, "why": x.why})
            if x.size > e["largest"] or e["row"] is None:
                e.update(largest=x.size, row=rr.row.id, minus=x.minus, plus=x.plus)
    return sorted(by.values(), key=lambda e: -e["largest"])


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def _print(out: dict) -> None:
    print(f"{'row':<14} {'config':<44} {'unit':<12} {'published':>10} {'predicted':>10} {'error':>8}  fits")
    for r in out["rows"]:
        pub, pred = r["published"], r["predicted"]
        scale = 100 if r["unit"] == "mfu" else 1
        shown = "—" if pred is None else f"{pred * scale:.1f}"
        print(f"{r['id']:<14} {r['config']:<44} {r['unit']:<12} {pub * scale:>10.1f} {shown:>10} "
              f"{_pct(r['error']):>8}  {r.get('fits', '—')}" + (f"  [{r['missing']}]" if r["missing"] else ""))
    print("\ncomparisons (ratio of per-GPU throughput)")
    for c in out["comparisons"] + out["deepep_comparisons"]:
        pred = "—" if c["predicted"] is None else f"{c['predicted']:.3f}"
        print(f"  {c['what']:<58} published {c['published']:.3f}  predicted {pred}  "
              f"direction {'agrees' if c['direction_agrees'] else 'differs'}")
    print("\nDeepEP (h800 profile), GB/s")
    for d in out["deepep"]:
        print(f"  {d['id']:<9} {d['kind']:<10} EP {d['ep']:>3}  dispatch {d['published_dispatch_GBps']:.0f} -> "
              f"{d['dispatch_GBps']:.1f} ({_pct(d['dispatch_error'])})  combine {d['published_combine_GBps']:.0f} -> "
              f"{d['combine_GBps']:.1f} ({_pct(d['combine_error'])})  bound by {d['bound_by']}")
        if d["why"]:
            print(f"            why: {d['why']}")
    for u in out["unstated"]:
        print(f"\nunstated: {u['what']} ({', '.join(u['overrides'])}; {u['source']}); not judged")
        for r in u["rows"]:
            print(f"  {r['id']:<14} {r['config']:<44} " + (f"error {_pct(r['error'])}" if r["predicted"] is not None
                                                          else f"[{r['missing']}]"))
        for c in u["comparisons"]:
            pred = "—" if c["predicted"] is None else f"{c['predicted']:.3f}"
            print(f"  {c['what']:<58} published {c['published']:.3f}  predicted {pred}")
        ug = u["goals"]
        print(f"  the table so: median |error| {_pct(ug['median_abs_error'])}, worst {_pct(ug['worst_abs_error'])}, "
              f"comparisons within 5 points {ug['comparisons_within_magnitude']}/{ug['comparisons']}")
    g = out["goals"]
    print(f"\ngoals: median |error| {_pct(g['median_abs_error'])} (goal {100 * g['median_goal']:.0f}%: "
          f"{'met' if g['median_met'] else 'not met'}), worst {_pct(g['worst_abs_error'])} (goal "
          f"{100 * g['worst_goal']:.0f}%: {'met' if g['worst_met'] else 'not met'}); comparisons in direction "
          f"{g['comparisons_direction_agree']}/{g['comparisons']}, within 5 points {g['comparisons_within_magnitude']}"
          f"/{g['comparisons']}; DeepEP worst {_pct(g['deepep_worst_abs_error'])} (goal 15%: "
          f"{'met' if g['deepep_met'] else 'not met'}); fitted_share {g['fitted_share']}")
    print(f"wrote {out['report']} and {out['table']}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return run_as_command(NAME, lambda: run(args), "stopped; rerun to resume (finished runs are kept)")


if __name__ == "__main__":
    sys.exit(main())
