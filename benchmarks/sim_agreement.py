"""How close the fast (analytic) mode comes to the flow (max-min fair) mode.

Runs scenarios where concurrent collectives share links, on 16, 64, 128 and 512 H200s
(profile ``h200``), with skewed routing (``workload.skew = 1``), an oversubscribed spine
(``cluster.leaf_spine_oversubscription`` 2 or 4) and several EP groups and replicas:

- ``strided``: EP groups spread over the whole cluster (``placement = "strided"``), so
  the all-to-alls of all groups cross the same leaf uplinks at once; two-stage sync;
- ``straddle+overlap``: groups laid out by topology, each across two micro-clusters
  (half its all-to-all crosses the spine), and the replicas' gradient all-reduce on the
  sync stream during the backward (``overlap.sync_with_backward``, M22): sync rings
  share NICs and uplinks with the backward's all-to-alls;
- ``two-stage+micro-batches``: the same layout, two-stage sync (many small rings of
  different experts at once) during the backward, and two micro-batches (M22).

Both modes run the same two steps with the same routing. Per scenario and size it prints
for the measured step the step time (``StepRecord.step_time_s``) and the time of every
communication stage (``stage_time_s``: mean over ranks of the stage's busy time, waits
for slower members included), analytic and flow, and their difference (analytic / flow
- 1). Median and worst |difference| are over every step and every communication stage of
at least 1% of its step (smaller ones are a few latencies; compute stages are the same
in both modes by construction). Goal (issue 11): median <= 5%, worst <= 10%.

    python benchmarks/sim_agreement.py                                # 16, 64, 128, 512 GPUs
    python benchmarks/sim_agreement.py --sizes 16,64                  # a quick look
    python benchmarks/sim_agreement.py --sizes 128 --scenarios strided
    python benchmarks/sim_agreement.py --seed 7                       # another routing draw

Flow mode runs with ``sim.step.flow_executor.run_flows`` where that module exists (flow mode
that reaches 512 GPUs in seconds), else with ``sim.step.schedule.run_flows`` (minutes at 512).
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np

import sim.backend
from sim.backend import SimBackend
from testbed.core.stages import STAGES
from testbed.scenario.file import load_scenario

if importlib.util.find_spec("sim.step.flow_executor") is not None:
    from sim.step.flow_executor import run_flows as fast_run_flows

    sim.backend.run_flows = fast_run_flows  # what the backend's flow mode calls (no-op once it does)

SIZES = (16, 64, 128, 512)
#: scenario -> GPUs -> (GPUs per node, nodes per micro-cluster, micro-clusters, EP size)
LAYOUTS = {
    "strided": {16: (8, 1, 2, 8), 64: (8, 2, 4, 16), 128: (8, 4, 4, 32), 512: (8, 8, 8, 32)},
    "straddle+overlap": {16: (4, 1, 4, 8), 64: (8, 1, 8, 16), 128: (8, 2, 8, 32), 512: (8, 2, 32, 32)},
    "two-stage+micro-batches": {16: (4, 1, 4, 8), 64: (8, 1, 8, 16), 128: (8, 2, 8, 32), 512: (8, 2, 32, 32)},
}
BASE = [  # MoE layers whose all-to-alls and expert sync take milliseconds on H200s
    "model.hidden_size=4096", "model.ffn_hidden_size=2048", "model.num_layers=2", "model.num_experts=64",
    "model.top_k=2", 'model.dtype="bf16"', 'cluster.profile="h200"', "pager.enabled=false",
    "workload.tokens_per_rank=4096", "workload.skew=1.0", "run.steps=2", "run.warmup_steps=1",
]
SCENARIOS = {
    "strided": ['parallelism.placement="strided"', 'comm.expert_sync="two_stage"',
                "cluster.leaf_spine_oversubscription=2.0"],
    "straddle+overlap": ['comm.expert_sync="allreduce"', "overlap.sync_with_backward=true",
                         "cluster.leaf_spine_oversubscription=4.0"],
    "two-stage+micro-batches": ['comm.expert_sync="two_stage"', "overlap.micro_batches=2",
                                "overlap.sync_with_backward=true", "cluster.leaf_spine_oversubscription=2.0"],
}
#: stages that run collectives (the others are compute, timed alike in both modes)
COMM_STAGES = ("route", "dispatch", "combine", "combine_backward", "dispatch_backward", "expert_sync",
               "dense_sync", "paging", "heat")
MIN_SHARE = 0.01  # stages below this share of their step are left out of the median and worst


def scenario(name: str, gpus: int, mode: str, seed: int = 0):
    per_node, nodes, mcs, ep = LAYOUTS[name][gpus]
    return load_scenario(None, BASE + SCENARIOS[name] + [
        f"cluster.gpus_per_node={per_node}", f"cluster.nodes_per_microcluster={nodes}",
        f"cluster.microclusters={mcs}", f"parallelism.ep_size={ep}", f'sim.network_model="{mode}"',
        f"workload.seed={seed}"])


def compare(name: str, gpus: int, seed: int = 0) -> tuple[list[dict], dict[str, float]]:
    """Rows (what, analytic s, flow s, difference) of the measured steps, and the wall
    seconds of each mode's run."""
    records, wall = {}, {}
    for mode in ("analytic", "flow"):
        t0 = time.perf_counter()
        records[mode] = SimBackend().run(scenario(name, gpus, mode, seed)).records
        wall[mode] = time.perf_counter() - t0
    rows = []
    warmup = scenario(name, gpus, "analytic", seed).run.warmup_steps
    for a, f in list(zip(records["analytic"], records["flow"]))[warmup:]:
        rows.append(row(name, gpus, f"step {a.step}", a.step_time_s, f.step_time_s, True))
        for stage in (s for s in STAGES if s in COMM_STAGES):
            ta, tf = a.stage_time_s.get(stage, 0.0), f.stage_time_s.get(stage, 0.0)
            if ta or tf:
                rows.append(row(name, gpus, f"  {stage}", ta, tf, tf >= MIN_SHARE * f.step_time_s))
    return rows, wall


