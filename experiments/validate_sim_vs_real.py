"""How well does the simulator, calibrated to this machine, predict measured MoE steps?

One question, one grid. Every point runs on the real backend (measured) and then on the
simulator replaying that run's routing with the calibrated profile (simulated), so the
two differ only in how time is modelled. Per point: measured and simulated step time and
per-stage times, their relative error, and the stage most off.

``--fabric loopback`` (CPU ranks over this machine's loopback): token strategy x expert
sync x capacity factor x world size (2 and 4 ranks), and the whole transformer (attention,
dense layers, embeddings, Adam) with an MoE layer every layer or every other one; for every pair of strategies at the
same world size and capacity factor, measured and simulated speedup and whether the
simulator orders them the same way (pairs within ``--tie`` are reported, not scored).
GPU grid (only where CUDA is present, with ``--gpu-profile``, default "local-gpu", made
by ``testbed calibrate --device cuda``): page size (1-64 MB) x heat weights.

``--fabric emulated`` (root): 8 ranks on an emulated cluster (``real.network =
emulated``), 2 per node x 2 nodes x 2 micro-clusters and 4 x 2 x 1, over token strategy x
expert sync x placement x leaf-spine oversubscription x routing skew. Per point also the
wire bytes per level (kernel counters against the simulator's network), link
utilisation per level, the network's share of the measured step and the simulated
step's share from fitted constants; for every pair of points that differ in one knob,
measured and simulated speedup, direction and magnitude.

The profile (``--profile``; default "local", emulated "emulated-local") must come from a
separate ``testbed calibrate`` run on the same kind of device and network, and is refused
otherwise (``testbed.run.sources.check_calibration``; ``--allow-uncalibrated`` judges a
profile not made by it, and the report says so). Its ``[calibration]`` section lists the
scenarios whose runs were fitted: a point that shares one's model shape and token count
is refused (``check_out_of_sample``). The report states what calibration and validation
do share (``shared_settings``).

    testbed calibrate --name local
    python experiments/validate_sim_vs_real.py --quick --json
    testbed calibrate --fabric emulated --name emulated-local
    python experiments/validate_sim_vs_real.py --fabric emulated --quick --json
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

from testbed.core.errors import ScenarioError, run_as_command
from testbed.core.stages import STAGES, TOKEN_STAGES
from testbed.report.validation import write_validation_report
from testbed.report.validation_emulated import write_emulated_report
from testbed.run.backend import get_tool
from testbed.run.sources import calibrated_here, check_calibration, check_out_of_sample, shared_settings
from testbed.scenario.links import capacity_by_level
from testbed.scenario.profile import find_profile, load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.sections import EXPERT_SYNC_STRATEGIES, TOKEN_STRATEGIES
from testbed.scenario.topology import LEVELS
from testbed.study.sweep import Sweep, run_sweep

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"median_abs_error": 0.10, "max_abs_error": 0.25, "speedup_rank_agreement": 1.0}
EMULATED_GOALS = {"min_network_share": 0.50, "median_abs_error": 0.08, "max_abs_error": 0.20,
                  "speedup_direction_agreement": 1.0, "median_speedup_error_pp": 5.0,
                  "max_wire_bytes_error": 0.05, "max_fitted_share": 0.20}
#: stages whose work is a collective: their measured time is the network's share of a step
NETWORK_STAGES = TOKEN_STAGES + ("expert_sync", "dense_sync")
#: the knobs of the emulated grid, in the order points are named
KNOBS = ("cluster", "token_strategy", "expert_sync", "placement", "oversubscription", "skew")
CLUSTERS = {"2x2x2": (2, 2, 2), "4x2x1": (4, 2, 1)}


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


def whole_grid(quick: bool, output_dir: str, profile: str) -> list[tuple[dict, Scenario]]:
    """The whole transformer (issue 13) on ``cpu_base``'s 4 ranks: attention of 4 heads
    over sequences of 128 tokens, a vocabulary of 1,024, Adam; an MoE layer every layer or
    every other one, each token strategy with all-reduce sync (quick: all-to-all only).
    Calibration's whole-transformer scenarios use sequences of 64 and a vocabulary of
    384, and other hidden sizes and token counts."""
    tokens = ("alltoall",) if quick else TOKEN_STRATEGIES
    points = []
    for every, token in itertools.product((1, 2), tokens):
        s = cpu_base(4, output_dir, profile).replace(
            comm={"token_strategy": token, "expert_sync": "allreduce"},
            transformer={"enabled": True, "num_heads": 4, "seq_len": 128, "vocab_size": 1024, "moe_every": every})
        points.append(({"grid": "whole", "world": 4, "capacity_factor": 1.25, "moe_every": every,
                        "token_strategy": token, "expert_sync": "allreduce"}, s))
    return points


def gpus_here() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_grid(quick: bool, output_dir: str, profile: str) -> list[tuple[dict, Scenario]]:
    """Page size x heat weights on one GPU's worth of ranks (only with CUDA)."""
    gpus = gpus_here()
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


