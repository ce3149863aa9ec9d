"""Claims ledger, paging and heat: C2 (peak memory with paging), C7 (experts without
tokens), C8 (the best page size), C9 (the first pages' share of accesses) and C10 (the
heat update's cost). Loaded by ``experiments/claims.py``.

Each claim has two halves: ``cN(ledger)`` runs (or reuses) its scenarios and keeps their
numbers in a ``Claim``; ``judge_cN(claim)`` sets the verdict, the conditions and the
reason from those numbers alone (the rules of ``testbed.study.verdicts``), so every verdict a
claim can reach is tested on given numbers (tests/experiments/test_claim_verdicts.py).
"""

from __future__ import annotations

import numpy as np

from testbed.core.units import format_bytes, parse_bytes
from testbed.policy.page_access import zipf_exponent_for
from testbed.study.claims_ledger import (
    PAGE,
    Ledger,
    at,
    backends_of,
    first_pages_shares,
    names,
    side,
)
from testbed.study.run_figures import (
    dead_experts,
    mean,
    mean_step_figures,
    scenario_of,
    spread,
)
from testbed.study.verdicts import (
    AGREES,
    C9_COVER,
    C9_FIRST,
    C9_TOL,
    CONDITIONAL,
    DIFFERS,
    FAILS,
    HOLDS,
    UNTESTABLE,
    WITHIN_NOISE,
    Claim,
    best_page_size,
    c2_verdict,
    c7_verdict,
    c8_check,
    c9_check,
    c9_forward_covered,
    c10_checks,
    from_outcomes,
    noise_note,
)


# ---- C2 -----------------------------------------------------------------------------------
def c2(ledger: Ledger) -> Claim:
    """paper-1440 as shipped at 1,440 GPUs (whatever --quick says), simulated, with and
    without paging; the page budget derived from the unpaged run (``Ledger.seed_page_budget``)."""
    c = Claim("C2")
    if not ledger.sim:
        return judge_c2(c)
    _, parts, off = ledger.seed_page_budget()
    on = ledger.seed_paged_at_scale()
    if off:
        c.add("page budget: device memory less the unpaged run's other memory", off, **parts)
    if on and off:
        s = scenario_of(on[0])
        label = "paper-1440 (1,440 GPUs), two-stage sync"
        c.add(f"{label}, paging on", on, pager_enabled=True, pager_budget_bytes=s.pager.gpu_budget_bytes,
              peak_memory_GB=on[0]["peak_memory_bytes"] / 1e9, fits_in_device_memory=on[0]["fits_in_device_memory"])
        c.add(f"{label}, paging off", off, pager_enabled=False, peak_memory_GB=off[0]["peak_memory_bytes"] / 1e9,
              fits_in_device_memory=off[0]["fits_in_device_memory"],
              expert_weights_per_GPU_GB=s.experts_per_rank * s.model.num_layers * s.model.expert_bytes / 1e9,
              device_memory_GB=off[0]["device_memory_bytes"] / 1e9)
        c.add("paging on vs off", on + off, peak_reduction=1 - on[0]["peak_memory_bytes"] / off[0]["peak_memory_bytes"])
    return judge_c2(c)


