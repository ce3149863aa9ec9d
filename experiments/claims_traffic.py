"""Claims ledger, token traffic and placement: C11 (placement), C13 (all-to-all bytes), C15
(hybrid placement) and C16 (all-to-all share of the step). Loaded by
``experiments/claims.py``; the expert-sync claims are in ``claims_sync.py``.

Each claim has two halves, as in ``claims_sync.py``: ``cN(ledger)`` collects the numbers,
``judge_cN(claim, ...)`` judges them alone (tests/experiments/test_claim_verdicts.py).
"""

from __future__ import annotations

from testbed.model.model_card import model_card
from testbed.study.claims_ledger import (
    PAYLOAD,
    PUBLISHED,
    Ledger,
    at,
    backends_of,
    names,
    side,
)
from testbed.study.run_figures import (
    mean,
    network_bytes,
    scenario_of,
    spread,
    token_share,
    token_time,
)
from testbed.study.verdicts import (
    C16_BOUND,
    C16_HEALTHY,
    CONDITIONAL,
    FAILS,
    UNTESTABLE,
    Claim,
    c11_check,
    c13_check,
    c13_closed_form,
    c13_verdict,
    c15_checks,
    c16_band,
    c16_check,
    from_checks,
    held_to_conditional,
    noise_note,
)


# ---- C11 ----------------------------------------------------------------------------------
def c11(ledger: Ledger) -> Claim:
    c = Claim("C11")
    mod, res = ledger.experiment("sweep_placement")
    if res is not None:
        pts = res.points()
        for backend in ("sim", "real"):
            for ep in sorted({p[mod.EP] for p in pts}):
                sel = {p[mod.PLACE]: p for p in pts if p[mod.EP] == ep and p.get(backend)}
                if "topology" not in sel:
                    continue
                t0 = token_time(sel["topology"].get(backend) or {})
                step0 = sel["topology"][backend]["step_time_s"]
                for other in ("strided", "random"):
                    if other not in sel or not t0:
                        continue
                    runs = [s for (i, b, _), s in sorted(res.summaries.items()) if b == backend
                            and res.grid[i][mod.EP] == ep and res.grid[i][mod.PLACE] in ("topology", other)]
                    c.add(f"sweep_placement (8 ranks) EP {ep}, {other} vs topology, {side(backend)}", runs,
                          token_time_ratio=token_time(sel[other].get(backend) or {}) / t0,
                          speed_vs_topology=step0 / sel[other][backend]["step_time_s"])
    return judge_c11(c)


def judge_c11(c: Claim) -> Claim:
    c.verdict, ok = from_checks({k: c11_check(v["token_time_ratio"]) for k, v in c.entries()})
    parts = "; ".join(f"{k}: token stages x{v['token_time_ratio']:.2f}, speed x{v['speed_vs_topology']:.2f}"
                      for k, v in c.numbers.items())
    c.why = (f"Time in the token stages (dispatch, combine, their backward) with a topology-ignorant placement over "
             f"the topology-aware one: {parts or 'no run'} (claimed 3.2x). The '0.9x Megatron speed' half is not "
             "testable: there is no Megatron-LM baseline; speed_vs_topology is the step speed against the "
             "topology-aware placement instead.")
    c.conditions = ("The 0.9x-Megatron half is not tested." + (f" Agrees on: {names(ok)}." if c.verdict == CONDITIONAL
                                                                else ""))
    held_to_conditional(c)
    return c