def emulated_base(cluster: str, output_dir: str, profile: str) -> Scenario:
    """8 CPU ranks on the emulated cluster, EP 4 (2 replicas of 16 experts); a model whose
    steps are network-bound at the emulated links' rates: H 256, F 128, 1024 tokens a rank
    routed to 3 experts each (3 MiB of routed slots a rank and layer). No calibration
    scenario shares its hidden size, token count or expert count. 5 steps, the first left
    out."""
    g, n, m = CLUSTERS[cluster]
    return Scenario.from_dict({
        "model": {"hidden_size": 256, "ffn_hidden_size": 128, "num_layers": 2, "num_experts": 16, "top_k": 3},
        "cluster": {"gpus_per_node": g, "nodes_per_microcluster": n, "microclusters": m, "profile": profile},
        "parallelism": {"ep_size": 4},
        "pager": {"page_size_bytes": "64KiB", "gpu_budget_bytes": "1536KiB"},
        "heat": {"update_interval": 3, "window_steps": 6},
        "workload": {"tokens_per_rank": 1024},
        "real": {"network": "emulated"},
        "run": {"steps": 5, "warmup_steps": 1, "output_dir": output_dir},
    })


def emulated_grid(quick: bool, output_dir: str, profile: str) -> list[tuple[dict, Scenario]]:
    """Token strategy x expert sync x placement x oversubscription x skew on 2 x 2 x 2
    (oversubscription 1 and 4), and the same without oversubscription on 4 x 2 x 1 (one
    micro-cluster: no spine). Combinations the scenario refuses (hierarchical all-to-all
    needs as many group members on every node) are left out.

    ``quick`` (14 points, every knob moved at least once against a common point): on
    2 x 2 x 2 all-to-all tokens with either sync, either placement and either
    oversubscription at skew 1, all-gather tokens with all-reduce sync without
    oversubscription, and one point at skew 0; on 4 x 2 x 1 all-to-all with all-reduce
    sync in either placement and all-gather in topology placement."""
    if quick:
        combos = [("2x2x2", "alltoall", sync, place, over, 1.0) for sync in EXPERT_SYNC_STRATEGIES
                  for place in ("topology", "strided") for over in (1.0, 4.0)]
        combos += [("2x2x2", "allgather", "allreduce", place, 1.0, 1.0) for place in ("topology", "strided")]
        combos += [("2x2x2", "alltoall", "allreduce", "topology", 1.0, 0.0)]
        combos += [("4x2x1", "alltoall", "allreduce", place, 1.0, 1.0) for place in ("topology", "strided")]
        combos += [("4x2x1", "allgather", "allreduce", "topology", 1.0, 1.0)]
    else:
        combos = [(cluster, token, sync, place, over, skew)
                  for cluster in CLUSTERS for token in TOKEN_STRATEGIES for sync in EXPERT_SYNC_STRATEGIES
                  for place in ("topology", "strided")
                  for over in ((1.0, 4.0) if CLUSTERS[cluster][2] > 1 else (1.0,)) for skew in (0.0, 1.0)]
    points = []
    for cluster, token, sync, placement, over, skew in combos:
        try:
            s = emulated_base(cluster, output_dir, profile).replace(
                comm={"token_strategy": token, "expert_sync": sync}, parallelism={"placement": placement},
                cluster={"leaf_spine_oversubscription": over}, workload={"skew": skew})
        except ScenarioError:
            continue
        points.append(({"grid": "emulated", "world": 8, "cluster": cluster, "token_strategy": token,
                        "expert_sync": sync, "placement": placement, "oversubscription": over, "skew": skew}, s))
    return points


