"""How well does the simulator, calibrated to this machine, predict measured MoE steps?

One question, one grid. Every point runs on the real backend (measured) and then on the
simulator replaying that run's routing with the calibrated profile (simulated), so the
two differ only in how time is modelled. Per point: measured and simulated step time and
per-stage times, their relative error, and the stage most off. For every pair of
strategies at the same world size and capacity factor: measured and simulated speedup,
and whether the simulator orders them the same way (pairs the measurement cannot tell
apart, within ``--tie`` relative difference, are reported but not scored).

CPU grid: token strategy x expert sync x capacity factor x world size (2 and 4 ranks).
GPU grid (only where CUDA is present): page size (1-64 MB) x heat weights.
The profile (``--profile``, default "local") must come from a separate
``testbed calibrate --name local`` run: the points judged here are never fitted.

    testbed calibrate --name local
    python experiments/validate_sim_vs_real.py --quick --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from testbed.errors import ScenarioError, run_as_command
from testbed.profile import find_profile
from testbed.runner import run_scenario
from testbed.scenario import EXPERT_SYNC_STRATEGIES, TOKEN_STRATEGIES, Scenario
from testbed.stages import STAGES
from testbed.validation_report import write_validation_report

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"median_abs_error": 0.10, "max_abs_error": 0.25, "speedup_rank_agreement": 1.0}


def cpu_base(world: int, output_dir: str, profile: str) -> Scenario:
    """World 2: one EP group of 2; world 4: 2 nodes of 2, EP 2 x 2 replicas."""
    return Scenario.from_dict({
        "model": {"hidden_size": 128, "ffn_hidden_size": 256, "num_layers": 2, "num_experts": 8},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": world // 2, "microclusters": 1,
                    "profile": profile},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": "64KiB", "gpu_budget_bytes": "1536KiB"},
        "heat": {"update_interval": 4, "window_steps": 8},
        "workload": {"tokens_per_rank": 512},
        "run": {"steps": 30, "warmup_steps": 3, "output_dir": output_dir},
    })


def cpu_grid(quick: bool, output_dir: str, profile: str) -> list[tuple[dict, Scenario]]:
    capacities = (1.25,) if quick else (1.0, 1.25, 0.0)
    points = []
    for world, cap, token, sync in itertools.product((2, 4), capacities, TOKEN_STRATEGIES, EXPERT_SYNC_STRATEGIES):
        s = cpu_base(world, output_dir, profile).replace(
            comm={"token_strategy": token, "expert_sync": sync}, router={"capacity_factor": cap})
        points.append(({"grid": "cpu", "world": world, "capacity_factor": cap, "token_strategy": token,
                        "expert_sync": sync}, s))
    return points


def gpu_grid(quick: bool, output_dir: str, profile: str) -> list[tuple[dict, Scenario]]:
    """Page size x heat weights on one GPU's worth of ranks (only with CUDA)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return []
    pages = ("1MiB", "16MiB") if quick else ("1MiB", "4MiB", "16MiB", "64MiB")
    weights = ((0.5, 0.3, 0.2),) if quick else ((0.5, 0.3, 0.2), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0))
    points = []
    for page, (a, b, c) in itertools.product(pages, weights):
        s = Scenario.from_dict({
            "model": {"hidden_size": 2048, "ffn_hidden_size": 1408, "num_layers": 4, "num_experts": 16,
                      "dtype": "bf16"},
            "cluster": {"gpus_per_node": gpus, "nodes_per_microcluster": 1, "microclusters": 1, "profile": profile},
            "parallelism": {"ep_size": gpus},
            "pager": {"page_size_bytes": page, "gpu_budget_bytes": "1GiB"},
            "heat": {"alpha": a, "beta": b, "gamma": c, "update_interval": 2, "window_steps": 4},
            "workload": {"tokens_per_rank": 4096},
            "real": {"device": "cuda"},
            "run": {"steps": 8, "warmup_steps": 2, "output_dir": output_dir},
        })
        points.append(({"grid": "gpu", "world": gpus, "page_size": page, "heat": [a, b, c]}, s))
    return points


