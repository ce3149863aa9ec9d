"""How fast the simulator evaluates layouts for a layout search (issue 27, item 2), with the fast
evaluation (``sim.representative_slice``, ``sim.step.representative_slice``) on.

    python benchmarks/plan_speed.py [--layouts 100] [--jobs 2] [--steps 1] [--full]

Prints the issue's two goal figures, measured on this machine:

1. seconds for one layout of the 2,048-GPU DeepSeek-V3 run
   (configs/published/deepseek-v3-2048-h800.toml), in this process after its imports (torch's
   among them, which a plan's worker processes pay once): the
   first evaluation (it routes) and a second one (the routed block cached for the process);
   goal <= 2 s. ``--full`` times the full simulation beside it.
2. the wall time of N layouts of Mixtral-8x22B on 1,024 H100
   (configs/published/mixtral-8x22b-1024-h100-mcore-gbs1024.toml): tensor, pipeline, expert
   and expert-tensor parallelism, the micro-batch and MoE folding over the layouts the
   simulator accepts (``testbed.study.layout_space.enumerate_layouts``; the dispatcher and
   GEMM dtype the published run's), N spread evenly over them, run by ``testbed.study.sweep.run_sweep``
   with ``--jobs`` processes (each writes its run folder, as a search's runs do), and that
   time scaled to 1,000 layouts; goal <= 5 minutes on 2 cores.

Each layout runs ``--steps`` steps (default 1, what a search ranks layouts by; no warm-up).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time

from testbed.core.errors import run_as_command
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.study.layout_space import enumerate_layouts, layout_scenario
from testbed.study.plan import overlap_of
from testbed.study.sweep import Sweep, run_sweep

DEEPSEEK = "configs/published/deepseek-v3-2048-h800.toml"
MIXTRAL = "configs/published/mixtral-8x22b-1024-h100-mcore-gbs1024.toml"


def scenario(path: str, out: str, steps: int, fast: bool):
    return load_scenario(path, [f"run.steps={steps}", "run.warmup_steps=0", f"run.output_dir={out}",
                                f"sim.representative_slice={'true' if fast else 'false'}"])


def deepseek_seconds(out: str, steps: int, full: bool) -> None:
    s = scenario(DEEPSEEK, out, steps, True)
    # the simulator's imports (simpy, networkx, the sim package) and first calls, on the quick start,
    # and torch's (about 1 s), which the scored routing needs and the quick start does not
    t = time.perf_counter()
    run_scenario(load_scenario("configs/quickstart.toml", ["run.steps=1", "run.warmup_steps=0",
                                                          f"run.output_dir={out}"]), "sim")
    importlib.import_module("testbed.policy.scored_routing")
    print(f"imports and the quick start first: {time.perf_counter() - t:.2f} s (once a process)")
    for label in ("first", "second (its routed block cached)"):
        t, cpu = time.perf_counter(), time.process_time()
        summary = run_scenario(s, "sim")
        dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
        note = summary.get("representative_slice", {})
        print(f"deepseek-v3-2048, fast, {label}: {dt:.2f} s wall, {dcpu:.2f} s CPU (all threads), step "
              f"{summary['step_time_s'] * 1e3:.1f} ms (slice: {note.get('reason')}; {note.get('routing')})")
    if full:
        t, cpu = time.perf_counter(), time.process_time()
        summary = run_scenario(scenario(DEEPSEEK, out, steps, False), "sim")
        print(f"deepseek-v3-2048, full: {time.perf_counter() - t:.2f} s wall, {time.process_time() - cpu:.2f} s CPU, "
              f"step {summary['step_time_s'] * 1e3:.1f} ms")


def mixtral_layouts(out: str, steps: int, n: int, jobs: int) -> None:
    base = scenario(MIXTRAL, out, steps, True)
    c, m = base.cluster, base.model
    nodes = c.microclusters * c.nodes_per_microcluster
    knobs = {
        "parallelism.tp_size": [1, 2, 4, 8],
        "parallelism.pp_size": [d for d in range(1, nodes + 1) if nodes % d == 0],
        "parallelism.ep_size": [d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0],
        "parallelism.etp_size": [1, 2, 4, 8],
        "workload.micro_batch_size": [1, 2],
        "parallelism.moe_layout": ["folded", "nested"],
    }
    t = time.perf_counter()
    # with TP, the TP collectives overlapped with the GEMMs (as the plan derives it; TP 1 has none to overlap)
    space = enumerate_layouts(base, knobs, derive=overlap_of)
    print(f"mixtral-8x22b-1024: {len(space.valid)} valid layouts of {space.size} ({time.perf_counter() - t:.1f} s "
          f"to enumerate); refused by {dict(space.refused)}")
    valid = space.valid
    step = max(1, len(valid) // n)
    chosen = valid[::step][:n]
    # each layout's own scenario (its tokens per GPU and micro-batches derived from the global batch)
    sweep = Sweep.of_scenarios("plan-speed", [layout_scenario(base, p) for p in chosen], repeats=1)
    t = time.perf_counter()
    result = run_sweep(sweep, jobs=jobs, fresh=True, progress=False)
    wall = time.perf_counter() - t
    ran = len(result.summaries)
    if result.skipped:
        print(f"  skipped {len(result.skipped)}: {result.skipped[0][1]}")
    sliced = sum(bool(x.get("representative_slice", {}).get("used")) for x in result.summaries.values())
    slowest = max(result.summaries.values(), key=lambda x: x.get("wall_time_s", 0))
    print(f"mixtral-8x22b-1024: {ran} layouts in {wall:.1f} s with {jobs} jobs ({wall / ran:.2f} s a layout, {sliced} "
          f"on a representative slice; slowest {slowest.get('wall_time_s', 0):.1f} s in its worker); 1,000 layouts: "
          f"{1000 * wall / ran / 60:.1f} min (scaled)")
    # the same layouts one after another in this process: CPU seconds, which other work on the
    # machine inflates less than the wall time
    some = chosen[::max(1, len(chosen) // 40)]
    run_scenario(layout_scenario(base, some[0]), "sim")  # imports and first-call costs
    cpu = time.process_time()
    for p in some:
        run_scenario(layout_scenario(base, p), "sim")
    each = (time.process_time() - cpu) / len(some)
    print(f"mixtral-8x22b-1024: {len(some)} of them in this process: {each:.2f} CPU s a layout; 1,000 layouts on "
          f"{jobs} cores at that rate: {1000 * each / jobs / 60:.1f} min")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", type=int, default=100, help="Mixtral layouts to run (spread over the valid ones)")
    ap.add_argument("--jobs", type=int, default=2, help="processes of the sweep")
    ap.add_argument("--steps", type=int, default=1, help="steps a layout runs")
    ap.add_argument("--full", action="store_true", help="time DeepSeek-V3's full simulation too (about a minute)")
    ap.add_argument("--skip-deepseek", action="store_true", help="leave out the DeepSeek-V3 figure")
    ap.add_argument("--skip-mixtral", action="store_true", help="leave out the Mixtral layouts")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        if not args.skip_deepseek:
            deepseek_seconds(out, args.steps, args.full)
        if not args.skip_mixtral:
            mixtral_layouts(out, args.steps, args.layouts, args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(run_as_command("plan_speed", main, "stopped"))
