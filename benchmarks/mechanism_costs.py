"""What each paging and heat mechanism costs and saves, switched on one at a time.

Runs a scenario (default: configs/quickstart.toml, configs/local-cpu.toml and
configs/heat-drift.toml, where the heat policies fire within the run) on a
backend with each mechanism of the list below on alone (the others off, everything else
as the file says), and prints, against the run with none of them: the median step time, the page-move rows
and host<->device bytes per step, the compute time spent waiting for pages, the bytes of
the heat stage, and the moves by reason. Every figure comes from the runs it prints.

    python benchmarks/mechanism_costs.py                       # simulator, the three configs
    python benchmarks/mechanism_costs.py --backend real configs/local-cpu.toml
    python benchmarks/mechanism_costs.py --profile h200      # copies overlapping compute

The mechanisms (SPEC IDs; docs/mechanisms.md):
- M14 prefetch ahead (pager.prefetch_ahead) and page-by-page compute (pager.pipeline_pages)
- M15 eviction by the seed's score (pager.eviction_order = scored); free device memory as
  the trigger (pager.free_memory = device, with the device's memory set just above what
  the pages and a step need, so that it bites)
- M17 compaction every 2 steps (pager.defrag_interval)
- M18 the heat update off the critical path (heat.deferred)
- M20 probes that never answer in time (heat.probe_timeout_ms = 0): what waking saves
- M22 local-first routing (router.local_bias = 1)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed.run.runner import run_scenario  # noqa: E402
from testbed.scenario.file import load_scenario  # noqa: E402

#: every mechanism of the list off, whatever the file says: the row each variant is judged on
BASELINE = {"pager": {"prefetch_ahead": False, "pipeline_pages": False, "eviction_order": "clean_first",
                      "free_memory": "budget", "defrag_interval": 0, "defrag_threshold": 0.0},
            "heat": {"deferred": False}, "router": {"local_bias": 0.0}}

VARIANTS = {
    "none of them": {},
    "M14 prefetch_ahead": {"pager": {"prefetch_ahead": True}},
    "M14 pipeline_pages": {"pager": {"pipeline_pages": True}},
    "M15 scored eviction": {"pager": {"eviction_order": "scored"}},
    "M15 free device memory": "device",  # sized per scenario, see device_memory
    "M17 defrag every 2 steps": {"pager": {"defrag_interval": 2}},
    "M18 deferred heat update": {"heat": {"deferred": True}},
    "M20 no probe answers in time": {"heat": {"probe_timeout_ms": 0.0}},
    "M22 local-first bias 1.0": {"router": {"local_bias": 1.0}},
}


def device_memory(scenario) -> dict:
    """pager.free_memory = device with a device 10 % larger than the page budget: the
    5 % that must stay free is then short whenever a step holds more than ~5 % beside
    its pages."""
    budget = scenario.pager.gpu_budget_bytes or 2 * scenario.model.expert_bytes * scenario.model.num_experts
    return {"pager": {"free_memory": "device", "device_memory_bytes": int(1.1 * budget)}}


def row(name: str, summary: dict, base: dict | None) -> str:
    step = summary["step_time_s"] * 1e3
    change = "" if base is None else f"{100 * (summary['step_time_s'] / base['step_time_s'] - 1):+6.1f}%"
    pcie = summary["bytes_by_level"].get("pcie", 0.0)
    heat = summary["bytes_by_stage"].get("heat", 0.0)
    moves = {k: v for k, v in (summary.get("moves_by_reason") or {}).items() if v}
    return (f"  {name:30s} {step:9.3f} {change:>7s} {summary['page_moves_per_step']:7.1f} {pcie / 1024:9.1f} "
            f"{summary['page_stall_s'] * 1e3:8.3f} {heat:8.0f}  {moves}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="*", default=["configs/quickstart.toml", "configs/local-cpu.toml",
                                                   "configs/heat-drift.toml"])
    ap.add_argument("--backend", default="sim", choices=("sim", "real"))
    ap.add_argument("--steps", type=int, default=0, help="run.steps (0: as the file says)")
    ap.add_argument("--profile", default="", help="cluster.profile instead of the file's (e.g. h200: copies that "
                                                  "overlap compute, which the CPU profiles do not)")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="mechanism-costs-"))
    for config in args.configs:
        s = load_scenario(ROOT / config)
        if args.steps:
            s = s.replace(run={"steps": args.steps})
        if args.profile:
            s = s.replace(cluster={"profile": args.profile})
        s = s.replace(run={"output_dir": str(out)})
        print(f"{config} on {args.backend}, profile {s.cluster.profile}: {s.run.steps} steps ({s.run.warmup_steps} warm-up), runs in {out}")
        print(f"  {'mechanism':30s} {'step ms':>9s} {'change':>7s} {'moves':>7s} {'PCIe KiB':>9s} "
              f"{'stall ms':>8s} {'heat B':>8s}  moves by reason (per run)")
        base = None
        s = s.replace(**BASELINE)
        for name, change in VARIANTS.items():
            change = device_memory(s) if change == "device" else change
            summary = run_scenario(s.replace(**change) if change else s, args.backend)
            print(row(name, summary, base), flush=True)
            base = base or summary
        # the baseline once more: on real ranks its spread is the noise the rows above sit in
        print(row("none of them, again", run_scenario(s, args.backend), base), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
