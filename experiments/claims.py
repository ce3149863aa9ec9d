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
finished is not run again. Scenarios at the seed's scale (paper-1440.toml) and the published
runs (configs/published/) are simulated only, with their own machine profiles (a100-seed,
h200, h800, h100), whatever ``--profile`` says. C1 is judged on the published MegaScale-352B
pair at 1,440 H800 (experiments/paper_scale.py, the same sweep), C13 and C16 on every
published scenario besides their own (``Ledger.published``).

``--quick`` runs the seed-scale scenarios on 64 GPUs with the seed's per-GPU shapes
(8 GPUs per node, 4 nodes per micro-cluster, 2 micro-clusters, EP 32): the same experts
and tokens per GPU as at 1,440 GPUs, but 2 replicas of each expert instead of 45 (so
ZeRO shards the optimizer state over 2 replicas: C2, about memory, stays at 1,440 GPUs);
C1 stays at 1,440 GPUs (a second a run), and the published scenarios leave out
``SLOW_PUBLISHED`` (the DeepSeek-V3 files, minutes each).

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
    """experiments/paper_scale.py's sweep (simulated, always at 1,440 GPUs): MegaScale-352B on
    H800 in Megatron-LM's layout against MegaScale-MoE's (the published 1.88x), and the
    MegaScale layout with each of the seed's mechanisms and with all it runs (the seed's
    system), a refused mechanism with the scenario's reason instead of a run."""
    c = Claim("C1")
    if not ledger.sim:
        return judge_c1(c, "Simulated only (1,440 GPUs); no sim backend was chosen.")
    mod, res = ledger.experiment("paper_scale")
    runs = mod.runs_by_label(res)
    megatron = runs.get(mod.layout_label(mod.JUDGED_GPUS, "megatron"))
    megascale = runs.get(mod.layout_label(mod.JUDGED_GPUS, "megascale"))
    if megatron is None or megascale is None:
        return judge_c1(c, "The paper_scale runs at 1,440 GPUs are missing.")
    labelled = mod.variants(ledger.opts)
    on_top = f"{mod.layout_label(mod.JUDGED_GPUS, 'megascale')} + "
    mechanisms = [label for label, s in labelled if label.startswith(on_top) and not isinstance(s, str)]
    for label in [mod.layout_label(mod.JUDGED_GPUS, lay) for lay in mod.LAYOUTS] + mechanisms:
        s = runs.get(label)
        if s is not None:
            c.add(label, [s], step_time_s=s["step_time_s"], mfu=s.get("mfu"),
                  tokens_per_s_per_gpu=s.get("tokens_per_s_per_gpu"),
                  fits_in_device_memory=s.get("fits_in_device_memory"))
    for label, reason in labelled:
        if isinstance(reason, str):  # refused with this layout: the run it was asked on, and why
            c.add(label, [megascale], refused=reason)
    c.add("MegaScale-MoE over Megatron-LM", [megatron, megascale], megatron_step_time_s=megatron["step_time_s"],
          megascale_step_time_s=megascale["step_time_s"], speedup=megatron["step_time_s"] / megascale["step_time_s"])
    seed_label = mechanisms[-1] if mechanisms else None  # variants: the seed's system is the last that runs
    seed = runs.get(seed_label) if seed_label else None
    if seed is not None:
        c.add("the seed's system over Megatron-LM", [megatron, seed], seed_system=seed_label,
              seed_step_time_s=seed["step_time_s"], baseline_step_time_s=megatron["step_time_s"],
              speedup=megatron["step_time_s"] / seed["step_time_s"],
              megascale_layout_step_ratio=megascale["step_time_s"] / seed["step_time_s"])
    return judge_c1(c)


def judge_c1(c: Claim, missing: str = "") -> Claim:
    """The seed's system (the MegaScale layout with every mechanism the simulator runs with it)
    over Megatron-LM's layout against 1.88 (``c1_check``); never a plain holds: a refused
    mechanism is not in it, and the layouts are published runs' as the files read them.
    ``missing``: why there are no numbers (then not testable yet)."""
    v = c.numbers.get("the seed's system over Megatron-LM")
    if v is None:
        c.verdict, c.why = UNTESTABLE, missing or "No paper_scale runs of the seed's system."
        return c
    pub = c.numbers["MegaScale-MoE over Megatron-LM"]
    c.verdict = CONDITIONAL if c1_check(v["speedup"]) else FAILS
    refused = [(k, x["refused"]) for k, x in c.numbers.items() if "refused" in x]
    alone = "; ".join(f"{k}: {x['step_time_s']:.3f} s" for k, x in c.numbers.items()
                      if " + " in k and "step_time_s" in x)
    c.why = (f"MegaScale-352B on 1,440 H800 (configs/published/megascale-352b-1440-h800-*.toml), simulated: "
             f"Megatron-LM's layout {pub['megatron_step_time_s']:.3f} s a step, MegaScale-MoE's "
             f"{pub['megascale_step_time_s']:.3f} s: x{pub['speedup']:.2f} (published: 1.88x, arXiv 2505.11432). "
             f"The seed's system ({v['seed_system']}) {v['seed_step_time_s']:.3f} s: x{v['speedup']:.2f} over "
             f"Megatron-LM (claimed 1.88x), x{v['megascale_layout_step_ratio']:.3f} over the MegaScale layout alone. "
             f"The mechanisms on the MegaScale layout: {alone or 'none ran'}."
             + "".join(f" {k}: refused ({why})." for k, why in refused))
    without = ", ".join(k.rsplit(" + ", 1)[-1] for k, _ in refused)
    c.conditions = ("The seed's system is MegaScale-MoE's layout (Ulysses SP 8, EP 8, PP 15) with the seed's "
                    "mechanisms the simulator runs with it"
                    + (f"; without {without}, which the scenario refuses with this layout (why: the reason)"
                       if refused else "")
                    + "; balanced routing (workload.skew = 0 in the files), as the files assume for both systems.")
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