def judge_c2(c: Claim) -> Claim:
    on, off = c.entries(pager_enabled=True), c.entries(pager_enabled=False)
    if not on or not off:
        c.verdict, c.why = UNTESTABLE, "No simulated run (the seed-scale scenarios run on the sim backend only)."
        return c
    on, off = on[0][1], off[0][1]
    c.verdict, reduction = c2_verdict(on["peak_memory_GB"], off["peak_memory_GB"])
    used = on["pager_budget_bytes"]
    derived = [v for _, v in c.entries() if "derived_page_budget_bytes" in v]
    if derived and derived[0]["derived_page_budget_bytes"] == used:
        d = derived[0]
        budget = (f"budget {format_bytes(used)}, derived, not taken from the claim: device memory "
                  f"{d['device_memory_bytes'] / 1e9:.1f} GB (the profile's) less the "
                  f"{d['non_expert_memory_bytes'] / 1e9:.2f} GB the unpaged run's fullest GPU holds besides expert "
                  f"weights (parameters, gradients, optimizer state, activations, comm buffers, communicators; each "
                  f"at its most) less M15's free margin ({d['free_margin_bytes'] / 1e9:.1f} GB), in whole "
                  f"{format_bytes(d['page_size_bytes'])} pages")
        if d["config_page_budget_bytes"] != used:
            budget += (f"; configs/paper-1440.toml holds {format_bytes(d['config_page_budget_bytes'])} and should "
                       f"hold {used} bytes")
    elif derived:
        budget = (f"budget {format_bytes(used)}, configs/paper-1440.toml's: the unpaged run leaves no memory for "
                  "a page, so no budget could be derived")
    else:
        budget = f"budget {format_bytes(used)}, configs/paper-1440.toml's (no unpaged run to derive one from)"
    c.conditions = ("paper-1440 as shipped (two-stage sync) at 1,440 GPUs, whatever --quick says. The whole "
                    "transformer is simulated with configs/paper-1440.toml's assumptions (attention, "
                    "embeddings, mixed-precision Adam with ZeRO-2, full recompute); tensor and pipeline parallelism "
                    "are modelled but left at 1 (the seed names neither), so absolute peaks are not the seed's "
                    "28.3 / 17.5 GB setup. The reduction depends on the page budget (pager.gpu_budget_bytes).")
    c.why = (f"Simulated peak per GPU {off['peak_memory_GB']:.1f} GB without paging and {on['peak_memory_GB']:.1f} GB "
             f"with it ({budget}): a reduction of {100 * reduction:.1f}%, against the claimed 38.2%. Paging can cut "
             "the peak by at most the expert weights its budget leaves off the GPU; this budget is "
             f"{100 * used / 1e9 / off['expert_weights_per_GPU_GB']:.0f}% of the GPU's "
             f"{off['expert_weights_per_GPU_GB']:.1f} GB of expert weights (a slot holds a whole page, and M15 keeps "
             "a share of the slots free).")
    return c


# ---- C7 -----------------------------------------------------------------------------------
def c7(ledger: Ledger) -> Claim:
    c = Claim("C7")
    for cfg, res in ledger.routing_runs().items():
        for backend in backends_of(res):
            runs = at(res, backend)
            if backend == "sim" and ledger.real:
                continue  # a replay of the real routing: the same counts as the measured run
            d = dead_experts(runs[0])
            extra = {}
            s = scenario_of(runs[0])
            label = (f"{cfg} ({s.run.steps} steps, skew {s.workload.skew:g}, aux coef {s.router.aux_loss_coef:g}), "
                     f"{'synthetic routing' if backend == 'sim' else 'real router'}")
            if backend == "real":
                extra["aux_loss_mean"] = mean_step_figures(runs[0])["aux_loss_mean"]
            c.add(label, runs[:1], **d, **extra)
    return judge_c7(c)


def judge_c7(c: Claim) -> Claim:
    measured = {k: v["fraction_zero_for_100_steps"] for k, v in c.entries(backend="real")}
    c.verdict, ok = c7_verdict(measured)
    found = "; ".join(f"{k}: {100 * v['fraction_zero_for_100_steps']:.1f}% of expert instances"
                      for k, v in c.numbers.items())
    if c.verdict == UNTESTABLE:
        c.why = (f"Found: {found or 'no run'}. These counts come from the simulator's synthetic workload (M4), whose "
                 "expert popularity is set by a Zipf exponent: how many experts starve is an input of the "
                 "scenario, not a finding, and no aux loss acts on it. Testing the claim needs routing learnt by a "
                 "router under an aux loss: run with --backends sim,real (the real router on the same scenarios).")
    else:
        c.why = (f"Experts (layer, expert instances) that no rank routed a slot to for 100 consecutive steps: "
                 f"{found} (claimed 37%). The real router trains a tiny model on the testbed's synthetic task; "
                 "aux_loss_mean is the mean aux loss over the measured steps.")
        c.conditions = ("On tiny models (4 CPU ranks) trained on the testbed's synthetic clustered task for 110 steps"
                        + (f"; agrees on: {names(ok)}." if c.verdict == CONDITIONAL else "."))
    return c


