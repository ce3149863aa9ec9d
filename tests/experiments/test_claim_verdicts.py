"""Every verdict every claim C1-C16 can reach, from given numbers (no backend runs): the
claims ledger's ``judge_cN`` functions (experiments/claims.py, claims_memory.py,
claims_sync.py, claims_traffic.py) turn a claim's numbers into its verdict, conditions and reason, so no
machine's noise can lead the ledger into code no test has run. Also the noise-aware
rule (C10), C9's and C16's rules and C2's page budget."""

from __future__ import annotations

import pytest

from testbed.report.claims import claim_section
from testbed.study import verdicts as V
from testbed.study.claims_ledger import page_budget_from
from testbed.study.experiments import load_experiment

MiB, KiB = 2**20, 2**10
CLAIMS = load_experiment("claims")
JUDGES = CLAIMS.JUDGES
H, F, C, U = V.HOLDS, V.FAILS, V.CONDITIONAL, V.UNTESTABLE


def claim(cid: str, entries: dict[str, dict]) -> V.Claim:
    """A claim with these numbers (label -> figures, ``backend`` among them; sim if not given)."""
    return V.Claim(cid, numbers={k: {"backend": "sim", **v, "runs": [f"run-{i}"]}
                                 for i, (k, v) in enumerate(entries.items())})


def judged(cid: str, entries: dict[str, dict], **facts) -> V.Claim:
    return JUDGES[cid](claim(cid, entries), **facts)


# ---- synthetic numbers, one case per verdict a claim can reach -------------------------------
def c1(speedup, published=1.29, refused=True):
    """C1's numbers: Megatron-LM's layout a ``speedup`` x slower than the seed's system, and
    ``published`` x slower than MegaScale-MoE's layout alone (paging refused where ``refused``)."""
    out = {"Megatron-LM layout (1,440 H800)": {"step_time_s": float(speedup)},
           "MegaScale-MoE layout (1,440 H800)": {"step_time_s": speedup / published},
           "MegaScale-MoE layout (1,440 H800) + heat map + two-stage sync": {"step_time_s": 1.0},
           "MegaScale-MoE over Megatron-LM": {"megatron_step_time_s": float(speedup),
                                              "megascale_step_time_s": speedup / published, "speedup": published},
           "the seed's system over Megatron-LM": {
               "seed_system": "MegaScale-MoE layout (1,440 H800) + heat map + two-stage sync",
               "seed_step_time_s": 1.0, "baseline_step_time_s": float(speedup), "speedup": float(speedup),
               "megascale_layout_step_ratio": speedup / published}}
    if refused:
        out["MegaScale-MoE layout (1,440 H800) + paging"] = {"refused": "pager.enabled = True: not with pipelines"}
    return out


def c2(on_gb, off_gb, used=23 * 2**30, derived=23 * 2**30, config=23 * 2**30):
    out = {"paging on": {"pager_enabled": True, "pager_budget_bytes": used, "peak_memory_GB": on_gb,
                         "fits_in_device_memory": True},
           "paging off": {"pager_enabled": False, "peak_memory_GB": off_gb, "fits_in_device_memory": True,
                          "expert_weights_per_GPU_GB": 22.5, "device_memory_GB": 40.0}}
    if derived is not False:
        out["budget"] = {"device_memory_bytes": 40e9, "non_expert_memory_bytes": 14.2e9, "free_margin_bytes": 2e9,
                         "page_size_bytes": 16 * MiB, "derived_page_budget_bytes": derived,
                         "config_page_budget_bytes": config}
    return out


def c3(*ratios):
    return {f"scenario {i}": {"expert_sync_bytes_allreduce": 1000, "expert_sync_bytes_two_stage": 1000 * r,
                              "two_stage_over_allreduce": r} for i, r in enumerate(ratios)}


def c4(nv_ar, nv_ts, ib_ar, ib_ts):
    return {"seed": {"nvlink_util_allreduce": nv_ar, "nvlink_util_two_stage": nv_ts,
                     "infiniband_util_allreduce": ib_ar, "infiniband_util_two_stage": ib_ts}}


