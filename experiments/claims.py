"""The claims ledger: what the testbed finds for every claim C1-C16 of the seed documents.

Every claim (docs/claims.md: C1-C16) is a hypothesis. For each, this script runs (or reuses,
through the sweeps' indexes) the scenarios that bear on it and gives a verdict:

- ``holds``: the testbed's numbers agree with the claim within the stated tolerance;
- ``does not hold``: they do not;
- ``holds only under stated conditions``: they agree only on some scenarios, only for a
  part of the claim, or only under a reading of the claim; the conditions say which;
- ``not testable yet``: the testbed does not model what the claim is about (the reason
  is given).

With each verdict come the numbers and the runs (run ids, run folders) they come from:
simulated, and measured (real CPU ranks, ``--backends sim,real``) wherever the scenario
is small enough to run here. The experiments that exist (compare_strategies,
sweep_group_cache, sweep_placement, sweep_capacity_factor, and sweep_page_size once it
exists) are imported and their sweeps reused as they are, so a run either of them
finished is not run again. Scenarios at the seed's scale (paper-1440.toml) are simulated
only, with their own machine profiles (a100-seed, h200), whatever ``--profile`` says.

``--quick`` runs the seed-scale scenarios on 64 GPUs with the seed's per-GPU shapes
(8 GPUs per node, 4 nodes per micro-cluster, 2 micro-clusters, EP 32): the same experts
and tokens per GPU as at 1,440 GPUs, but 2 replicas of each expert instead of 45 (so
ZeRO shards the optimizer state over 2 replicas: C2, about memory, stays at 1,440 GPUs).

Every claim is gathered (``cN``: its runs and their numbers) and then judged
(``judge_cN``, in ``JUDGES``): the verdict, conditions and reason are a function of the
numbers alone, so each verdict a claim can reach is tested on given numbers
(tests/experiments/test_claim_verdicts.py), and claims.json's numbers give its verdicts
again.

    python experiments/claims.py --quick --backends sim --json
    python experiments/claims.py                    # both backends (slow: real runs)

Writes ``reports/claims.html`` and ``reports/claims.json`` (``--report`` moves both).
"""

from __future__ import annotations

import json
import sys
import time

from testbed.cli.experiment import (
    ROOT,
    Experiment,
    parser,
    resolve_options,
    writable_report,
)
from testbed.core.errors import run_as_command
from testbed.core.files import write_atomic
from testbed.report.claims import write_claims_report
from testbed.study.claims_ledger import (
    NAME,
    QUESTION,
    Ledger,
    at,
    backends_of,
    load_experiment,
    side,
)
from testbed.study.run_figures import (
    scenario_of,
)
from testbed.study.verdicts import (  # noqa: F401 (HOLDS: the verdict names, read from this module by tests)
    CONDITIONAL,
    FAILS,
    HOLDS,
    TOLERANCE,
    UNTESTABLE,
    VERDICTS,
    Claim,
    c1_check,
    c14_checks,
)


# ---- the claims (the others: experiments/claims_memory.py, claims_sync.py, claims_traffic.py) -------
# Each claim: ``cN(ledger)`` gathers the numbers from runs, ``judge_cN(claim, ...)`` turns them
# into the verdict, conditions and reason, a pure function tested on given numbers.
def c1(ledger: Ledger) -> Claim:
    """experiments/paper_scale.py's two whole-model configurations (simulated): paper-1440
    against its Megatron-style baseline, the ratio of step times against 1.88."""
    c = Claim("C1")
    if not ledger.sim:
        return judge_c1(c, ledger.quick, "Simulated only (1,440 GPUs); no sim backend was chosen.")
    _, res = ledger.experiment("paper_scale")
    runs = at(res, "sim") if res is not None else []  # point 0: paper-1440, point 1: the baseline
    if len(runs) < 2:
        return judge_c1(c, ledger.quick, "The paper_scale runs are missing.")
    paper, baseline = runs[:2]
    label = "paper-1440 shapes on 64 GPUs" if ledger.quick else "paper-1440 (1,440 GPUs)"
    c.add(f"{label}, the seed's system", [paper], step_time_s=paper["step_time_s"], mfu=paper.get("mfu"),
          fits_in_device_memory=paper.get("fits_in_device_memory"))
    c.add(f"{label}, Megatron-style baseline", [baseline], step_time_s=baseline["step_time_s"],
          mfu=baseline.get("mfu"), fits_in_device_memory=baseline.get("fits_in_device_memory"))
    c.add("seed over baseline", [paper, baseline], seed_step_time_s=paper["step_time_s"],
          baseline_step_time_s=baseline["step_time_s"], speedup=baseline["step_time_s"] / paper["step_time_s"])
    return judge_c1(c, ledger.quick)