# ---- C8 -----------------------------------------------------------------------------------
def c8(ledger: Ledger) -> Claim:
    c = Claim("C8")
    source, small, big = ledger.page_sizes()
    for label, res in ((f"{source}", small),
                       (f"{ledger.seed_label(False)}, h200 profile, all-reduce sync, MB pages", big)):
        if res is None:
            continue
        others = [k for k in res.sweep.keys if k != PAGE]
        for backend in backends_of(res):
            groups: dict[tuple, dict[int, list[dict]]] = {}
            for (i, b, _), s in sorted(res.summaries.items()):
                if b == backend:
                    key = tuple((k, res.grid[i].get(k)) for k in others)
                    groups.setdefault(key, {}).setdefault(parse_bytes(res.grid[i][PAGE]), []).append(s)
            for key, by_size in groups.items():
                setting = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in key)
                name = f"{label}{' ' + setting if setting else ''}, {side(backend)}"
                for size, runs in sorted(by_size.items()):
                    c.add(f"{name}{PAGE_LABEL}{format_bytes(size)}", runs, page_size_bytes=size,
                          step_time_s=mean(s["step_time_s"] for s in runs),
                          page_moves_per_step=mean(s["page_moves_per_step"] for s in runs),
                          peak_memory_bytes=mean(s["peak_memory_bytes"] for s in runs))
    return judge_c8(c)


PAGE_LABEL = ", page "  # C8: a scenario's label is its setting, this, and its page size


def judge_c8(c: Claim) -> Claim:
    groups: dict[str, dict[int, float]] = {}
    for label, v in c.entries():
        groups.setdefault(label.rsplit(PAGE_LABEL, 1)[0], {})[v["page_size_bytes"]] = v["step_time_s"]
    checks: dict[str, bool] = {}
    bests = []
    for name, steps in groups.items():
        best = best_page_size(steps)
        slower = ", ".join(f"{format_bytes(k)} {100 * (steps[k] / steps[best] - 1):+.2f}%"
                           for k in sorted(steps) if k != best)
        bests.append(f"{name}: best {format_bytes(best)} (others: {slower or 'none'})")
        check = c8_check(steps)
        if check is not None:
            checks[name] = check
    c.judge(checks, "Agrees on")
    c.why = ("Page size with the shortest step: " + ("; ".join(bests) or "no run") + ". The claim's sizes (8, 16, "
             "32 MiB) can only be tested where experts are MB-sized (the seed's shapes: 176 MB per expert); the "
             "small scenario's KiB pages show only the shape of the trade-off.")
    if c.verdict == UNTESTABLE:
        c.why = "No scenario with 8, 16 and 32 MiB pages was run. " + c.why
    return c