def c5(rate_at_100, other_rate, discovery_ms=None):
    out = {f"sweep size {n}, simulated": {"cache_size": n, "group_cache_hit_rate": r}
           for n, r in ((10, 0.5), (100, rate_at_100))}
    out["sparse"] = {"group_cache_hit_rate": other_rate, **({"discovery_ms": discovery_ms} if discovery_ms else {})}
    return out


def c6(*groups):
    return {f"scenario {i}": {"replicas": r, "median_active_group": m, "share_of_groups_with_every_replica": 0.1}
            for i, (r, m) in enumerate(groups)}


def c7(*entries):
    return {f"{b} {i}": {"backend": b, "fraction_zero_for_100_steps": x, "aux_loss_mean": 0.01}
            for i, (b, x) in enumerate(entries)}


def c8(*groups):
    return {f"setting {g}, page {size // MiB} MiB": {"page_size_bytes": size, "step_time_s": t}
            for g, steps in enumerate(groups) for size, t in steps.items()}


def mb(t8, t16, t32):
    return {8 * MiB: t8, 16 * MiB: t16, 32 * MiB: t32}


def c9(*entries):
    return {f"scenario {i}": {"pages_per_expert": p, "forwards_counted": 100,
                              "share_of_forwards_covered_by_first_3_pages": covered,
                              "mean_share_of_reads_on_first_3_pages": 0.9 if covered else 3 / p,
                              "share_of_pages_read_per_forward": 1.0}
            for i, (p, covered) in enumerate(entries)}


def c10(backend, ov1, ov10, noise1, noise10):
    def entry(n, ov, noise):
        return {"backend": backend, "heat_update_interval": n, "mean_step_s": 1.0, "heat_stage_share": 0.01,
                "run_to_run_spread": noise, "step_overhead_vs_never": ov, "overhead_noise": noise}
    return {f"every 1, {backend}": entry(1, ov1, noise1), f"every 10, {backend}": entry(10, ov10, noise10),
            f"never, {backend}": {"backend": backend, "heat_update_interval": 210, "mean_step_s": 1.0,
                                  "heat_stage_share": 0.0, "run_to_run_spread": noise1}}


def c11(*ratios):
    return {f"EP {i}": {"token_time_ratio": r, "speed_vs_topology": 1 / r} for i, r in enumerate(ratios)}


def c12(*slowdowns):
    return {f"layout {i}": {"expert_sync_nvlink_s": 0.01, "expert_sync_pcie_s": 0.01 * (1 + s),
                            "expert_sync_slowdown": s} for i, s in enumerate(slowdowns)}


def c13_figures(per_layer, layers, tokens, top_k, hidden, per_element, claim_shape):
    formula = V.c13_closed_form(tokens, top_k, hidden, per_element)
    return {"dispatch_plus_combine_bytes_per_layer": per_layer, "forward_bytes_per_step": per_layer * layers,
            "forward_and_backward_bytes_per_step": 2 * per_layer * layers, "moe_layers": layers,
            "tokens_per_step": tokens, "top_k": top_k, "hidden_size": hidden, "payload_bytes_per_element": per_element,
            "closed_form_bytes_per_moe_layer": formula, "closed_form_bytes_per_step": formula * layers,
            "measured_over_closed_form": per_layer / formula, "ep_size": 8, "claim_shape": claim_shape}


def c13(per_layer, step, *published):
    """The claim's shape (``per_layer``, ``step`` bytes) and published runs (per-layer bytes,
    measured over the closed form of 1,000 tokens, top-2, H 100, 2 B: 800,000 B)."""
    out = {"the claim's shape (H=4096, ...)": c13_figures(per_layer, step / per_layer, 32768, 2, 4096, 2, True)}
    for i, ratio in enumerate(published):
        out[f"model-{i} (configs/published: EP 8)"] = c13_figures(ratio * 800_000, 10, 1000, 2, 100, 2, False)
    return out


def c14(*drops):
    return {f"skew {i}": {"max_dropped_fraction_at_cf_1_1_to_1_25": d} for i, d in enumerate(drops)}