def measure(label: dict, scenario: Scenario, fresh: bool, repeats: int) -> dict:
    """Measured: the mean of ``repeats`` separate real runs' medians (their spread is the
    run-to-run noise); simulated: the simulator replaying the first run's routing (the
    routing is the same in every repeat: same seeds)."""
    reals = [run_scenario(scenario.replace(run={"output_dir": f"{scenario.run.output_dir}/repeat{i}"}), "real",
                          reuse=not fresh) for i in range(repeats)]
    real = reals[0]
    sim = run_scenario(scenario.replace(workload={"trace": real["run_dir"]}), "sim", reuse=not fresh)
    m, p = statistics.mean(r["step_time_s"] for r in reals), sim["step_time_s"]
    spread = (max(r["step_time_s"] for r in reals) - min(r["step_time_s"] for r in reals)) / m
    stages = {}
    for st in STAGES:
        rm = statistics.mean(r["stage_time_s"][st] for r in reals)
        sm = sim["stage_time_s"][st]
        if rm > 0 or sm > 0:
            stages[st] = {"measured_s": rm, "simulated_s": sm, "error_s": sm - rm}
    worst = max(stages, key=lambda st: abs(stages[st]["error_s"])) if stages else None
    return dict(label, measured_step_s=m, simulated_step_s=p, rel_error=(p - m) / m, stages=stages,
                worst_stage=worst, run_to_run_spread=spread, real_runs=[r["run_dir"] for r in reals],
                real_run=real["run_dir"], sim_run=sim["run_dir"])


def speedups(points: list[dict], tie: float) -> list[dict]:
    """Every pair of strategies at the same (grid, world, capacity / page, heat)."""
    def setting(p):
        return tuple(p.get(k) for k in ("grid", "world", "capacity_factor", "page_size")) + (str(p.get("heat")),)

    pairs = []
    by_setting: dict[tuple, list[dict]] = {}
    for p in points:
        by_setting.setdefault(setting(p), []).append(p)
    for group in by_setting.values():
        for a, b in itertools.combinations(group, 2):
            measured = b["measured_step_s"] / a["measured_step_s"]
            simulated = b["simulated_step_s"] / a["simulated_step_s"]
            scored = abs(measured - 1) > tie
            pairs.append({"a": _name(a), "b": _name(b), "world": a["world"], "measured_speedup": measured,
                          "simulated_speedup": simulated, "scored": scored,
                          "agree": (measured > 1) == (simulated > 1)})
    return pairs


def _name(p: dict) -> str:
    if p["grid"] == "gpu":
        return f"page {p['page_size']} heat {p['heat']}"
    return f"{p['token_strategy']}/{p['expert_sync']} cf={p['capacity_factor']}"


def summarize(points: list[dict], pairs: list[dict]) -> dict:
    errors = [abs(p["rel_error"]) for p in points]
    scored = [q for q in pairs if q["scored"]]
    return {
        "median_abs_error": statistics.median(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
        "speedup_rank_agreement": (sum(q["agree"] for q in scored) / len(scored)) if scored else None,
        "speedup_rank_agreement_all_pairs": (sum(q["agree"] for q in pairs) / len(pairs)) if pairs else None,
        "scored_pairs": len(scored), "pairs": len(pairs), "goals": GOALS,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small grid (a few minutes on a laptop)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--profile", default="local", help="calibrated profile name (testbed calibrate --name NAME)")
    ap.add_argument("--output-dir", default="runs", help="run folders (finished runs are reused)")
    ap.add_argument("--report", default=str(ROOT / "reports" / "validation.html"))
    ap.add_argument("--fresh", action="store_true", help="measure again even where runs exist")
    ap.add_argument("--tie", type=float, default=0.05,
                    help="pairs whose measured times differ by less than this fraction are not scored "
                         "(run-to-run noise on a 2-core laptop is about 4%%)")
    ap.add_argument("--repeats", type=int, default=2, help="separate real runs per point (default 2)")
    args = ap.parse_args(argv)
    return run_as_command("validate_sim_vs_real", lambda: _run(args), "stopped; rerun to resume")


def _run(args) -> int:
    try:
        profile_path = find_profile(args.profile)
    except ScenarioError:
        raise ScenarioError("--profile", args.profile,
                            f"no such profile: run `testbed calibrate --name {args.profile}` first") from None
    grid = cpu_grid(args.quick, args.output_dir, args.profile) + gpu_grid(args.quick, args.output_dir, args.profile)
    points = []
    started = time.perf_counter()
    for i, (label, scenario) in enumerate(grid, 1):
        points.append(measure(label, scenario, args.fresh, args.repeats))
        p = points[-1]
        print(f"[{i}/{len(grid)}] {_name(p)} x{p['world']}: measured {p['measured_step_s'] * 1e3:.1f} ms, "
              f"simulated {p['simulated_step_s'] * 1e3:.1f} ms ({100 * p['rel_error']:+.1f}%) "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    pairs = speedups(points, args.tie)
    result = dict(summarize(points, pairs), profile=str(profile_path), points=points, speedup_pairs=pairs,
                  tie=args.tie, repeats=args.repeats,
                  median_run_to_run_spread=statistics.median(p["run_to_run_spread"] for p in points))
    report = write_validation_report(result, args.report)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"median |error| {100 * result['median_abs_error']:.1f}%, worst {100 * result['max_abs_error']:.1f}%, "
              f"rank agreement {result['speedup_rank_agreement']} over {result['scored_pairs']} pairs; "
              f"report {report}")
    print(f"wrote {report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