def row(name: str, gpus: int, what: str, analytic_s: float, flow_s: float, counted: bool) -> dict:
    diff = analytic_s / flow_s - 1 if flow_s > 0 else float("inf")
    return {"scenario": name, "gpus": gpus, "what": what, "analytic_s": analytic_s, "flow_s": flow_s,
            "diff": diff, "counted": counted}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help=f"comma-separated GPU counts, of {', '.join(map(str, SIZES))}")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--seed", type=int, default=0, help="workload.seed: the routing draw (default 0)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    names = args.scenarios.split(",")
    for x in sizes:
        if x not in SIZES:
            ap.error(f"--sizes: {x} is not one of {', '.join(map(str, SIZES))}")
    for n in names:
        if n not in SCENARIOS:
            ap.error(f"--scenarios: {n!r} is not one of {', '.join(SCENARIOS)}")
    print(f"flow mode: {sim.backend.run_flows.__module__}.run_flows")
    print(f"{'scenario':<24} {'GPUs':>5} {'what':<20} {'analytic ms':>12} {'flow ms':>10} {'diff':>8}")
    counted = []
    for name in names:
        for gpus in sizes:
            rows, wall = compare(name, gpus, args.seed)
            s = scenario(name, gpus, "analytic")
            print(f"{name:<24} {gpus:>5} {s.world_size // s.parallelism.ep_size} EP groups on "
                  f"{s.cluster.microclusters} leaves; wall s: analytic {wall['analytic']:.1f}, flow {wall['flow']:.1f}")
            for r in rows:
                note = "" if r["counted"] else f"  (< {MIN_SHARE:.0%} of step)"
                print(f"{'':<24} {'':>5} {r['what']:<20} {r['analytic_s'] * 1e3:>12.3f} {r['flow_s'] * 1e3:>10.3f} "
                      f"{r['diff']:>+8.1%}{note}", flush=True)
            counted += [r for r in rows if r["counted"]]
    diffs = np.abs([r["diff"] for r in counted])
    worst = counted[int(np.argmax(diffs))]
    print(f"\n{len(diffs)} figures (steps, and stages of >= {MIN_SHARE:.0%} of their step): median |diff| "
          f"{np.median(diffs):.1%}, worst {diffs.max():.1%} ({worst['scenario']}, {worst['gpus']} GPUs, "
          f"{worst['what'].strip()}); goal: median <= 5%, worst <= 10%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