def c15(*reductions):
    out = {"pure replication, simulated": {"network_bytes_per_step": 1e6, "peak_memory_bytes": 1e6}}
    for b, (comm, mem) in zip(("sim", "real"), reductions):
        out[f"hybrid vs pure replication, {b}"] = {"backend": b, "comm_reduction": comm, "memory_reduction": mem}
    return out


def c16(*pairs):
    """(backend, share, gain, noise) per pair of runs, and one shipped scenario's share."""
    out = {"quickstart, simulated": {"a2a_share_of_step": 0.2, "band": V.c16_band(0.2)}}
    for i, (b, share, gain, noise) in enumerate(pairs):
        out[f"pair {i}, {b}"] = {"backend": b, "a2a_share_of_step": share, "band": V.c16_band(share),
                                 "step_time_s": 1.0, "step_time_fp8_payload_s": 1 - gain,
                                 "step_gain_with_fp8_payload": gain, "gain_noise": noise}
    return out


CASES = [
    ("C1", c1(1.88), {}, C),
    ("C1", c1(1.2), {}, F),
    ("C1", {}, {"missing": "No sim backend."}, U),
    ("C2", c2(17.5, 28.3), {}, C),
    ("C2", c2(35.5, 35.47), {}, F),
    ("C2", c2(17.5, 28.3, derived=False), {}, C),  # the config's budget, said so
    ("C2", c2(17.5, 28.3, derived=None), {}, C),  # nothing left for a page: the config's budget
    ("C2", c2(17.5, 28.3, config=16 * 2**30), {}, C),  # the config does not hold the derived budget
    ("C2", {}, {}, U),
    ("C3", c3(0.43, 0.42), {"same": ["scenario 0"]}, H),
    ("C3", c3(0.43, 1.0), {}, C),
    ("C3", c3(1.0), {}, F),
    ("C3", {}, {}, U),
    ("C4", c4(0.35, 0.89, 0.92, 0.61), {}, H),
    ("C4", c4(0.35, 0.40, 0.92, 0.90), {}, C),
    ("C4", c4(0.0, 0.0, 0.0, 0.0), {}, F),
    ("C4", {}, {}, U),
    ("C5", c5(0.995, 0.993, discovery_ms=0.1), {}, C),  # every check agrees: only half the claim is tested
    ("C5", c5(0.995, 0.5), {}, C),
    ("C5", c5(0.5, 0.5, discovery_ms=2.0), {}, F),
    ("C5", {}, {}, U),
    ("C6", c6((8, 3.0)), {}, H),
    ("C6", c6((8, 3.0), (45, 45.0), (2, 2.0)), {}, C),
    ("C6", c6((45, 45.0)), {}, F),
    ("C6", c6((2, 2.0)), {}, U),
    ("C7", c7(("real", 0.40)), {}, H),
    ("C7", c7(("real", 0.30), ("real", 0.0)), {}, C),
    ("C7", c7(("real", 0.0)), {}, F),
    ("C7", c7(("sim", 0.37)), {}, U),  # synthetic routing only
    ("C8", c8(mb(1.1, 1.0, 1.05)), {}, H),
    ("C8", c8(mb(1.1, 1.0, 1.05), mb(0.9, 1.0, 1.05)), {}, C),
    ("C8", c8(mb(1.002, 1.0, 1.05)), {}, F),
    ("C8", {"small, page 16 KiB": {"page_size_bytes": 16 * KiB, "step_time_s": 1.0},
            "small, page 64 KiB": {"page_size_bytes": 64 * KiB, "step_time_s": 0.9}}, {}, U),
    ("C9", c9((11, 0.95)), {}, H),
    ("C9", c9((11, 0.95), (5, 0.0)), {}, C),
    ("C9", c9((11, 0.0)), {}, F),
    ("C9", c9((2, 1.0)), {}, U),  # at most 3 pages: the first 3 are the whole expert
    ("C9", {}, {}, U),
    ("C10", c10("sim", 0.12, 0.003, 0.0, 0.0), {}, H),
    ("C10", c10("real", 0.12, 0.002, 0.01, 0.01), {}, C),  # every 10 steps inside the noise, as is 0.3%
    ("C10", c10("real", 0.03, 0.02, 0.0001, 0.0001), {}, F),
    ("C10", c10("real", 0.05, 0.002, 0.5, 0.5), {}, U),  # every part within noise
    ("C10", c10("real", 0.12, 0.003, None, None), {}, U),  # one run a point: noise unknown
    ("C10", {}, {}, U),
    ("C11", c11(3.2), {}, C),  # agrees, but the 0.9x-Megatron half is not tested
    ("C11", c11(3.2, 1.0), {}, C),
    ("C11", c11(1.0), {}, F),
    ("C11", {}, {}, U),
    ("C12", c12(0.47), {"profile_name": "pcie.toml", "nvlink_GBps": 240.0, "pcie_GBps": 25.0}, C),
    ("C12", c12(0.47, 8.0), {}, C),
    ("C12", c12(8.0), {}, F),
    ("C12", {}, {}, U),
    ("C13", c13(0.94e9, 30.1e9), {}, C),
    ("C13", c13(0.94e9, 30.1e9, 0.875, 1.0), {}, C),
    ("C13", c13(0.94e9, 30.1e9, 0.875, 1.72), {}, C),  # the claim's shape and one published run agree
    ("C13", c13(0.5e9, 16e9), {}, F),
    ("C13", c13(0.5e9, 16e9, 0.5), {}, F),
    ("C13", {}, {}, U),
    ("C14", c14(0.0, 0.0009), {}, H),
    ("C14", c14(0.0, 0.26), {}, C),
    ("C14", c14(0.0012), {}, F),
    ("C14", {}, {}, U),
    ("C15", c15((0.63, 0.38)), {}, C),  # agrees on the quickstart cluster only
    ("C15", c15((0.60, 0.25)), {}, C),  # the comm half agrees: the branch that crashed (issue 22, 13c)
    ("C15", c15((0.49, 0.25)), {}, F),
    ("C15", {}, {}, U),
    ("C16", c16(("sim", 0.41, 0.21, 0.0), ("sim", 0.21, 0.04, 0.0)), {}, C),
    ("C16", c16(("sim", 0.41, 0.21, 0.0), ("sim", 0.21, 0.04, 0.0), ("real", 0.40, -0.1, 0.05),
                ("real", 0.20, 0.0, 0.05)), {}, C),
    ("C16", c16(("sim", 0.41, 0.045, 0.0), ("sim", 0.21, 0.04, 0.0)), {}, F),  # less than 1 pp apart
    ("C16", c16(("real", 0.38, 0.1, None), ("real", 0.35, 0.1, 0.0)), {}, U),  # nothing below 25%
    ("C16", c16(("real", 0.41, 0.21, None), ("real", 0.21, 0.04, None)), {}, U),  # noise unknown
]
#: the verdicts each claim's rule can give (agreement on a claim tested in part or under a
#: reading is never a plain holds)
REACHABLE = {cid: {H, F, C, U} for cid in ("C3", "C4", "C6", "C7", "C8", "C9", "C10", "C14")}
REACHABLE.update({cid: {F, C, U} for cid in ("C1", "C2", "C5", "C11", "C12", "C13", "C15", "C16")})


