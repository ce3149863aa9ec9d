"""Figures read off finished runs (their summaries, steps and routing traces): the share
of a step in the token stages, link utilisation, active groups (M9), experts that get no
tokens, ... Each takes a run summary (``summary.json`` with its ``run_dir``) or, for the
stage figures, any mapping with ``stage_time_s`` and ``step_time_s`` (a sweep point's mean
figures). Times are seconds, bytes are bytes, shares are fractions.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from testbed.core.stages import TOKEN_STAGES
from testbed.run.routing_trace import RoutingTrace
from testbed.run.store import load_run, read_steps
from testbed.scenario.links import capacity_by_level
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import LEVELS, Layout


def run_id(summary: dict) -> str:
    return Path(summary["run_dir"]).name


def token_share(summary: dict) -> float | None:
    """Fraction of the step in dispatch, combine and their backward (medians per stage)."""
    st, step = summary.get("stage_time_s"), summary.get("step_time_s")
    if not st or not step:
        return None
    return sum(st.get(s, 0.0) for s in TOKEN_STAGES) / step


def token_time(summary: dict) -> float | None:
    """Seconds of a step in dispatch, combine and their backward (None without stage times)."""
    st = summary.get("stage_time_s")
    return sum(st.get(s, 0.0) for s in TOKEN_STAGES) if st else None


def spread(values: list[float]) -> float | None:
    """(max - min) / mean of two or more values; None for fewer."""
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.mean(values)


def mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.mean(vals) if vals else None


def network_bytes(summary: dict) -> float:
    """Payload bytes per step over NVLink, leaf and spine (no PCIe)."""
    return sum(summary["bytes_by_level"].get(lv, 0.0) for lv in LEVELS[:3])


def scenario_of(summary: dict) -> Scenario:
    return Scenario.from_dict(load_run(summary["run_dir"])[0])


def utilisation(summaries: list[dict]) -> dict[str, float] | None:
    """Link utilisation of NVLink and InfiniBand (leaf and spine together, weighted by
    capacity): the simulator's own figure (bytes carried / capacity x elapsed), or for an
    emulated real run its counters' wire bytes per step / (capacity x step time)."""
    s = summaries[0]
    scenario = scenario_of(s)
    cap = capacity_by_level(scenario.cluster, load_profile(scenario.cluster.profile))
    ib_cap = cap["leaf"] + cap["spine"]
    if s["backend"] == "sim":
        u = s.get("utilization_by_level") or {}
        if not u:
            return None
        ib = (u.get("leaf", 0) * cap["leaf"] + u.get("spine", 0) * cap["spine"]) / ib_cap if ib_cap else 0.0
        return {"nvlink": u.get("nvlink", 0.0), "infiniband": ib}
    if not all(r.get("wire_bytes_by_level") for r in summaries):
        return None
    step = mean(r["step_time_s"] for r in summaries)
    wire = {lv: mean(r["wire_bytes_by_level"].get(lv, 0) for r in summaries) for lv in LEVELS[:3]}
    return {"nvlink": wire["nvlink"] / (cap["nvlink"] * step) if cap["nvlink"] else 0.0,
            "infiniband": (wire["leaf"] + wire["spine"]) / (ib_cap * step) if ib_cap else 0.0}


def mean_step_figures(summary: dict) -> dict[str, float]:
    """Mean (not median) step time and heat-stage time over the measured steps
    (steps.jsonl): an update every 10 steps shows in a mean, not in a median."""
    warm = scenario_of(summary).run.warmup_steps
    records = [r for r in read_steps(summary["run_dir"]) if r.step >= warm]
    return {"mean_step_s": statistics.mean(r.step_time_s for r in records),
            "mean_heat_s": statistics.mean(r.stage_time_s.get("heat", 0.0) for r in records),
            "aux_loss_mean": mean(r.aux_loss for r in records)}


def active_groups(summary: dict) -> dict[str, float]:
    """Active groups A_e of a run's routing trace (routing.npz), after warm-up: for every
    (step, layer, expert) that some EP group routed a slot to, the number of its replicas
    whose EP group routed at least one slot to it (M9's group), and the number of ranks
    that routed at least one slot to it. Routed counts, before capacity."""
    scenario = scenario_of(summary)
    lay = Layout(scenario)
    routed = RoutingTrace.load(summary["run_dir"]).routed[scenario.run.warmup_steps:]  # [S, L, W, E]
    per_group = routed[:, :, lay.rank_of, :].sum(axis=3)  # [S, L, R, E]: slots EP group g routed to e
    sizes = (per_group > 0).sum(axis=2).reshape(-1)  # replicas in A_e per (step, layer, expert)
    senders = (routed > 0).sum(axis=2).reshape(-1)  # ranks that routed >= 1 slot
    active = sizes > 0
    sizes, senders = sizes[active], senders[active]
    return {"replicas": lay.replicas, "ep_size": lay.ep_size, "tokens_per_rank": scenario.workload.tokens_per_rank,
            "median_active_group": float(np.median(sizes)), "mean_active_group": float(sizes.mean()),
            "share_of_groups_with_2_to_4_ranks": float(((sizes >= 2) & (sizes <= 4)).mean()),
            "share_of_groups_with_every_replica": float((sizes == lay.replicas).mean()),
            "mean_ranks_routing_to_an_expert": float(senders.mean()), "world": lay.world}


def longest_zero_run(zero: np.ndarray) -> np.ndarray:
    """zero[S, N] (bool) -> the longest run of consecutive True per column."""
    best = np.zeros(zero.shape[1], dtype=np.int64)
    cur = np.zeros(zero.shape[1], dtype=np.int64)
    for row in zero:
        cur = np.where(row, cur + 1, 0)
        best = np.maximum(best, cur)
    return best


def dead_experts(summary: dict, window: int = 100) -> dict[str, float]:
    """Expert instances (layer, expert) that got no routed slot from any rank for
    ``window`` consecutive steps of a run's routing trace (every step, warm-up included)."""
    routed = RoutingTrace.load(summary["run_dir"]).routed  # [S, L, W, E]
    total = routed.sum(axis=2).reshape(routed.shape[0], -1)  # [S, L*E]
    run = longest_zero_run(total == 0)
    return {"steps": int(routed.shape[0]), "expert_instances": int(total.shape[1]),
            "fraction_zero_for_100_steps": float((run >= window).mean()),
            "fraction_zero_in_some_step": float((run >= 1).mean())}