def judge_c1(c: Claim, quick: bool, missing: str = "") -> Claim:
    """``missing``: why there are no numbers (then not testable yet)."""
    v = c.numbers.get("seed over baseline")
    if v is None:
        c.verdict, c.why = UNTESTABLE, missing or "No paper_scale runs."
        return c
    speedup = v["speedup"]
    c.verdict = CONDITIONAL if c1_check(speedup) else FAILS
    c.conditions = ("The baseline is the testbed's Megatron-style configuration (configs/megatron-baseline-1440.toml: "
                    "flat all-to-all, expert all-reduce, no paging, no heat map), not Megatron-LM; neither uses "
                    "tensor or pipeline parallelism (modelled, but left at 1 in both: the seed names neither)."
                    + (" With --quick the experts have 2 replicas instead of 45." if quick else ""))
    c.why = (f"Simulated step {v['seed_step_time_s']:.3f} s with the seed's system against "
             f"{v['baseline_step_time_s']:.3f} s for the baseline: x{speedup:.2f} (claimed 1.88x).")
    return c


def c14(ledger: Ledger) -> Claim:
    c = Claim("C14")
    mod, res = ledger.experiment("sweep_capacity_factor")
    if res is not None:
        for backend in backends_of(res):
            settings = sorted({(res.grid[i][mod.SKEW], res.grid[i][mod.AUX]) for (i, b, _) in res.summaries
                               if b == backend})
            for skew, aux in settings:
                runs = [s for (i, b, _), s in sorted(res.summaries.items()) if b == backend
                        and res.grid[i][mod.SKEW] == skew and res.grid[i][mod.AUX] == aux
                        and 1.1 <= res.grid[i][mod.CF] <= 1.25]
                if runs:
                    c.add(f"sweep_capacity_factor skew {skew:g}, aux coef {aux:g}, {side(backend)}", runs,
                          max_dropped_fraction_at_cf_1_1_to_1_25=max(s["dropped_token_fraction"] for s in runs),
                          capacity_factors=sorted({scenario_of(s).router.capacity_factor for s in runs}))
    return judge_c14(c)


def judge_c14(c: Claim) -> Claim:
    c.judge(c14_checks({k: v["max_dropped_fraction_at_cf_1_1_to_1_25"] for k, v in c.entries()}), "No drops only for")
    parts = "; ".join(f"{k}: {100 * v['max_dropped_fraction_at_cf_1_1_to_1_25']:.2f}%" for k, v in c.numbers.items())
    c.why = (f"Largest fraction of routed slots dropped at capacity factors 1.1-1.25: {parts or 'no run'} (claimed: "
             "none). On the simulator routing is the synthetic workload: the aux loss does not act on it, and the "
             "skew stands for how unbalanced routing stays; on the real backend the router trains under the aux "
             "loss for the run's few steps.")
    return c


_memory, _sync, _traffic = (load_experiment(n) for n in ("claims_memory", "claims_sync", "claims_traffic"))
CLAIM_FUNCTIONS = (c1, _memory.c2, _sync.c3, _sync.c4, _sync.c5, _sync.c6, _memory.c7, _memory.c8, _memory.c9,
                   _memory.c10, _traffic.c11, _sync.c12, _traffic.c13, c14, _traffic.c15, _traffic.c16)
#: claim id -> its verdict function (numbers -> verdict, conditions, reason), for every claim
JUDGES = {"C1": judge_c1, "C14": judge_c14, **_memory.JUDGES, **_sync.JUDGES, **_traffic.JUDGES}


# ---- command line ------------------------------------------------------------------------------
def _parser():
    exp = Experiment(name=NAME, question=QUESTION, build=lambda opts: None, analyse=lambda result: {})
    return parser(exp)


def build_ledger(args) -> Ledger:
    opts = resolve_options(args)
    kind, _, address = args.executor.partition("=")  # local, dask or dask=ADDRESS
    address = address or None
    return Ledger(opts, jobs=args.jobs, executor=kind, address=address, fresh=args.fresh,
                  progress=not args.no_progress)


def _run(args) -> int:
    start = time.perf_counter()
    report = writable_report(args.report or ROOT / "reports" / f"{NAME}.html")
    ledger = build_ledger(args)
    claims, claim_wall = [], {}
    for fn in CLAIM_FUNCTIONS:
        t0 = time.perf_counter()
        claims.append(fn(ledger).to_dict())
        claim_wall[claims[-1]["id"]] = time.perf_counter() - t0
    for cl in claims:
        assert cl["verdict"] in VERDICTS, cl
    out_json = report.with_suffix(".json")
    opts = ledger.opts
    meta = {"backends": list(opts.backends), "quick": opts.quick, "fabric": opts.fabric if ledger.real else None,
            "profile": opts.profile, "repeats": opts.repeats, "wall_s": time.perf_counter() - start,
            "claim_wall_s": claim_wall, "report": str(report), "json": str(out_json), "tolerances": TOLERANCE}
    data = {"question": QUESTION, **meta, "claims": claims}
    write_claims_report(data, report)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out_json, json.dumps(data, indent=1, default=str) + "\n")
    if args.json:
        print(json.dumps(data, default=str))
    else:
        for cl in claims:
            print(f"{cl['id']:4s} {cl['verdict']:36s} {len(cl['runs'])} runs")
        print(f"wrote {report} and {out_json} ({meta['wall_s']:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_as_command(NAME, lambda: _run(args), "stopped; rerun to resume (finished runs are kept)")


if __name__ == "__main__":
    sys.exit(main())
