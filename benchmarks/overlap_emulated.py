"""What overlap (M22) buys on an emulated cluster: measured on real CPU ranks, and predicted.

Real ranks (gloo) on an emulated cluster (``real.network = emulated``: network
namespaces and shaped links, needs root) run one MoE scenario with and without
micro-batch pipelining of the all-to-all (``overlap.micro_batches``) and gradient sync
during the backward (``overlap.sync_with_backward``); the simulator replays each run's
routing with the ``emulated`` profile. Per variant it prints the measured and simulated
step time (median over the measured steps) and the speedup over no overlap, measured
and simulated.

    python benchmarks/overlap_emulated.py                  # 8 ranks: 2 per node, 2 nodes, 2 micro-clusters
    python benchmarks/overlap_emulated.py --steps 8 --tokens 1024
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from real.netem import privileges_missing
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

VARIANTS = {  # name -> [overlap] fields
    "none": {},
    "micro_batches=2": {"micro_batches": 2},
    "micro_batches=4": {"micro_batches": 4},
    "sync_with_backward": {"sync_with_backward": True},
    "both (2 + sync)": {"micro_batches": 2, "sync_with_backward": True},
}


def scenario(tokens: int, steps: int, output_dir: str, overlap: dict) -> Scenario:
    return Scenario.from_dict({
        "model": {"hidden_size": 256, "ffn_hidden_size": 512, "num_layers": 2, "num_experts": 8},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 2, "profile": "emulated"},
        "parallelism": {"ep_size": 4},
        "pager": {"enabled": False},
        "comm": {"token_strategy": "alltoall", "expert_sync": "allreduce"},
        "overlap": overlap,
        "workload": {"tokens_per_rank": tokens},
        "real": {"network": "emulated"},
        "run": {"steps": steps, "warmup_steps": 1, "output_dir": output_dir},
    })


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank per step (default 512)")
    ap.add_argument("--steps", type=int, default=5, help="steps per run, the first one warm-up (default 5)")
    args = ap.parse_args(argv)
    missing = privileges_missing()
    if missing:
        print(f"overlap_emulated: needs an emulated cluster: {missing}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for name, overlap in VARIANTS.items():
            s = scenario(args.tokens, args.steps, out, overlap)
            real = run_scenario(s, "real")
            sim = run_scenario(s.replace(workload={"trace": real["run_dir"]}, real={"network": "loopback"}), "sim")
            rows.append((name, real["step_time_s"], sim["step_time_s"]))
            print(f"  ran {name}: measured {real['step_time_s'] * 1e3:.1f} ms, simulated {sim['step_time_s'] * 1e3:.1f} ms",
                  file=sys.stderr)
    base_real, base_sim = rows[0][1], rows[0][2]
    print(f"{'variant':<20} {'measured ms':>12} {'simulated ms':>13} {'measured speedup':>17} {'simulated speedup':>18}")
    for name, real_s, sim_s in rows:
        print(f"{name:<20} {real_s * 1e3:>12.1f} {sim_s * 1e3:>13.1f} {base_real / real_s:>17.3f} {base_sim / sim_s:>18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
