"""The claims C1-C16 of the seed documents (docs/claims.md) as hypotheses, and the rules
that turn the testbed's numbers into a verdict on each.

Verdicts: ``holds`` (the numbers agree with the claim within its stated tolerance),
``does not hold``, ``holds only under stated conditions`` (only on some scenarios, for a
part of the claim, or under one reading of it) and ``not testable yet`` (the testbed does
not model what the claim is about, or no run can tell). The rules are pure functions of
numbers; ``experiments/claims.py`` gathers the numbers from runs, and a ``Claim`` keeps
them with the runs they come from.

Measured numbers carry noise. Where a claim gives a precise figure and the runs have a
run-to-run spread (``against_noise``), a difference the spread can hide is not read as
agreement: the outcome is ``within noise`` unless the measured effect stands out of the
noise and lies within the tolerance of the claimed figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from testbed.study.run_figures import run_id

MiB = 2**20

HOLDS, FAILS, CONDITIONAL, UNTESTABLE = ("holds", "does not hold", "holds only under stated conditions",
                                         "not testable yet")
VERDICTS = (HOLDS, FAILS, CONDITIONAL, UNTESTABLE)

#: what each claim says (docs/claims.md), as a hypothesis
CLAIMS = {
    "C1": "The seed's design trains 1.88x faster than the Megatron-LM baseline at 1,440 GPUs, 352B (000 §1)",
    "C2": "Peak GPU memory per GPU 28.3 GB -> 17.5 GB (-38.2%) with paging (000 §3)",
    "C3": "Two-stage comm moves 42.7% of the baseline's bytes (000 §4)",
    "C4": "NVLink utilisation 35% -> 89%, InfiniBand 92% -> 61% (000 §4)",
    "C5": "Expert group cache hit rate 99.2%; discovery < 0.8 ms (000 §4)",
    "C6": "Active groups are small (2-4 ranks per expert) (000 §4)",
    "C7": "37% of experts get zero tokens for 100 consecutive steps despite a low aux loss (000 §2)",
    "C8": "16 MB is the best page size (8 MB too much overhead, 32 MB too slow) (000 §3)",
    "C9": "The first 3 pages cover 87% of weight accesses in 92% of forwards (000 §3)",
    "C10": "Heat update every step costs +12%; every 10 steps 0.3% (000 §5)",
    "C11": "Topology-ignorant EP placement: 3.2x comm latency, 0.9x Megatron speed (000 §6)",
    "C12": "Node-internal PCIe instead of NVLink: stage-1 ReduceScatter 47% slower (000 §4)",
    "C13": "A2A ~ 1 GB per MoE layer, 32 GB per step for H=4096, top-2, B=32768, FP16, 32 layers (003 §2.2)",
    "C14": "Capacity factor 1.1-1.25 gives no drops once aux loss is tuned (003 §3.2)",
    "C15": "Hybrid replication-in-node / EP-across-nodes: comm -63%, memory -38% vs pure replication (002 §2.2)",
    "C16": "Healthy A2A share of step time < 25%; > 35% means A2A is the bottleneck (002 §5.3)",
}

#: how close a testbed number must be to the claimed one to count as agreeing
TOLERANCE = {
    "C1": "step-time ratio (Megatron-LM's layout / the MegaScale-MoE layout with the seed's mechanisms, "
          "MegaScale-352B on 1,440 H800) within 10% of 1.88",
    "C2": "peak-memory reduction within 5 percentage points of 38.2%",
    "C3": "two-stage / all-reduce expert-sync bytes within 0.05 of 0.427",
    "C4": "each of the four utilisations within 10 percentage points of the claimed value",
    "C5": "hit rate at least 99.2% - 0.5 pp",
    "C6": "median active-group size within 2-4 ranks, on scenarios with more than 4 replicas",
    "C7": "fraction of expert instances with zero tokens for 100 consecutive steps within 10 pp of 37%",
    "C8": "16 MiB has the shortest step, and 8 MiB and 32 MiB are each more than 0.5% slower",
    "C9": "in at least 92% - 5 pp of an expert's forwards its first 3 pages take at least 87% - 5 pp of the weight "
          "bytes it reads, on experts of more than 3 pages",
    "C10": "step-time overhead within 4 pp of 12% (every step) and within 0.5 pp of 0.3% (every 10 steps), and "
           "standing out of the runs' noise (the two points' run-to-run spreads added; the simulator has none); "
           "an overhead inside the noise agrees with no precise figure (within noise)",
    "C11": "token-stage time ratio (ignorant / topology placement) within 25% of 3.2",
    "C12": "expert-sync slowdown within 15 pp of 47%",
    "C13": "on the claim's shape, bytes within 15% of 1e9 per layer and of 32e9 per step; on each published "
           "scenario, bytes per MoE layer within 15% of the closed form 2 x B x top-k x H x bytes per element",
    "C14": "dropped slots at most 0.1% of routed slots",
    "C15": "reductions within 10 pp of 63% (comm) and 38% (memory)",
    "C16": "halving the all-to-all payload (comm.payload_dtype = fp8) shortens the step of every scenario with an "
           "all-to-all share above 35% by more than it shortens that of any scenario below 25%, by more than the "
           "runs' noise and at least 1 pp of step time",
}
NO_DROP = 1e-3  # C14: at most this fraction of routed slots dropped counts as "no drops"
C8_SLOWER = 0.005  # C8: a page size is "worse" when its step is more than this much longer
C16_HEALTHY, C16_BOUND = 0.25, 0.35  # C16: the rule of thumb's two thresholds (shares of the step)
C16_BANDS = ((C16_HEALTHY, "healthy (< 25%)"), (C16_BOUND, "between 25% and 35%"), (math.inf, "A2A-bound (> 35%)"))
#: C16: the least difference of step-time gains (fraction of the step) that counts as "clearly more"
C16_MARGIN = 0.01
C9_FIRST, C9_COVER, C9_FORWARDS, C9_TOL = 3, 0.87, 0.92, 0.05  # C9: 3 pages, 87% of accesses, 92% of forwards

#: outcomes of one part of a claim against a measured number with noise (``against_noise``)
AGREES, DIFFERS, WITHIN_NOISE = "agrees", "differs", "within noise"


# ---- verdict rules (pure functions of numbers) -------------------------------------------------
def close(value: float | None, target: float, *, abs_tol: float | None = None, rel_tol: float | None = None) -> bool:
    """Whether ``value`` agrees with ``target``: within ``abs_tol``, or within ``rel_tol`` x target."""
    if value is None or not math.isfinite(value):
        return False
    tol = abs_tol if abs_tol is not None else rel_tol * abs(target)
    return abs(value - target) <= tol


def held_to_conditional(c: "Claim") -> None:
    """Claims tested only in part or under a reading: agreement is never a plain holds."""
    if c.verdict == HOLDS:
        c.verdict = CONDITIONAL


def from_checks(checks: dict[str, bool]) -> tuple[str, list[str]]:
    """(verdict, labels of the checks that agree) over checks of one claim on several
    scenarios or parts: all agree -> holds, some -> holds only under stated conditions
    (those), none -> does not hold, no check at all -> not testable yet."""
    if not checks:
        return UNTESTABLE, []
    ok = [k for k, v in checks.items() if v]
    if len(ok) == len(checks):
        return HOLDS, ok
    return (CONDITIONAL if ok else FAILS), ok


def against_noise(value: float | None, claimed: float, abs_tol: float, noise: float | None) -> str:
    """One measured figure against a precise claimed one, given the runs' noise (how far
    apart the repeats lie, in the figure's units, taken as the half-width of what they
    cannot tell apart; 0 for the deterministic simulator; None: unknown, e.g. a single
    measured run):

    - ``agrees``: within ``abs_tol`` of the claim and out of the noise (|value| > noise:
      an effect the runs can tell from none);
    - ``within noise``: the runs cannot decide - the noise is unknown, or the value is
      inside it and so is the claimed figure (the runs are as consistent with the claim
      as with no effect), or the value is off by more than the tolerance but by less
      than the noise;
    - ``differs``: otherwise, including a value inside the noise while the claimed figure
      lies outside it (the runs tell the two apart)."""
    if value is None or not math.isfinite(value) or noise is None:
        return WITHIN_NOISE
    off = abs(value - claimed)
    if off <= abs_tol:
        if abs(value) > noise:
            return AGREES
        return WITHIN_NOISE if off <= noise else DIFFERS
    return WITHIN_NOISE if off <= noise else DIFFERS


def from_outcomes(outcomes: dict[str, str]) -> tuple[str, dict[str, list[str]]]:
    """(verdict, labels by outcome) over parts judged by ``against_noise``: every part
    agrees -> holds; some agree -> holds only under stated conditions; none agrees and
    some differ -> does not hold; every part within noise (or none) -> not testable yet
    (the runs cannot tell)."""
    by = {o: [k for k, v in outcomes.items() if v == o] for o in (AGREES, WITHIN_NOISE, DIFFERS)}
    if not outcomes or len(by[WITHIN_NOISE]) == len(outcomes):
        return UNTESTABLE, by
    if len(by[AGREES]) == len(outcomes):
        return HOLDS, by
    return (CONDITIONAL if by[AGREES] else FAILS), by


def c1_check(speedup: float) -> bool:
    """Whether a step-time ratio (baseline over the seed's system) agrees with 1.88x."""
    return close(speedup, 1.88, rel_tol=0.10)


def c2_verdict(peak_paged: float, peak_unpaged: float) -> tuple[str, float]:
    """(verdict, reduction) for peak memory with and without paging. Agreeing numbers
    still only hold under the testbed's conditions (tensor and pipeline parallelism left at 1)."""
    reduction = 1 - peak_paged / peak_unpaged
    return (CONDITIONAL if close(reduction, 0.382, abs_tol=0.05) else FAILS), reduction


def c3_check(two_stage_bytes: float, allreduce_bytes: float) -> tuple[bool, float]:
    """(agrees, ratio) of two-stage to all-reduce expert-sync bytes against 42.7%."""
    ratio = two_stage_bytes / allreduce_bytes
    return close(ratio, 0.427, abs_tol=0.05), ratio


def c4_checks(before: dict[str, float], after: dict[str, float]) -> dict[str, bool]:
    """Utilisation (fractions) of ``nvlink`` and ``infiniband`` under all-reduce (before)
    and two-stage (after) sync against 35% -> 89% and 92% -> 61%."""
    return {"NVLink under all-reduce ~35%": close(before["nvlink"], 0.35, abs_tol=0.10),
            "NVLink under two-stage ~89%": close(after["nvlink"], 0.89, abs_tol=0.10),
            "InfiniBand under all-reduce ~92%": close(before["infiniband"], 0.92, abs_tol=0.10),
            "InfiniBand under two-stage ~61%": close(after["infiniband"], 0.61, abs_tol=0.10)}


def c5_check(hit_rate: float | None) -> bool:
    return hit_rate is not None and hit_rate >= 0.992 - 0.005


def c6_check(replicas: int, median_size: float) -> bool | None:
    """Median active-group size within 2-4; None where the scenario cannot tell (at most 4
    replicas: no group can be larger than 4)."""
    if replicas <= 4:
        return None
    return 2 <= median_size <= 4


def c7_verdict(measured: dict[str, float]) -> tuple[str, list[str]]:
    """(verdict, agreeing scenarios) from the fraction of expert instances without a token
    for 100 steps on each scenario with a learnt router. Only those can test C7: the
    simulator's synthetic workload sets expert popularity by its Zipf exponent, so its
    zero-token experts are an input (no scenario: not testable yet)."""
    return from_checks({k: close(v, 0.37, abs_tol=0.10) for k, v in measured.items()})


def best_page_size(step_by_size: dict[int, float]) -> int:
    return min(step_by_size, key=lambda k: (step_by_size[k], k))


def c8_check(step_by_size: dict[int, float]) -> bool | None:
    """16 MiB best, 8 MiB and 32 MiB each more than C8_SLOWER slower; None without all three."""
    need = (8 * MiB, 16 * MiB, 32 * MiB)
    if not all(k in step_by_size for k in need):
        return None
    t8, t16, t32 = (step_by_size[k] for k in need)
    return (best_page_size(step_by_size) == 16 * MiB and t8 > t16 * (1 + C8_SLOWER)
            and t32 > t16 * (1 + C8_SLOWER))


def c9_forward_covered(first_pages_share: float) -> bool:
    """Whether one forward's first 3 pages take the claimed share of its weight reads."""
    return first_pages_share >= C9_COVER - C9_TOL


def c9_check(pages_per_expert: int, covered_forwards: float | None) -> bool | None:
    """Whether the share of forwards whose first 3 pages cover the claimed share
    (``c9_forward_covered``) agrees with 92%; None where the expert has at most 3 pages
    (the first 3 are all of it: nothing to test) or no forward was counted."""
    if pages_per_expert <= C9_FIRST or covered_forwards is None:
        return None
    return covered_forwards >= C9_FORWARDS - C9_TOL


def c10_checks(overhead_every_step: float, overhead_every_10: float, noise_every_step: float | None,
               noise_every_10: float | None) -> dict[str, str]:
    """Outcomes (``against_noise``) of the two step-time overheads (fractions over the run
    without updates) against +12% and +0.3%, each with its noise (fraction of the step)."""
    return {"every step +12%": against_noise(overhead_every_step, 0.12, 0.04, noise_every_step),
            "every 10 steps +0.3%": against_noise(overhead_every_10, 0.003, 0.005, noise_every_10)}


def c11_check(token_time_ratio: float) -> bool:
    return close(token_time_ratio, 3.2, rel_tol=0.25)


def c12_check(slowdown: float) -> bool:
    return close(slowdown, 0.47, abs_tol=0.15)


def c13_verdict(layer_bytes: float, step_forward_bytes: float) -> str:
    """Forward dispatch + combine bytes per layer and per step against ~1 GB and 32 GB;
    agreeing numbers hold only for the forward (the backward moves the same again)."""
    ok = close(layer_bytes, 1e9, rel_tol=0.15) and close(step_forward_bytes, 32e9, rel_tol=0.15)
    return CONDITIONAL if ok else FAILS


def c13_closed_form(tokens: int, top_k: int, hidden_size: int, bytes_per_element: int) -> int:
    """The claim's arithmetic (003 §2.2), bytes of one MoE layer's forward all-to-all:
    dispatch and combine each move ``tokens`` x ``top_k`` rows of ``hidden_size`` elements
    of ``bytes_per_element`` (B = 32,768, top-2, H = 4,096, fp16: 2 x 0.5 GiB, the claim's
    ~1 GB; x 32 layers its 32 GB a step)."""
    return 2 * tokens * top_k * hidden_size * bytes_per_element


def c13_check(layer_bytes: float, closed_form_bytes: float) -> bool:
    """Whether a run's forward dispatch + combine bytes per MoE layer agree with the closed
    form on its own shape (``c13_closed_form``), within 15% as the claim's figures."""
    return close(layer_bytes, closed_form_bytes, rel_tol=0.15)


def c14_checks(max_drops: dict[str, float]) -> dict[str, bool]:
    """Setting -> no drops (at most NO_DROP) at capacity factors 1.1-1.25."""
    return {k: v <= NO_DROP for k, v in max_drops.items()}


def c15_checks(comm_reduction: float, memory_reduction: float) -> dict[str, bool]:
    return {"comm -63%": close(comm_reduction, 0.63, abs_tol=0.10),
            "memory -38%": close(memory_reduction, 0.38, abs_tol=0.10)}


def noise_note(noise: float | None, backend: str) -> str:
    """How a figure's noise reads in a reason: unknown, none (the deterministic simulator), or +-x%."""
    if noise is None:
        return "noise unknown: one run"
    if noise == 0 and backend == "sim":
        return "simulated: no noise"
    return f"noise +-{100 * noise:.2f}%"


def c16_band(share: float) -> str:
    return next(name for limit, name in C16_BANDS if share < limit)


def c16_check(pairs: list[tuple[float, float, float | None]]) -> bool | None:
    """(share, gain, noise) per scenario: its all-to-all share of the step, the fraction
    of the step that shrinking the all-to-all saves, and that gain's noise (None:
    unknown). Whether every scenario above 35% gains more than any below 25% by more than
    max(C16_MARGIN, the noise of those compared); None without a scenario on each side of
    the bands or with a noise unknown."""
    bound = [(g, n) for s, g, n in pairs if s > C16_BOUND]
    healthy = [(g, n) for s, g, n in pairs if s < C16_HEALTHY]
    if not bound or not healthy or any(n is None for _, n in bound + healthy):
        return None
    margin = max([C16_MARGIN] + [n for _, n in bound + healthy])
    return min(g for g, _ in bound) - max(g for g, _ in healthy) > margin


@dataclass
class Claim:
    id: str
    verdict: str = UNTESTABLE
    conditions: str = ""
    why: str = ""
    numbers: dict[str, dict] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)

    def add(self, label: str, summaries: list[dict] | dict, **values) -> None:
        """Numbers of one scenario (``label``) and the runs they come from."""
        summaries = [summaries] if isinstance(summaries, dict) else list(summaries)
        ids = [run_id(s) for s in summaries]
        backends = sorted({s["backend"] for s in summaries})
        self.numbers[label] = {**values, "backend": "+".join(backends), "runs": ids}
        seen = {r["run"] for r in self.runs}
        for s in summaries:
            if run_id(s) not in seen:
                self.runs.append({"run": run_id(s), "backend": s["backend"], "scenario": label,
                                  "run_dir": str(s["run_dir"])})
                seen.add(run_id(s))

    def entries(self, **figures) -> list[tuple[str, dict]]:
        """(label, figures) of the scenarios whose figures include all of ``figures``
        with those values (``backend="real"``, ``pager_enabled=True``), in order."""
        return [(k, v) for k, v in self.numbers.items() if all(k2 in v and v[k2] == x for k2, x in figures.items())]

    def judge(self, checks: dict[str, bool], agreeing: str = "Agrees only for") -> list[str]:
        """Set the verdict from ``checks`` (``from_checks``); where only some agree, the
        conditions name them after ``agreeing``. Returns the labels that agree."""
        self.verdict, ok = from_checks(checks)
        if self.verdict == CONDITIONAL:
            self.conditions = f"{agreeing}: {'; '.join(ok)}."
        return ok

    def to_dict(self) -> dict:
        return {"id": self.id, "claim": CLAIMS[self.id], "verdict": self.verdict, "conditions": self.conditions,
                "why": self.why, "tolerance": TOLERANCE.get(self.id, ""), "numbers": self.numbers, "runs": self.runs}