# ---- C13 ----------------------------------------------------------------------------------
def c13(ledger: Ledger) -> Claim:
    """The claim's own shape (the seed's model on one node of 8 GPUs, EP 8, fp16, dropless)
    against its 1 GB and 32 GB, and every published scenario (``Ledger.published``, its own
    payload dtype) against the claim's closed form on that model's own shape."""
    c = Claim("C13")
    base = ledger.seed_base(at_scale=False, cluster={"nodes_per_microcluster": 1, "microclusters": 1},
                            parallelism={"ep_size": 8}, model={"dtype": "fp16"}, router={"capacity_factor": 0.0},
                            pager={"enabled": False}, comm={"expert_sync": "allreduce"})
    runs = at(ledger.sim_only("claims_a2a_bytes", base), "sim")
    if runs:
        s = scenario_of(runs[0])
        c.add(f"the claim's shape (H={s.model.hidden_size}, top-{s.model.top_k}, "
              f"B={s.workload.tokens_per_rank * s.parallelism.ep_size} tokens per EP group of "
              f"{s.parallelism.ep_size}, {s.model.dtype}, {s.model.num_layers} layers, dropless)", runs,
              claim_shape=True, **a2a_figures(runs[0], s))
    for stem, by in ledger.published().items():
        # the file's own payload: "model" unless the file says fp8
        own = by.get(ledger.opts.base(PUBLISHED / f"{stem}.toml").comm.payload_dtype)
        if own is not None:
            s = scenario_of(own)
            c.add(f"{stem} (configs/published: EP {s.parallelism.ep_size}, ETP {s.parallelism.etp_size}, "
                  f"TP {s.parallelism.tp_size}, {s.comm.token_strategy})", [own], claim_shape=False,
                  **a2a_figures(own, s))
    return judge_c13(c)


def a2a_figures(summary: dict, s) -> dict:
    """A run's forward and backward dispatch + combine bytes (``bytes_by_stage``: all ranks,
    per step) per MoE layer and per step, beside the claim's closed form on the run's own
    shape (``c13_closed_form``: B tokens a step over the whole world, every MoE layer routing
    all of them)."""
    b, card = summary["bytes_by_stage"], model_card(s)
    moe_layers = card.moe_layers
    fwd = b["dispatch"] + b["combine"]
    bwd = b["combine_backward"] + b["dispatch_backward"]
    # every GPU of a pipeline stage routes its tokens_per_rank at each of the stage's MoE layers
    tokens = s.workload.tokens_per_rank * s.world_size // s.parallelism.pp_size
    per_element = card.dispatch_bytes_per_token_per_moe_layer // (s.model.top_k * s.model.hidden_size)
    formula = c13_closed_form(tokens, s.model.top_k, s.model.hidden_size, per_element)
    return {"dispatch_plus_combine_bytes_per_layer": fwd / moe_layers, "forward_bytes_per_step": fwd,
            "forward_and_backward_bytes_per_step": fwd + bwd,
            "backward_bytes_per_moe_layer": bwd / moe_layers, "moe_layers": moe_layers,
            "tokens_per_step": tokens, "top_k": s.model.top_k, "hidden_size": s.model.hidden_size,
            "payload_bytes_per_element": per_element, "closed_form_bytes_per_moe_layer": formula,
            "closed_form_bytes_per_step": formula * moe_layers, "measured_over_closed_form": fwd / moe_layers / formula,
            "dropped_token_fraction": summary["dropped_token_fraction"], "ep_size": s.parallelism.ep_size}