def measure(label: dict, scenario: Scenario, reals: list[dict], sim: dict) -> dict:
    """One point from its runs (``run_sweep``): measured, the mean of ``reals``' medians
    (separate real runs; their spread is the run-to-run noise); simulated, ``sim``, the
    simulator replaying the first real run's routing (the same in every repeat: same
    seeds)."""
    real = reals[0]
    m, p = statistics.mean(r["step_time_s"] for r in reals), sim["step_time_s"]
    spread = (max(r["step_time_s"] for r in reals) - min(r["step_time_s"] for r in reals)) / m
    stages = {}
    for st in STAGES:
        rm = statistics.mean(r["stage_time_s"][st] for r in reals)
        sm = sim["stage_time_s"][st]
        if rm > 0 or sm > 0:
            stages[st] = {"measured_s": rm, "simulated_s": sm, "error_s": sm - rm}
    worst = max(stages, key=lambda st: abs(stages[st]["error_s"])) if stages else None
    out = dict(label, measured_step_s=m, simulated_step_s=p, rel_error=(p - m) / m, stages=stages,
               worst_stage=worst, run_to_run_spread=spread, real_runs=[r["run_dir"] for r in reals],
               real_run=real["run_dir"], sim_run=sim["run_dir"], fitted_share=sim.get("fitted_share"),
               shape=shape_of(scenario))
    if real.get("wire_bytes_by_level"):
        out.update(network_figures(scenario, reals, sim))
    return out


def shape_of(s: Scenario) -> str:
    """hidden x ffn x tokens per rank x experts: what calibration must not share."""
    m = s.model
    return f"{m.hidden_size}x{m.ffn_hidden_size}x{s.workload.tokens_per_rank}x{m.num_experts}"


def network_figures(scenario: Scenario, reals: list[dict], sim: dict) -> dict:
    """Emulated points: the network's share of the measured step (time in stages that are
    collectives), wire bytes per level (measured: kernel counters, mean over repeats;
    simulated: the network model) and link utilisation per level (wire bytes per step /
    (the level's directed link capacity x step time))."""
    m_step = statistics.mean(r["step_time_s"] for r in reals)
    share = statistics.mean(sum(r["stage_time_s"][st] for st in NETWORK_STAGES) / r["step_time_s"] for r in reals)
    wire_m = {lv: statistics.mean(r["wire_bytes_by_level"][lv] for r in reals) for lv in LEVELS[:3]}
    wire_s = sim["wire_bytes_by_level"]
    capacity = capacity_by_level(scenario.cluster, load_profile(scenario.cluster.profile))
    used = [lv for lv in LEVELS[:3] if wire_m[lv] > 0 or wire_s[lv] > 0]
    return {
        "network_share": share,
        "wire_bytes_by_level": {lv: {"measured": wire_m[lv], "simulated": wire_s[lv],
                                     "error": (wire_s[lv] - wire_m[lv]) / wire_m[lv] if wire_m[lv] else None}
                                for lv in used},
        "utilization_by_level": {lv: {"measured": wire_m[lv] / (capacity[lv] * m_step),
                                      "simulated": wire_s[lv] / (capacity[lv] * sim["step_time_s"])}
                                 for lv in used if capacity[lv] > 0},
    }


def knob_pairs(points: list[dict]) -> list[dict]:
    """Every pair of emulated points that differ in exactly one knob: measured and simulated
    speedup (time of a / time of b), whether they point the same way, and the error of the
    simulated speedup in percentage points. A pair is scored when its measured difference
    exceeds the run-to-run spread of both points."""
    pairs = []
    for a, b in itertools.combinations(points, 2):
        differ = [k for k in KNOBS if a[k] != b[k]]
        if len(differ) != 1:
            continue
        measured = a["measured_step_s"] / b["measured_step_s"]
        simulated = a["simulated_step_s"] / b["simulated_step_s"]
        spread = max(a["run_to_run_spread"], b["run_to_run_spread"])
        pairs.append({"a": _name(a), "b": _name(b), "knob": differ[0], "world": a["world"],
                      "measured_speedup": measured, "simulated_speedup": simulated,
                      "scored": abs(measured - 1) > spread, "agree": (measured > 1) == (simulated > 1),
                      "error_pp": 100 * abs(simulated - measured)})
    return pairs


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
    if p["grid"] == "emulated":
        return (f"{p['cluster']} {p['token_strategy']}/{p['expert_sync']} {p['placement']} "
                f"over {p['oversubscription']:g} skew {p['skew']:g}")
    if p["grid"] == "whole":
        return f"whole, MoE every {p['moe_every']}: {p['token_strategy']}/{p['expert_sync']}"
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


