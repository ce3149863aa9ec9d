"""How fast the simulator is, and how that grows with the cluster.

Runs the paper-1440 model (352B-class MoE, configs/paper-1440.toml) on 8, 64, 512 and
1,440 GPUs of 8 per node, in the fast (analytic) mode and, up to 64 GPUs, the flow
(max-min fair) mode, and prints wall time per step and events per second. An *event* is
one phase executed on one GPU (a kernel, a batch of collectives, a page copy) or one
collective op. One step per size after a warm-up step; wall times exclude loading.

    python benchmarks/sim_speed.py            # the table
    python benchmarks/sim_speed.py --steps 3  # more steps per size
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from sim.backend import ClusterSim, routing_source
from testbed.profile import load_profile
from testbed.scenario_file import load_scenario

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # GPUs: (nodes per micro-cluster, micro-clusters, EP size)
    8: (1, 1, 8),
    64: (8, 1, 32),
    512: (8, 8, 32),
    1440: (10, 18, 32),
}


def scenario(gpus: int, mode: str, steps: int):
    nodes, mcs, ep = SIZES[gpus]
    return load_scenario(ROOT / "configs" / "paper-1440.toml", [
        f"cluster.nodes_per_microcluster={nodes}", f"cluster.microclusters={mcs}",
        f"parallelism.ep_size={ep}", f"sim.network_model=\"{mode}\"", f"run.steps={steps + 1}",
        "run.warmup_steps=1"])


def measure(gpus: int, mode: str, steps: int) -> dict:
    s = scenario(gpus, mode, steps)
    t0 = time.perf_counter()
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    routed_at = routing_source(s)
    setup = time.perf_counter() - t0
    sim.step(0, routed_at(0), [])  # warm-up: first communicators, page tables fill
    events0, t1 = sim.events, time.perf_counter()
    times = []
    for step in range(1, steps + 1):
        times.append(sim.step(step, routed_at(step), times)[3].step_time_s)
    wall = (time.perf_counter() - t1) / steps
    events = (sim.events - events0) / steps
    return {"gpus": gpus, "mode": mode, "setup_s": setup, "wall_s_per_step": wall,
            "events_per_step": events, "events_per_s": events / wall, "simulated_step_s": times[-1],
            "pager_classes": sim.controller.pool.classes if sim.controller.pool else 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args(argv)
    print(f"{'GPUs':>5} {'mode':>8} {'setup s':>8} {'wall s/step':>12} {'events/step':>12} "
          f"{'events/s':>10} {'sim step s':>11} {'pagers':>7}")
    for gpus in SIZES:
        for mode in ("analytic", "flow") if gpus <= 64 else ("analytic",):
            r = measure(gpus, mode, args.steps)
            print(f"{r['gpus']:>5} {r['mode']:>8} {r['setup_s']:>8.2f} {r['wall_s_per_step']:>12.2f} "
                  f"{r['events_per_step']:>12.0f} {r['events_per_s']:>10.0f} {r['simulated_step_s']:>11.3f} "
                  f"{r['pager_classes']:>7}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
