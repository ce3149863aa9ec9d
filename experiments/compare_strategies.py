"""How do the token strategies (alltoall, allgather, hierarchical) and expert-sync
strategies (allreduce, two_stage) compare on the quick-start scenario, simulated and
measured?

Runs the 6 strategy combinations on each backend, stores each as a run folder under
``run.output_dir`` (finished runs are reused, so a stopped sweep resumes; ``--fresh``
reruns), and writes one comparison page (``testbed.report``). Step times are seconds
(median of measured steps).

    python experiments/compare_strategies.py --backends sim --set run.steps=4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from testbed.backend import BACKENDS
from testbed.errors import ScenarioError, run_as_command
from testbed.report import write_comparison_report
from testbed.runner import run_scenario
from testbed.runs import latest_run
from testbed.scenario import EXPERT_SYNC_STRATEGIES, TOKEN_STRATEGIES, Scenario
from testbed.scenario_file import load_scenario

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "quickstart.toml"
DEFAULT_OUTPUT = REPO / "reports" / "compare_strategies.html"


def strategy_scenarios(base: Scenario) -> list[Scenario]:
    """``base`` with every (token_strategy, expert_sync) pair, token strategy outermost."""
    return [base.replace(comm={"token_strategy": t, "expert_sync": s})
            for t in TOKEN_STRATEGIES for s in EXPERT_SYNC_STRATEGIES]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="base scenario TOML (default: configs/quickstart.toml)")
    p.add_argument("--backends", default="sim,real", help="comma-separated backends (default: sim,real)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field of the base scenario (repeatable)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), metavar="FILE.html", help="report path")
    p.add_argument("--fresh", action="store_true", help="rerun even when an identical finished run exists")
    p.add_argument("--json", action="store_true", help="print the results as a JSON list (report path goes to stderr)")
    return p


def sweep(base: Scenario, backends: list[str], *, fresh: bool = False, log=sys.stderr) -> list[dict]:
    """Run every strategy variant on every backend; one progress line per run on ``log``."""
    variants = strategy_scenarios(base)
    total = len(variants) * len(backends)
    rows = []
    for backend in backends:
        for scenario in variants:
            c = scenario.comm
            print(f"[{len(rows) + 1}/{total}] {backend} {c.token_strategy} {c.expert_sync} ...", end=" ", file=log, flush=True)
            reused = not fresh and latest_run(scenario, backend) is not None
            start = time.perf_counter()
            try:
                summary = run_scenario(scenario, backend, reuse=not fresh)
            except BaseException:
                print("failed", file=log, flush=True)  # ends the progress line before the error
                raise
            print("reused" if reused else f"{time.perf_counter() - start:.1f} s", file=log, flush=True)
            rows.append({"backend": backend, "token_strategy": c.token_strategy, "expert_sync": c.expert_sync,
                         "step_time_s": summary.get("step_time_s"), "run_dir": summary["run_dir"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_as_command("compare_strategies", lambda: _run(args),
                          "stopped; rerun to resume (finished runs are reused)")


def _run(args) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends or [""]:
        if b not in BACKENDS:
            raise ScenarioError("--backends", b, "expected one of " + ", ".join(BACKENDS))
    base = load_scenario(args.config, args.overrides)
    rows = sweep(base, backends, fresh=args.fresh)
    title = f"Token and expert-sync strategies on {Path(args.config).name}"
    path = write_comparison_report([r["run_dir"] for r in rows], args.output, title)
    if args.json:
        print(json.dumps(rows))
        print(f"wrote {path}", file=sys.stderr)
    else:
        print(path)
    return 0

if __name__ == "__main__":
    sys.exit(main())
