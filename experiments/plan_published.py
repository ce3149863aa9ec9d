"""Where `testbed plan` puts the layouts practitioners published (issue 27, item 3): one plan for
every setup of configs/published/ (model preset, GPUs, profile, global batch, sequence), each
published run of that setup placed in its plan's ranking.

    python experiments/plan_published.py [--max-gpus N] [--only PRESET] [--jobs J] [--json]

For each published run it prints its rank among the layouts of its GEMM precision, the gap to
the best of them, whether it is in the top 5 or within 5% (``testbed.study.plan.PLACED_RANK``,
``PLACED_GAP``), and where not, by how much and why; and for each setup whether the plan orders
its published runs as their figures do. Plans are resumable (their indexes in the run store),
so a stopped run goes on where it stopped. ``--max-gpus`` leaves out the larger setups
(default 512: the 1,024- to 2,048-GPU plans take tens of minutes on 2 cores). Writes
reports/plan_published.csv. Every row names its run.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from testbed.core.errors import ScenarioError, run_as_command
from testbed.scenario.file import load_scenario
from testbed.study.experiments import ROOT
from testbed.study.plan import PUBLISHED, PlanOptions, plan_base, run_plan

COLUMNS = ("setup", "config", "rows", "rank", "of", "gap_to_best", "placed", "rank_of_all", "why", "run_dir")


def setups(max_gpus: int, only: str | None) -> list[tuple[str, int, str, int, int, int]]:
    """The distinct (preset, GPUs, profile, global batch, sequence, GPUs a node) of the published
    scenarios, smallest first."""
    out = set()
    for path in sorted(PUBLISHED.glob("*.toml")):
        try:
            s = load_scenario(path)
        except ScenarioError:
            continue
        if not s.model.preset or s.world_size > max_gpus or (only and s.model.preset != only):
            continue
        out.add((s.model.preset, s.world_size, s.cluster.profile, s.workload.global_batch, s.transformer.seq_len,
                 s.cluster.gpus_per_node))
    return sorted(out, key=lambda k: (k[1], k))


NAME = "plan_published"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=NAME, description=__doc__.splitlines()[0])
    ap.add_argument("--max-gpus", type=int, default=512, help="leave out setups of more GPUs (default 512)")
    ap.add_argument("--only", default=None, metavar="PRESET", help="only this model preset's setups")
    ap.add_argument("--jobs", type=int, default=None, help="parallel simulator processes (default: every core)")
    ap.add_argument("--output-dir", default="runs", help="the run store (default runs)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    return run_as_command(NAME, lambda: run(args), "stopped; rerun to resume (finished plans' runs are kept)")


def run(args) -> int:
    rows, orders = [], []
    found = setups(args.max_gpus, args.only)
    if not found:
        raise ScenarioError("--only" if args.only else "--max-gpus", args.only or args.max_gpus,
                            "no published setup matches")
    for preset, gpus, profile, batch, seq, per_node in found:
        label = f"{preset} {gpus} {profile} gbs {batch} seq {seq}"
        print(f"plan {label}", file=sys.stderr)
        base = plan_base(preset, gpus, profile, batch, seq, gpus_per_node=per_node, output_dir=args.output_dir)
        r = run_plan(base, preset, PlanOptions(jobs=args.jobs))
        for p in r.get("published", []):
            rows.append({"setup": label, "config": p["config"], "rows": " ".join(f["id"] for f in p["published"]),
                         "rank": p["rank"], "of": p["of"], "gap_to_best": round(p["gap_to_best"], 4),
                         "placed": p["placed"], "rank_of_all": p["rank_of_all"], "why": p["why"] or "",
                         "run_dir": p["run_dir"]})
        orders += [{"setup": label, **o} for o in r.get("published_order", [])]
    out = ROOT / "reports" / "plan_published.csv"
    out.parent.mkdir(exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    if args.json:
        print(json.dumps({"rows": rows, "orders": orders}, indent=1))
    else:
        for row in rows:
            print(f"{row['config']}: rank {row['rank']} of {row['of']} (of all {row['rank_of_all']}), "
                  f"{100 * row['gap_to_best']:+.1f}% to the best, placed {'yes' if row['placed'] else 'no'}"
                  + (f"; {row['why']}" if row["why"] else ""))
        for o in orders:
            print(f"{o['setup']} ({o['unit']}): published {' < '.join(o['published_order'])}; plan "
                  f"{' < '.join(o['plan_order'])}: {'agrees' if o['agrees'] else 'differs'}")
    placed = sum(r["placed"] for r in rows)
    print(f"placed {placed} of {len(rows)} published runs; orders agree {sum(o['agrees'] for o in orders)} of "
          f"{len(orders)}; wrote {Path(out).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