def judge_c13(c: Claim) -> Claim:
    """The claim's shape against 1 GB and 32 GB (``c13_verdict``); each published scenario's
    forward bytes per MoE layer against the closed form on its own shape (``c13_check``)."""
    if not c.numbers:
        c.why = "Simulated only; no simulated run (the sim backend was not chosen)."
        return c
    checks = {k: (c13_verdict(v["dispatch_plus_combine_bytes_per_layer"], v["forward_bytes_per_step"]) != FAILS
                  if v["claim_shape"] else c13_check(v["dispatch_plus_combine_bytes_per_layer"],
                                                     v["closed_form_bytes_per_moe_layer"]))
              for k, v in c.entries()}
    c.verdict, ok = from_checks(checks)
    shape = [(k, v) for k, v in c.numbers.items() if v["claim_shape"]]
    parts = [f"{k}: {v['dispatch_plus_combine_bytes_per_layer'] / 1e9:.3g} GB per MoE layer forward, "
             f"{v['forward_bytes_per_step'] / 1e9:.4g} GB per step forward, "
             f"{v['forward_and_backward_bytes_per_step'] / 1e9:.4g} GB with the backward (claimed ~1 GB and 32 GB; "
             f"closed form {v['closed_form_bytes_per_moe_layer'] / 1e9:.3g} GB a layer)" for k, v in shape]
    parts += [f"{short(k)}: {v['dispatch_plus_combine_bytes_per_layer'] / 1e9:.4g} GB a MoE layer against 2 x "
              f"{v['tokens_per_step']} x {v['top_k']} x {v['hidden_size']} x {v['payload_bytes_per_element']} B = "
              f"{v['closed_form_bytes_per_moe_layer'] / 1e9:.4g} GB (x{v['measured_over_closed_form']:.3f}, EP "
              f"{v['ep_size']})" for k, v in c.numbers.items() if not v["claim_shape"]]
    c.why = ("The planner's dispatch + combine payload (bytes_by_stage, all ranks, per step) over the MoE layers, "
             "against the claim's arithmetic on each run's own shape: dispatch and combine each B x top-k x H x "
             "bytes per element (B: the tokens of a step, in the run's payload dtype), per MoE layer; per step x "
             f"the MoE layers. {'; '.join(parts)}. The slots that stay on their own rank (1/EP of them under "
             "balanced routing) cross no link and are not counted; expert tensor parallelism's all-gathers and "
             "DeepEP's per-node forwarding move bytes the closed form leaves out.")
    c.conditions = ("Per step means the forward's dispatch + combine; the backward moves as much again. On the "
                    "claim's shape against its 1 GB and 32 GB; on each published scenario against the closed form "
                    f"within 15%. Agrees on: {names(short(k) for k in ok) or 'none'}.")
    held_to_conditional(c)
    return c


def short(label: str) -> str:
    """A ledger label without its parenthesis: the published file's stem."""
    return label.split(" (")[0]


# ---- C15 ----------------------------------------------------------------------------------
def c15(ledger: Ledger) -> Claim:
    c = Claim("C15")
    base = ledger.config("quickstart", pager={"enabled": False}, comm={"expert_sync": "allreduce"})
    if ledger.quick:
        base = base.replace(run={"steps": 5, "warmup_steps": 1})
    points = [{"parallelism.ep_size": 1, "parallelism.placement": "topology"},
              {"parallelism.ep_size": 4, "parallelism.placement": "strided"},
              {"parallelism.ep_size": 4, "parallelism.placement": "topology"}]
    res = ledger.both("claims_hybrid", base, points=points)
    layouts = {(1, "topology"): "pure replication (EP 1)",
               (4, "strided"): "hybrid (EP 4 across the 4 nodes, each expert's 2 replicas in one node)",
               (4, "topology"): "EP 4 inside a micro-cluster (topology placement), for reference"}
    for backend in backends_of(res):
        got = {}
        for (ep, place), name in layouts.items():
            runs = at(res, backend, parallelism__ep_size=ep, parallelism__placement=place)
            if not runs:
                continue
            got[(ep, place)] = (mean(network_bytes(s) for s in runs), mean(s["peak_memory_bytes"] for s in runs))
            c.add(f"quickstart, paging off, {name}, {side(backend)}", runs, network_bytes_per_step=got[(ep, place)][0],
                  inter_node_bytes_per_step=mean(s["bytes_by_level"]["leaf"] + s["bytes_by_level"]["spine"]
                                                 for s in runs),
                  peak_memory_bytes=got[(ep, place)][1])
        if (1, "topology") in got and (4, "strided") in got:
            (cp, mp), (ch, mh) = got[(1, "topology")], got[(4, "strided")]
            c.add(f"hybrid vs pure replication, {side(backend)}",
                  at(res, backend, parallelism__ep_size=1) + at(res, backend, parallelism__ep_size=4,
                                                                 parallelism__placement="strided"),
                  comm_reduction=1 - ch / cp, memory_reduction=1 - mh / mp)
    return judge_c15(c)