def summarize_emulated(points: list[dict], pairs: list[dict]) -> dict:
    """The emulated grid's figures against ``EMULATED_GOALS``."""
    errors = [abs(p["rel_error"]) for p in points]
    scored = [q for q in pairs if q["scored"]]
    wire = [abs(w["error"]) for p in points for w in p.get("wire_bytes_by_level", {}).values() if w["error"] is not None]
    shares = [p["network_share"] for p in points if "network_share" in p]
    fitted = [p["fitted_share"] for p in points if p.get("fitted_share") is not None]
    out = {
        "median_abs_error": statistics.median(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
        "speedup_direction_agreement": (sum(q["agree"] for q in scored) / len(scored)) if scored else None,
        "median_speedup_error_pp": statistics.median(q["error_pp"] for q in pairs) if pairs else None,
        "max_wire_bytes_error": max(wire) if wire else None,
        "min_network_share": min(shares) if shares else None,
        "median_network_share": statistics.median(shares) if shares else None,
        "max_fitted_share": max(fitted) if fitted else None,
        "median_fitted_share": statistics.median(fitted) if fitted else None,
        "scored_pairs": len(scored), "pairs": len(pairs), "goals": EMULATED_GOALS,
    }
    met = {"min_network_share": lambda v, g: v >= g, "speedup_direction_agreement": lambda v, g: v >= g}
    out["goals_met"] = {k: (v is not None and met.get(k, lambda v, g: v <= g)(out[k], g))
                        for k, g in EMULATED_GOALS.items() for v in [out[k]]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small grid (a few minutes on a laptop)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--fabric", default="loopback", choices=("loopback", "emulated"),
                    help="ranks over this machine's loopback (default) or on the emulated cluster (root)")
    ap.add_argument("--profile", default=None, help="calibrated profile name (testbed calibrate --name NAME); "
                    "default local, emulated: emulated-local")
    ap.add_argument("--gpu-profile", default="local-gpu", help="the GPU grid's profile (testbed calibrate --device "
                    "cuda --name NAME; default local-gpu); the grid is left out where it is missing")
    ap.add_argument("--allow-uncalibrated", action="store_true", help="judge a profile not made by testbed "
                    "calibrate (the report says so); a profile calibrated on another device or network is still "
                    "refused")
    ap.add_argument("--output-dir", default="runs", help="run folders (finished runs are reused)")
    ap.add_argument("--report", default=None, help="default reports/validation.html (emulated: validation-emulated.html)")
    ap.add_argument("--fresh", action="store_true", help="measure again even where runs exist")
    ap.add_argument("--tie", type=float, default=0.05,
                    help="pairs whose measured times differ by less than this fraction are not scored "
                         "(run-to-run noise on a 2-core laptop is about 4%%)")
    ap.add_argument("--repeats", type=int, default=2, help="separate real runs per point (default 2)")
    args = ap.parse_args(argv)
    return run_as_command("validate_sim_vs_real", lambda: _run(args), "stopped; rerun to resume")


def provenance(grid: str, profile_name: str, points: list[tuple[dict, Scenario]], device: str, fabric: str,
               allow: bool, flag: str = "--profile", gpu: str = "") -> dict:
    """Refuse a profile that cannot judge ``points`` (``testbed.run.sources``) and return the
    report's statements on it: how it was made, that no point shares a fitted scenario's
    shape, and what calibration and validation share."""
    profile = load_profile(profile_name)
    made = check_calibration(profile, device, fabric, allow, flag, gpu)
    named = [(f"{_name(label)} x{label['world']}", s) for label, s in points]
    return {"grid": grid, "profile": profile.name, "made": made, "calibrated": profile.calibration.made_by_calibrate,
            "out_of_sample": check_out_of_sample(profile, named, flag), "shared": shared_settings(profile, named)}


def _missing_profile(flag: str, name: str, how: str) -> ScenarioError:
    return ScenarioError(flag, name, f"no such profile: run `testbed calibrate{how} --name {name}` first")


def _run(args) -> int:
    emulated = args.fabric == "emulated"
    args.profile = args.profile or ("emulated-local" if emulated else "local")
    args.report = args.report or str(ROOT / "reports" / ("validation-emulated.html" if emulated else "validation.html"))
    try:
        profile_path = find_profile(args.profile)
    except ScenarioError:
        raise _missing_profile("--profile", args.profile, " --fabric emulated" if emulated else "") from None
    left_out: list[str] = []
    if emulated:
        grid = emulated_grid(args.quick, args.output_dir, args.profile)
        checks = [provenance("emulated grid", args.profile, grid, "cpu", "emulated", args.allow_uncalibrated)]
        get_tool("net-check")()  # one clear line without root, before any run
    else:
        grid = (cpu_grid(args.quick, args.output_dir, args.profile)
                + whole_grid(args.quick, args.output_dir, args.profile))
        checks = [provenance("CPU grids", args.profile, grid, "cpu", "loopback", args.allow_uncalibrated)]
        if gpus_here():
            try:
                find_profile(args.gpu_profile)
            except ScenarioError:
                left_out.append(f"the GPU grid: no profile {args.gpu_profile} (testbed calibrate --device cuda "
                                f"--name {args.gpu_profile})")
                print(f"left out {left_out[-1]}", file=sys.stderr)
            else:
                gpu = gpu_grid(args.quick, args.output_dir, args.gpu_profile)
                checks.append(provenance("GPU grid", args.gpu_profile, gpu, "cuda", "device", args.allow_uncalibrated,
                                         "--gpu-profile", torch.cuda.get_device_name()))
                grid += gpu
    started = time.perf_counter()
    sweep = Sweep.of_scenarios(f"validate-{args.fabric}", [s for _, s in grid], backends=("sim", "real"),
                               repeats=args.repeats)
    result = run_sweep(sweep, fresh=args.fresh)
    points = []
    for i, (label, scenario) in enumerate(grid):
        reals = [result.summaries[(i, "real", r)] for r in range(args.repeats)]
        points.append(measure(label, scenario, reals, result.summaries[(i, "sim", 0)]))
        p = points[-1]
        print(f"{_name(p)} x{p['world']}: measured {p['measured_step_s'] * 1e3:.1f} ms, "
              f"simulated {p['simulated_step_s'] * 1e3:.1f} ms ({100 * p['rel_error']:+.1f}%)", file=sys.stderr)
    if emulated:
        pairs = knob_pairs(points)
        summary = summarize_emulated(points, pairs)
    else:
        pairs = speedups(points, args.tie)
        summary = summarize(points, pairs)
    result = dict(summary, fabric=args.fabric, profile=str(profile_path), points=points, speedup_pairs=pairs,
                  provenance=checks, allowed_uncalibrated=args.allow_uncalibrated, left_out=left_out,
                  profile_calibrated_here=calibrated_here(load_profile(args.profile)),
                  tie=args.tie, repeats=args.repeats, wall_s=time.perf_counter() - started,
                  median_run_to_run_spread=statistics.median(p["run_to_run_spread"] for p in points))
    report = (write_emulated_report if emulated else write_validation_report)(result, args.report)
    if args.json:
        print(json.dumps(result))
    elif emulated:
        print(f"median |error| {100 * result['median_abs_error']:.1f}%, worst {100 * result['max_abs_error']:.1f}%, "
              f"direction agreement {result['speedup_direction_agreement']} over {result['scored_pairs']} scored "
              f"pairs, median speedup error {result['median_speedup_error_pp']:.1f} pp, wire bytes within "
              f"{100 * result['max_wire_bytes_error']:.1f}%, network share >= {100 * result['min_network_share']:.0f}%, "
              f"fitted share <= {100 * result['max_fitted_share']:.0f}%; report {report}")
    else:
        print(f"median |error| {100 * result['median_abs_error']:.1f}%, worst {100 * result['max_abs_error']:.1f}%, "
              f"rank agreement {result['speedup_rank_agreement']} over {result['scored_pairs']} pairs; "
              f"report {report}")
    print(f"wrote {report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
