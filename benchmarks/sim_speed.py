"""How fast the simulator is, and how that grows with the cluster.

Runs the paper-1440 model (352B-class MoE, configs/paper-1440.toml) on 8, 64, 512 and
1,440 GPUs of 8 per node, in the fast (analytic) mode and the flow (max-min fair) mode,
and prints wall time per step and events per second. An *event* is one phase executed
on one GPU (a kernel, a batch of collectives, a page copy) or one collective op. One
step per size after a warm-up step; wall times exclude loading and the warm-up.

Flow mode runs on ``sim.step.flow_executor.run_flows`` (no simpy process per GPU stream;
``--executor streams`` times the process-per-stream ``sim.step.schedule.run_flows`` instead,
which cannot reach 512 GPUs in reasonable time). Goals (issue 11): flow mode at 512 GPUs
<= 60 s per step, on paper-1440 <= 5 min per step.

    python benchmarks/sim_speed.py                         # the table
    python benchmarks/sim_speed.py --sizes 8,64 --modes flow
    python benchmarks/sim_speed.py --steps 3               # more steps per size
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from unittest import mock

from sim import backend
from sim.backend import ClusterSim, routing_source
from sim.step import flow_executor, schedule
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # GPUs: (nodes per micro-cluster, micro-clusters, EP size)
    8: (1, 1, 8),
    64: (8, 1, 32),
    512: (8, 8, 32),
    1440: (10, 18, 32),  # paper-1440 itself
}
MODES = ("analytic", "flow")
EXECUTORS = {"phases": flow_executor.run_flows, "streams": schedule.run_flows}


def scenario(gpus: int, mode: str, steps: int):
    nodes, mcs, ep = SIZES[gpus]
    return load_scenario(ROOT / "configs" / "paper-1440.toml", [
        f"cluster.nodes_per_microcluster={nodes}", f"cluster.microclusters={mcs}",
        f"parallelism.ep_size={ep}", f"sim.network_model=\"{mode}\"", f"run.steps={steps + 1}",
        "run.warmup_steps=1"])


def measure(gpus: int, mode: str, steps: int, executor: str = "phases") -> dict:
    """Seconds of wall time per simulated step (after a warm-up step) and what it did."""
    s = scenario(gpus, mode, steps)
    # the backend's flow executor, whichever it imports, replaced by the one measured
    with mock.patch.object(backend, "run_flows", EXECUTORS[executor]):
        t0 = time.perf_counter()
        sim = ClusterSim(s, load_profile(s.cluster.profile))
        routed_at = routing_source(s)
        setup = time.perf_counter() - t0
        sim.step(0, routed_at(0), [])  # warm-up: first communicators, page tables fill
        events0, solves0, t1 = sim.events, sim.network.recomputations, time.perf_counter()
        times = []
        for step in range(1, steps + 1):
            times.append(sim.step(step, routed_at(step), times)[3].step_time_s)
        wall = (time.perf_counter() - t1) / steps
    events = (sim.events - events0) / steps
    return {"gpus": gpus, "mode": mode, "setup_s": setup, "wall_s_per_step": wall,
            "events_per_step": events, "events_per_s": events / wall, "simulated_step_s": times[-1],
            "solves_per_step": (sim.network.recomputations - solves0) / steps,
            "pager_classes": sim.controller.pool.classes if sim.controller.pool else 0}


def parse_list(text: str, allowed, kind=str) -> list:
    items = [kind(x) for x in text.split(",") if x]
    for x in items:
        if x not in allowed:
            raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(map(str, allowed))}")
    return items


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1, help="steps measured per row, after a warm-up step")
    ap.add_argument("--sizes", type=lambda t: parse_list(t, SIZES, int), default=list(SIZES),
                    help="comma-separated GPU counts (default: 8,64,512,1440)")
    ap.add_argument("--modes", type=lambda t: parse_list(t, MODES), default=list(MODES),
                    help="comma-separated network modes (default: analytic,flow)")
    ap.add_argument("--executor", choices=sorted(EXECUTORS), default="phases",
                    help="flow-mode executor: phases (sim.step.flow_executor) or streams (sim.step.schedule)")
    args = ap.parse_args(argv)
    print(f"{'GPUs':>5} {'mode':>8} {'setup s':>8} {'wall s/step':>12} {'events/step':>12} "
          f"{'events/s':>10} {'solves/step':>12} {'sim step s':>11} {'pagers':>7}")
    for gpus in args.sizes:
        for mode in args.modes:
            r = measure(gpus, mode, args.steps, args.executor)
            print(f"{r['gpus']:>5} {r['mode']:>8} {r['setup_s']:>8.2f} {r['wall_s_per_step']:>12.2f} "
                  f"{r['events_per_step']:>12.0f} {r['events_per_s']:>10.0f} {r['solves_per_step']:>12.0f} "
                  f"{r['simulated_step_s']:>11.3f} {r['pager_classes']:>7}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