def judge_c15(c: Claim) -> Claim:
    checks: dict[str, bool] = {}
    for _, v in c.entries():
        if "comm_reduction" in v:
            for part, ok in c15_checks(v["comm_reduction"], v["memory_reduction"]).items():
                checks[f"{side(v['backend'])}: {part}"] = ok
    c.verdict, ok = from_checks(checks)
    parts = "; ".join(f"{k}: comm {100 * v['comm_reduction']:+.0f}%, memory {100 * v['memory_reduction']:+.0f}%"
                      for k, v in c.numbers.items() if "comm_reduction" in v)
    c.why = (f"Reductions of network bytes per step (NVLink + leaf + spine payload) and of peak memory, hybrid against "
             f"pure replication: {parts or 'no run'} (claimed -63% and -38%; positive = less). Mapping: pure "
             "replication = parallelism.ep_size 1 (every GPU holds every expert, tokens stay local, expert gradients "
             "all-reduced over all 8 GPUs); hybrid = ep_size 4 with strided placement (each EP group takes one GPU "
             "of every node, so an expert's replicas are the GPUs of one node). Paging is off so that memory holds "
             "every local expert; expert sync is the all-reduce.")
    c.conditions = ("On the quickstart cluster (8 ranks, 2 per node) and model; the reductions depend on the ratio of "
                    "token bytes to expert bytes." + (f" Agrees only for: {names(ok)}." if c.verdict == CONDITIONAL
                                                       else ""))
    held_to_conditional(c)
    return c


# ---- C16 ----------------------------------------------------------------------------------
def c16(ledger: Ledger) -> Claim:
    """The all-to-all share of the shipped scenarios (for reading), and docs/claims.md's test:
    pairs of runs whose dispatch/combine payload is the model's dtype and fp8
    (``Ledger.a2a_payload``): the step-time gain against the share."""
    c = Claim("C16")
    _, cmp = ledger.experiment("compare_strategies")
    sources = []
    for backend in backends_of(cmp):
        sources.append((f"quickstart, {side(backend)}", at(cmp, backend, comm__token_strategy="alltoall",
                                                            comm__expert_sync="two_stage")))
    for cfg, res in ledger.routing_runs().items():
        for backend in backends_of(res):
            sources.append((f"{cfg} (110 steps), {side(backend)}", at(res, backend)))
    source, small, _ = ledger.page_sizes()
    shipped = ledger.config("paging-pressure").pager
    for backend in backends_of(small):
        runs = [s for s in at(small, backend)
                if (scenario_of(s).pager.page_size_bytes, scenario_of(s).pager.gpu_budget_bytes)
                == (shipped.page_size_bytes, shipped.gpu_budget_bytes)]
        sources.append((f"paging-pressure ({source}), {side(backend)}", runs))
    sources.append((f"{ledger.seed_label()}, simulated", at(ledger.seed(), "sim", comm__expert_sync="two_stage",
                                                              pager__enabled=True)))
    for label, runs in sources:
        share = mean(token_share(s) for s in runs)
        if share is not None:
            c.add(label, runs, a2a_share_of_step=share, band=c16_band(share))
    for label, res in ledger.a2a_payload().items():
        for backend in backends_of(res):
            points: dict[tuple, dict[str, list[dict]]] = {}
            for (i, b, _), s in sorted(res.summaries.items()):
                if b == backend:
                    key = tuple((k, v) for k, v in res.grid[i].items() if k != PAYLOAD)
                    points.setdefault(key, {}).setdefault(res.grid[i][PAYLOAD], []).append(s)
            for key, by in points.items():
                if "model" not in by or "fp8" not in by:
                    continue
                plain, fp8 = by["model"], by["fp8"]
                share = mean(token_share(s) for s in plain)
                t, t8 = mean(s["step_time_s"] for s in plain), mean(s["step_time_s"] for s in fp8)
                # the simulator is deterministic: no noise; one measured run a point: unknown
                sp = (0.0, 0.0) if backend == "sim" else (spread([s["step_time_s"] for s in plain]),
                                                          spread([s["step_time_s"] for s in fp8]))
                setting = "".join(f", {k.rsplit('.', 1)[-1]} {v}" for k, v in key)
                c.add(f"{label}{setting}, {side(backend)}: payload model dtype vs fp8", plain + fp8,
                      a2a_share_of_step=share, band=c16_band(share), step_time_s=t, step_time_fp8_payload_s=t8,
                      step_gain_with_fp8_payload=1 - t8 / t, gain_noise=None if None in sp else sum(sp))
    for stem, by in ledger.published().items():  # the published runs, each with its payload as fp8 beside
        if "model" in by and "fp8" in by:
            plain, fp8 = by["model"], by["fp8"]
            share, t, t8 = token_share(plain), plain["step_time_s"], fp8["step_time_s"]
            if share is not None:
                c.add(f"{stem} (configs/published), simulated: payload model dtype vs fp8", [plain, fp8],
                      a2a_share_of_step=share, band=c16_band(share), step_time_s=t, step_time_fp8_payload_s=t8,
                      step_gain_with_fp8_payload=1 - t8 / t, gain_noise=0.0, published=True)
    return judge_c16(c)