# ---- C9 -----------------------------------------------------------------------------------
def c9(ledger: Ledger) -> Claim:
    """The pages each forward read, counted by the pager on the runs' own routing
    (``first_pages_shares``): the seed's scenario (two-stage sync, paged, simulated) and
    configs/paging-pressure.toml at its shipped page size on each backend."""
    c = Claim("C9")
    runs = at(ledger.seed(), "sim", comm__expert_sync="two_stage", pager__enabled=True)
    _, small, _ = ledger.page_sizes()
    shipped = ledger.config("paging-pressure").pager
    sources = [(f"{ledger.seed_label()}, simulated", runs[:1])]
    for backend in backends_of(small):
        if backend == "sim" and ledger.real:
            continue  # a replay of the measured routing: the pager counts the same forwards
        sources.append((f"paging-pressure, {side(backend)}", [s for s in at(small, backend) if
                                                             scenario_of(s).pager.page_size_bytes
                                                             == shipped.page_size_bytes][:1]))
    for label, rs in sources:
        if not rs:
            continue
        s = scenario_of(rs[0])
        first, read = first_pages_shares(rs[0], C9_FIRST)
        pages = -(-s.model.expert_bytes // s.pager.page_size_bytes)
        needed = zipf_exponent_for(pages, C9_COVER, C9_FIRST)
        c.add(f"{label}, page {format_bytes(s.pager.page_size_bytes)}", rs[:1], expert_bytes=s.model.expert_bytes,
              page_size_bytes=s.pager.page_size_bytes, pages_per_expert=pages, forwards_counted=len(first),
              share_of_forwards_covered_by_first_3_pages=(float(np.mean([c9_forward_covered(x) for x in first]))
                                                          if len(first) else None),
              mean_share_of_reads_on_first_3_pages=float(first.mean()) if len(first) else None,
              share_of_pages_read_per_forward=float(read.mean()) if len(read) else None,
              **({"zipf_exponent_the_claim_needs": needed} if needed is not None else {}))
    return judge_c9(c)


def judge_c9(c: Claim) -> Claim:
    checks = {}
    for k, v in c.entries():
        check = c9_check(v["pages_per_expert"], v["share_of_forwards_covered_by_first_3_pages"])
        if check is not None:
            checks[k] = check
    ok = c.judge(checks, "Agrees on")
    parts = "; ".join(
        f"{k}: {v['pages_per_expert']} pages per expert, {v['forwards_counted']} forwards, the first 3 pages took "
        + (f"{100 * v['mean_share_of_reads_on_first_3_pages']:.1f}% of the bytes a forward read on average and at "
           f"least {100 * (C9_COVER - C9_TOL):.0f}% in {100 * v['share_of_forwards_covered_by_first_3_pages']:.1f}% "
           f"of forwards; a forward read {100 * v['share_of_pages_read_per_forward']:.0f}% of its expert's pages"
           if v["forwards_counted"] else "nothing (no forward)")
        + (f" (the claim needs page reads ~ 1/(k+1)^{v['zipf_exponent_the_claim_needs']:.2f})"
           if "zipf_exponent_the_claim_needs" in v else "")
        for k, v in c.numbers.items())
    how = ("Counted by the pager (testbed.policy.pager.RankPager, the page table of both backends) on each run's own "
           "routing (routing.npz, measured steps, the first EP group's ranks): after each layer's access, the pins "
           "of each expert's pages times their bytes. The real ranks' own read counter (PagedExpertStore.page_reads) "
           "is not written to the run folder; tests/test_page_access.py checks it counts every page of an expert "
           "alike.")
    if c.verdict == UNTESTABLE:
        c.why = ((f"{parts}. " if parts else "No run of the seed's or the paging-pressure scenario. ")
                 + "The claim needs experts of more than 3 pages (with at most 3 the first 3 are the whole expert). "
                 + how)
        return c
    c.why = (f"{parts} (claimed: the first 3 pages take 87% of the accesses in 92% of forwards). {how} An expert is a "
             "dense FFN (w1: H x F, w2: F x H): every forward that gives it a token reads all of its pages once, "
             "so the first 3 take 3 pages' share of its bytes. Accesses skewed within an expert, as the claim "
             "needs, would need sparse or partial expert computation (activation sparsity, its often-used hidden "
             "units paged first), which a dense MoE FFN does not do.")
    if c.verdict == CONDITIONAL:
        c.conditions = f"Agrees on: {names(ok)}."
    return c


# ---- C10 ----------------------------------------------------------------------------------
def c10(ledger: Ledger) -> Claim:
    c = Claim("C10")
    steps = 21 if ledger.quick else 41
    base = ledger.config("heat-drift", run={"steps": steps, "warmup_steps": 1})
    never = 10 * steps
    res = ledger.both("claims_heat_interval", base, axes={"heat.update_interval": [1, 10, never]})
    for backend in backends_of(res):
        figs = {}
        for n in (1, 10, never):
            runs = at(res, backend, heat__update_interval=n)
            f = [mean_step_figures(s) for s in runs]
            # the simulator is deterministic (one run a point): no noise; one measured run: unknown
            noise = 0.0 if backend == "sim" else spread([x["mean_step_s"] for x in f])
            figs[n] = {"mean_step_s": mean(x["mean_step_s"] for x in f),
                       "mean_heat_s": mean(x["mean_heat_s"] for x in f), "runs": runs, "spread": noise}
        base_t = figs[never]["mean_step_s"]
        for n in (1, 10, never):
            name = "never (no update in the run)" if n == never else f"every {n} step{'s' if n > 1 else ''}"
            vals = {"heat_update_interval": n, "mean_step_s": figs[n]["mean_step_s"],
                    "heat_stage_share": figs[n]["mean_heat_s"] / figs[n]["mean_step_s"],
                    "run_to_run_spread": figs[n]["spread"]}
            if n != never:
                vals["step_overhead_vs_never"] = figs[n]["mean_step_s"] / base_t - 1
                both = (figs[n]["spread"], figs[never]["spread"])
                vals["overhead_noise"] = None if None in both else sum(both)
            c.add(f"heat-drift ({steps} steps), heat update {name}, {side(backend)}", figs[n]["runs"], **vals)
    return judge_c10(c)


def judge_c10(c: Claim) -> Claim:
    outcomes: dict[str, str] = {}
    for backend in ("sim", "real"):
        at_n = {v["heat_update_interval"]: v for _, v in c.entries(backend=backend) if "step_overhead_vs_never" in v}
        if 1 in at_n and 10 in at_n:
            for part, o in c10_checks(at_n[1]["step_overhead_vs_never"], at_n[10]["step_overhead_vs_never"],
                                      at_n[1]["overhead_noise"], at_n[10]["overhead_noise"]).items():
                outcomes[f"heat-drift, {side(backend)}: {part}"] = o
    c.verdict, by = from_outcomes(outcomes)
    parts = "; ".join(f"{k}: {100 * v['step_overhead_vs_never']:+.2f}% step "
                      f"({noise_note(v['overhead_noise'], v['backend'])}), heat stage "
                      f"{100 * v['heat_stage_share']:.2f}% of it"
                      for k, v in c.numbers.items() if "step_overhead_vs_never" in v)
    c.conditions = " ".join(f"{title}: {names(by[o])}." for o, title in
                            ((AGREES, "Agrees for"), (WITHIN_NOISE, "Within the runs' noise (neither agrees nor "
                                                      "differs)"), (DIFFERS, "Differs for"))
                            if by[o] and c.verdict in (CONDITIONAL, FAILS, UNTESTABLE))
    c.why = ("Mean step time (steps.jsonl, measured steps) with a heat update every step and every 10 steps, "
             f"against the same scenario with no update in the run: {parts or 'no run'} (claimed +12% and +0.3%). "
             "The step overhead includes what the updates set off (cold migrations, prefetches, wake-ups); the heat "
             "stage is the update itself. Noise: the two points' run-to-run spreads ((max - min) / mean of the "
             "repeats' mean steps) added; the simulator is deterministic (none). An overhead inside its noise "
             "cannot be told from no overhead, so it agrees with no precise figure: 'within noise' where the "
             "claimed figure is inside the noise too, 'differs' where it is not.")
    if c.verdict == UNTESTABLE and outcomes:
        c.why += " Every part is within the runs' noise: more repeats (--repeats) or longer runs could decide."
    elif c.verdict == HOLDS:
        c.conditions = ""
    return c


JUDGES = {"C2": judge_c2, "C7": judge_c7, "C8": judge_c8, "C9": judge_c9, "C10": judge_c10}