@pytest.mark.parametrize("cid, entries, facts, verdict", CASES,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_every_branch_of_every_claim_on_given_numbers(cid, entries, facts, verdict):
    c = judged(cid, entries, **facts)
    assert c.verdict == verdict
    assert c.why and isinstance(c.why, str)
    if verdict == C:
        assert c.conditions
    page = claim_section(c.to_dict())  # the report renders every case
    assert verdict in page


def test_the_cases_reach_every_verdict_of_every_claim():
    reached: dict[str, set] = {}
    for cid, _, _, verdict in CASES:
        reached.setdefault(cid, set()).add(verdict)
    assert set(JUDGES) == {f"C{i}" for i in range(1, 17)} == set(reached)
    assert reached == REACHABLE


# ---- the numbers decide: change them and the verdict changes --------------------------------
def test_c2_verdict_follows_the_peaks_and_names_the_budgets_source():
    assert judged("C2", c2(17.5, 28.3)).verdict == C
    assert judged("C2", c2(35.5, 35.47)).verdict == F
    derived = judged("C2", c2(35.5, 35.47)).why
    assert "derived, not taken from the claim" in derived and "-0.1%" in derived
    assert "configs/paper-1440.toml's (no unpaged run" in judged("C2", c2(35.5, 35.47, derived=False)).why
    assert "should hold" in judged("C2", c2(35.5, 35.47, config=16 * 2**30)).why


def test_c9_verdict_follows_the_counted_page_reads():
    assert judged("C9", c9((11, 0.0))).verdict == F  # a dense FFN: every page read each forward
    assert judged("C9", c9((11, 0.90))).verdict == H  # the first 3 pages cover the claim in 90% of forwards
    assert judged("C9", c9((11, 0.86))).verdict == F  # below 92% - 5 pp
    assert judged("C9", c9((3, 1.0))).verdict == U


def test_c10_overhead_inside_the_noise_is_no_agreement_with_a_precise_figure():
    # +0.1% with a spread of 0.4%: the old rule (-0.2% .. +0.8%) read it as agreeing with +0.3%
    assert V.against_noise(0.001, 0.003, 0.005, 0.004) == V.WITHIN_NOISE
    # +0.05% inside a 0.1% noise, but +0.3% lies outside it: the runs tell the two apart
    assert V.against_noise(0.0005, 0.003, 0.005, 0.001) == V.DIFFERS
    # +0.6% out of a 0.1% noise, within 0.5 pp of +0.3%
    assert V.against_noise(0.006, 0.003, 0.005, 0.001) == V.AGREES
    assert V.against_noise(0.006, 0.003, 0.005, None) == V.WITHIN_NOISE  # noise unknown
    assert V.against_noise(0.20, 0.12, 0.04, 0.10) == V.WITHIN_NOISE  # off by more than the tolerance, less than the noise
    assert V.against_noise(0.20, 0.12, 0.04, 0.01) == V.DIFFERS
    # the same measured overheads, the noise changes the verdict
    assert judged("C10", c10("real", 0.12, 0.003, 0.001, 0.001)).verdict == H
    c = judged("C10", c10("real", 0.12, 0.003, 0.01, 0.01))
    assert c.verdict == C and "Within the runs' noise" in c.conditions and "every 10 steps" in c.conditions
    assert judged("C10", c10("real", 0.12, 0.0005, 0.001, 0.001)).verdict == C  # every 10 steps differs
    assert V.from_outcomes({}) == (U, {V.AGREES: [], V.WITHIN_NOISE: [], V.DIFFERS: []})


def test_c16_verdict_follows_the_gains_against_the_shares():
    healthy = ("sim", 0.21, 0.04, 0.0)
    assert judged("C16", c16(("sim", 0.41, 0.21, 0.0), healthy)).verdict == C
    assert judged("C16", c16(("sim", 0.41, 0.03, 0.0), healthy)).verdict == F  # the A2A-bound step gains less
    assert judged("C16", c16(("sim", 0.41, 0.21, 0.2), healthy)).verdict == F  # inside the noise
    assert judged("C16", c16(("sim", 0.30, 0.21, 0.0), healthy)).verdict == U  # none above 35%
    assert V.c16_check([(0.41, 0.21, 0.0), (0.21, 0.04, 0.0)]) is True
    assert V.c16_check([(0.41, 0.21, 0.0), (0.30, 0.0, 0.0)]) is None


def test_c1_judges_the_seed_system_over_megatron_and_names_the_refusal():
    # Megatron-LM 3.807 s, MegaScale-MoE 2.945 s (x1.29), the seed's system 2.0 s: 3.807 / 2.0 = x1.90
    c = judged("C1", c1(3.807 / 2.0, published=3.807 / 2.945))
    assert c.verdict == C  # within 10% of 1.88
    assert "x1.29 (published: 1.88x" in c.why and "x1.90 over Megatron-LM" in c.why
    assert "paging: refused (pager.enabled = True: not with pipelines)" in c.why
    assert "without paging" in c.conditions
    # the MegaScale layout alone at x1.88 decides nothing: the seed's system is what the claim is about
    assert judged("C1", c1(1.2, published=1.88)).verdict == F
    assert judged("C1", c1(1.88, published=1.0, refused=False)).verdict == C
    assert "without" not in judged("C1", c1(1.88, refused=False)).conditions


def test_c13_closed_form_is_the_claims_arithmetic_on_each_models_shape():
    # B 32,768, top-2, H 4,096, fp16: 2 x 0.5 GiB = 1,073,741,824 B a layer, 32 layers: 34.4 GB a step
    assert V.c13_closed_form(32768, 2, 4096, 2) == 2**30
    assert V.c13_closed_form(1000, 2, 100, 2) == 800_000
    assert V.c13_closed_form(1000, 2, 100, 1) == 400_000  # an fp8 payload
    assert V.c13_check(700_000, 800_000) and V.c13_check(920_000, 800_000)  # within 15%
    assert not V.c13_check(679_000, 800_000) and not V.c13_check(921_000, 800_000)
    c = judged("C13", c13(0.94e9, 30.1e9, 0.875, 1.72))
    assert c.verdict == C and "model-0" in c.conditions and "model-1" not in c.conditions.split("Agrees on:")[1]
    assert "2 x 1000 x 2 x 100 x 2 B = 0.0008 GB (x0.875, EP 8)" in c.why
    assert "the claim's shape" in c.conditions  # 0.94 GB and 30.1 GB: within 15% of 1 GB and 32 GB
    assert judged("C13", c13(0.5e9, 16e9, 0.875)).verdict == C  # the closed form holds where the literal does not


def test_c16_counts_the_published_pairs_on_their_bands():
    healthy = ("sim", 0.21, 0.04, 0.0)
    entries = c16(healthy)
    entries["qwen3-235b (configs/published), simulated: payload model dtype vs fp8"] = {
        "a2a_share_of_step": 0.39, "band": V.c16_band(0.39), "step_time_s": 1.0, "step_time_fp8_payload_s": 0.907,
        "step_gain_with_fp8_payload": 0.093, "gain_noise": 0.0, "published": True}
    c = judged("C16", entries)
    assert c.verdict == C  # 9.3% against 4%: more than 1 pp apart
    assert "qwen3-235b: 39% (A2A-bound (> 35%)), fp8 payload step +9.3%" in c.why
    entries["qwen3-235b (configs/published), simulated: payload model dtype vs fp8"]["step_gain_with_fp8_payload"] = 0.045
    assert judged("C16", entries).verdict == F  # 4.5% against 4%: less than 1 pp apart


# ---- C2's page budget -----------------------------------------------------------------------
def test_page_budget_is_the_device_memory_left_in_whole_pages():
    breakdown = {"expert_pages": 22e9, "parameters": 5e9, "gradients": 1e9, "optimizer_state": 3e9,
                 "activations": 2e9, "comm_buffers": 1e9, "communicators": 2e9}
    # 40 GB - 14 GB - 5% of 40 GB = 24 GB, in 16 MiB pages: 1430 whole pages
    assert page_budget_from(40e9, breakdown, 0.05, 16 * MiB) == 1430 * 16 * MiB
    assert page_budget_from(80e9, breakdown, 0.05, 16 * MiB) == int((76e9 - 14e9) // (16 * MiB)) * 16 * MiB
    assert page_budget_from(14e9, breakdown, 0.05, 16 * MiB) is None  # nothing left for a page


def test_report_formats_the_new_figures():
    from testbed.report.claims import format_value

    assert format_value("gain_noise", 0.012) == "1.20%"
    assert format_value("step_gain_with_fp8_payload", 0.213) == "21.30%"
    assert format_value("overhead_noise", 0.004) == "0.40%"
    assert format_value("derived_page_budget_bytes", 22672 * MiB) == "22.14 GiB (2.38e+10 B)"


def test_c3_says_where_the_library_runs_a_reduce_scatter_as_an_all_reduce():
    entries = c3(0.43, 1.3)
    entries["scenario 1"]["reduce_scatter_as_all_reduce"] = True
    why = judged("C3", entries).why
    assert "On scenario 1 the library runs a reduce-scatter as an all-reduce (gloo)" in why
    assert "runs a reduce-scatter as an all-reduce" not in judged("C3", c3(0.43, 0.9)).why