def judge_c16(c: Claim) -> Claim:
    checks: dict[str, bool] = {}
    untested = []
    for backend in ("sim", "real"):
        pairs = [(v["a2a_share_of_step"], v["step_gain_with_fp8_payload"], v["gain_noise"])
                 for _, v in c.entries(backend=backend) if "step_gain_with_fp8_payload" in v]
        if not pairs:
            continue
        check = c16_check(pairs)
        if check is not None:
            checks[f"{side(backend)} scenarios"] = check
            continue
        missing = [what for what, none in (("none above 35%", all(s <= C16_BOUND for s, _, _ in pairs)),
                                           ("none below 25%", all(s >= C16_HEALTHY for s, _, _ in pairs)),
                                           ("a noise unknown (one run a point)", any(n is None for _, _, n in pairs)))
                   if none]
        untested.append(f"{side(backend)} ({', '.join(missing)})")
    c.verdict, ok = from_checks(checks)
    shares = "; ".join(f"{k}: {100 * v['a2a_share_of_step']:.0f}% ({v['band']})" for k, v in c.numbers.items()
                       if "step_gain_with_fp8_payload" not in v)
    published = "; ".join(f"{short(k)}: {100 * v['a2a_share_of_step']:.0f}% ({v['band']}), fp8 payload step "
                          f"{100 * v['step_gain_with_fp8_payload']:+.1f}%"
                          for k, v in c.numbers.items() if v.get("published"))
    gains = "; ".join(f"{k}: share {100 * v['a2a_share_of_step']:.0f}%, step "
                      f"{100 * v['step_gain_with_fp8_payload']:+.1f}% ({noise_note(v['gain_noise'], v['backend'])})"
                      for k, v in c.numbers.items() if "step_gain_with_fp8_payload" in v and not v.get("published"))
    c.why = ("The share of dispatch, combine and their backward in the step (medians per stage / median step; a "
             "stage's whole time, exposed or hidden behind compute, so overlapping stages can sum past the step) on "
             f"the shipped scenarios: {shares or 'no run'}. The test (docs/claims.md): shrinking the all-to-all "
             "(comm.payload_dtype = fp8: half of bf16's payload bytes, a quarter of fp32's) should shorten steps "
             "above 35% clearly more than steps below 25%; step time saved (positive = shorter) against the share: "
             f"{gains or 'no pair of runs'}. The published scenarios (configs/published, simulated; share with the "
             f"model's payload dtype, step saved with fp8): {published or 'no run'}.")
    if untested:
        c.why += (f" Not testable on the {' and '.join(untested)} side: the test needs a scenario on each side of "
                  "the bands (above 35% and below 25%) and a known noise (more than one run a point).")
    if c.verdict == UNTESTABLE:
        c.why += " No backend could test the threshold."
    c.conditions = ("Read as docs/claims.md tests it: 'A2A is the bottleneck' means shrinking the all-to-all shortens "
                    "the step clearly more than where it is healthy; the gain of a scenario grows with its share of "
                    "the step, so this tests the bands' order, not that 25% and 35% are where anything changes."
                    + (f" Agrees on: {names(ok)}." if c.verdict == CONDITIONAL else "")
                    if c.verdict != UNTESTABLE else "")
    held_to_conditional(c)
    return c


JUDGES = {"C11": judge_c11, "C13": judge_c13, "C15": judge_c15, "C16": judge_c16}
