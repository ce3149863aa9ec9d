"""``testbed plan``'s search (issue 27): the layouts of a model on a cluster, pruned by the
closed-form memory bound, simulated on the sweep engine and ranked by tokens/s per GPU, with
the published runs of the same setup placed in the ranking.

1. The base scenario (``plan_base``): the model (a preset name or a Hugging Face
   config.json), N GPUs in nodes of ``gpus_per_node`` (8), the machine profile, the global
   batch and sequence length, and what ``configs/published/`` assumes where Megatron-Core's
   users state nothing (docs/published.md section 1, "The scenarios assume instead"): the whole
   transformer, ZeRO-1 (the distributed optimizer) with its sync overlapped with the backward,
   sequence parallelism, balanced routing (no skew, drift or locality), no paging and no heat
   map; one measured step and no warm-up (``run.steps = 1``: without paging or a heat map no
   step depends on the ones before it, and the groups are made before the first, so the first
   step is the steady one: within 0.11% of the second on six published configs, and
   ``tests/testbed/study/test_plan.py`` checks it), two with one warm-up where a layout pages
   (``steps_of``: its group cache and pages settle in the first).
   ``--set`` changes any of it.
2. The cluster's leaves follow each layout's pipeline (``cluster_of``): the largest leaf
   switch of at most 32 nodes (assumed: a DGX SuperPOD scalable unit) whose nodes the stages
   take whole or in whole leaves, as the published scenarios choose theirs; with TP the TP
   collectives overlap the GEMMs (``overlap_of``).
3. The space (``testbed.study.layout_space.plan_knobs``, ``--space``, ``--knob``, ``--fix``):
   every combination the scenario, Megatron-Core's process groups and the simulator accept,
   the refused counted by the field that refuses them.
4. Pruning (``testbed.model.memory_estimate``): a layout whose closed-form lower bound of the
   fullest GPU's memory exceeds the device's (the profile's ``compute.device_memory_GB``,
   10^9 bytes) or ``--max-memory`` cannot fit and is not simulated; counted by the part that
   overflows.
5. The rest run as one sweep (``testbed.study.sweep``: in parallel, ``--executor dask``,
   resumable through its index in the run store), the published scenarios as another, each
   on the simulator's fast evaluation (``sim.representative_slice``: one representative block
   of GPUs and one routed layer where the layout and routing allow, within 0.2% of the full
   simulation's step on the published configs; ``--set sim.representative_slice=false`` runs
   every layout in full).
6. Ranking: by the simulated tokens/s per GPU, of the layouts whose simulated peak fits
   (``fits_in_device_memory``, and ``--max-memory``); the others are counted.

Every number of the result names the run it comes from (``run_dir``).
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.core.errors import ScenarioError
from testbed.layout.process_groups import build_process_groups, groups_table
from testbed.model.memory_estimate import MemoryEstimate, memory_lower_bound
from testbed.policy.pipeline_stages import pipeline_ranks, pipelined
from testbed.scenario.file import apply_override, load_scenario
from testbed.scenario.presets import preset_names
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import DERIVED_BY_BATCH, Scenario
from testbed.study.experiments import ROOT
from testbed.study.layout_space import enumerate_layouts, knob_keys, layout_scenario, plan_knobs
from testbed.study.published_runs import ROWS
from testbed.study.sweep import EXECUTORS, Sweep, point_label, run_sweep

PUBLISHED = ROOT / "configs" / "published"
#: the largest leaf switch, in nodes (assumed: a DGX SuperPOD scalable unit's 32 nodes, as configs/published)
MAX_LEAF_NODES = 32
#: one measured step (module doc, point 1); a layout that pages, one warm-up and one measured
STEPS = {"run.steps": 1, "run.warmup_steps": 0}
PAGED_STEPS = {"run.steps": 2, "run.warmup_steps": 1}
TOP = 10
#: a published layout is "placed" when in the top 5 or within 5% of the best prediction (issue 27, item 3),
#: among the layouts that share what the published run held fixed: its GEMM precision
PLACED_RANK, PLACED_GAP = 5, 0.05
HELD_KEYS = ("model.gemm_dtype",)
#: what the plan assumes where a user states nothing (module doc, point 1)
ASSUMED = {
    "transformer": {"enabled": True, "zero_stage": 1},
    "parallelism": {"sequence_parallel": True},
    "comm": {"token_strategy": "alltoall", "expert_sync": "allreduce"},
    "overlap": {"sync_with_backward": True},
    "workload": {"micro_batch_size": 1, "skew": 0.0, "drift": 0.0, "locality": 0.0},
    "pager": {"enabled": False},
    "heat": {"enabled": False},
    "run": {"steps": STEPS["run.steps"], "warmup_steps": STEPS["run.warmup_steps"]},
    # the fast evaluation (sim.step.representative_slice): the full simulation where its conditions fail
    "sim": {"representative_slice": True},
}


# ---- the base scenario ---------------------------------------------------------------------
def leaf_nodes(nodes: int, pp: int = 1) -> int:
    """The largest leaf of at most ``MAX_LEAF_NODES`` nodes dividing ``nodes`` whose nodes the
    ``pp`` stages take whole leaves of, or whole nodes of one (1 when none does)."""
    per = nodes // pp if pp and nodes % pp == 0 else nodes
    for d in range(min(nodes, MAX_LEAF_NODES), 0, -1):
        if nodes % d == 0 and (per % d == 0 or d % per == 0):
            return d
    return 1


def cluster_of(nodes: int, point: dict[str, Any]) -> dict[str, Any]:
    """The cluster keys of a layout (``point``): its pipeline's leaves (module doc, point 2)."""
    d = leaf_nodes(nodes, int(point.get("parallelism.pp_size", 1)))
    return {"cluster.nodes_per_microcluster": d, "cluster.microclusters": nodes // d}


def overlap_of(point: dict[str, Any]) -> dict[str, Any]:
    """The overlap keys of a layout (``point``): the TP collectives overlapped with the GEMMs
    wherever there is TP (``overlap.tp_comm``, Megatron-Core's --tp-comm-overlap, as the
    Mixtral-8x22B recipe of docs/published.md section 1 sets it: a free win, so a practitioner's
    choice, not a knob)."""
    return {"overlap.tp_comm": int(point.get("parallelism.tp_size", 1)) > 1}


def steps_of(point: dict[str, Any]) -> dict[str, Any]:
    """The steps a layout (``point``) runs: one, or with paging one warm-up and one measured."""
    return dict(PAGED_STEPS) if point.get("pager.enabled") else {}


def model_table(model: str) -> dict:
    """``[model]`` naming MODEL: a preset name or a config.json path (a ScenarioError otherwise)."""
    if model.endswith(".json"):
        if not Path(model).is_file():
            raise ScenarioError("MODEL", model, "no such config.json")
        return {"config": str(model)}
    if model not in preset_names():
        raise ScenarioError("MODEL", model, "not a preset (" + ", ".join(preset_names()) + ") or a config.json")
    return {"preset": model}


def plan_base(model: str, gpus: int, profile: str, global_batch: int | None = None, seq: int = 4096,
              gpus_per_node: int = 8, output_dir: str | Path = "runs", overrides=()) -> Scenario:
    """The plan's base scenario (module doc, point 1); ``global_batch`` None: one sequence a GPU
    (assumed). Bad input is a ScenarioError naming the option."""
    for name, value in (("--gpus", gpus), ("--seq", seq), ("--gpus-per-node", gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ScenarioError(name, value, "must be a positive whole number")
    if global_batch is not None and (not isinstance(global_batch, int) or global_batch <= 0):
        raise ScenarioError("--global-batch", global_batch, "must be a positive whole number of sequences")
    per_node = min(gpus_per_node, gpus)
    if gpus % per_node:
        raise ScenarioError("--gpus", gpus, f"must be a multiple of the {per_node} GPUs of a node (--gpus-per-node)")
    load_profile(profile)  # a ScenarioError naming cluster.profile
    nodes = gpus // per_node
    data: dict = {k: dict(v) for k, v in ASSUMED.items()}
    data["model"] = model_table(model)
    data["cluster"] = {"gpus_per_node": per_node, "profile": profile,
                       **{k.split(".")[1]: v for k, v in cluster_of(nodes, {}).items()}}
    data["transformer"]["seq_len"] = seq
    data["workload"]["global_batch"] = global_batch or gpus
    data["run"]["output_dir"] = str(output_dir)
    for item in overrides:
        apply_override(data, item)
    return _loadable_base(data, per_node, nodes)


def _loadable_base(data: dict, per_node: int, nodes: int) -> Scenario:
    """The base scenario of ``data``: every layout the plan makes sets its own TP and PP, so the
    base's are only a layout its global batch derives for (TP 1 and PP 1 first, then more TP,
    then more stages: 720 sequences on 480 GPUs need DP to divide 720). The first error when
    none does (or when the error is not the batch's)."""
    p = data.setdefault("parallelism", {})
    if "tp_size" in p or "pp_size" in p:  # the user's own (--set): theirs to fix
        return Scenario.from_dict(data)
    first = None
    for pp in [d for d in range(1, nodes + 1) if nodes % d == 0]:
        for tp in [2**i for i in range(per_node.bit_length()) if 2**i <= per_node]:
            try:
                return Scenario.from_dict({**data, "parallelism": {**p, "tp_size": tp, "pp_size": pp}})
            except ScenarioError as e:
                if not e.field.startswith("workload.") and first is None:
                    raise
                first = first or e
    raise first


# ---- the plan ------------------------------------------------------------------------------
@dataclass
class PlanOptions:
    """How to search (module doc): ``knobs`` replace candidates of the space's, ``fixed`` pins
    keys, ``max_memory_bytes`` caps the fullest GPU below the device."""

    space: str = "default"
    knobs: dict[str, list] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    max_memory_bytes: float | None = None
    jobs: int | None = None
    executor: str = "local"
    address: str | None = None
    fresh: bool = False
    progress: bool = True
    published: bool = True


def plan_name(base: Scenario, label: str) -> str:
    """The sweep's name: model, GPUs, profile, batch and sequence (a file name)."""
    w, t = base.workload, base.transformer
    text = f"plan-{label}-{base.world_size}-{base.cluster.profile}-gbs{w.global_batch}-seq{t.seq_len}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _flat(s: Scenario) -> dict[str, Any]:
    return {f"{sec}.{k}": v for sec, table in s.to_dict().items() if isinstance(table, dict)
            for k, v in table.items()}


def _diff(base: Scenario, s: Scenario) -> dict[str, Any]:
    """The fields in which ``s`` differs from ``base`` (what a sweep point sets)."""
    b = _flat(base)
    return {k: v for k, v in _flat(s).items() if b.get(k) != v}


def same_as_folded(point: dict[str, Any], valid: list[dict[str, Any]], world: int) -> bool:
    """A nested layout whose Megatron-Core process groups are its folded twin's (expert TP = TP,
    no CP: the same groups), the twin among ``valid``: one layout, searched once."""
    if point.get("parallelism.moe_layout") != "nested":
        return False
    twin = {**point, "parallelism.moe_layout": "folded"}
    if twin not in valid:
        return False
    sizes = [point.get(f"parallelism.{k}", 1) for k in ("tp_size", "cp_size", "pp_size", "ep_size", "etp_size")]

    def table(layout):
        t = groups_table(build_process_groups(world, *sizes, layout))
        t.pop("moe_layout")
        return t
    return table("nested") == table("folded")


def layout_label(point: dict[str, Any], shown: list[str]) -> str:
    """``tp_size=2 pp_size=8 paging=False`` of the ``shown`` keys (a key's last part, its section's
    name for a section's switch; an empty value as none)."""
    names = {k: (k.split(".")[0] if k.endswith(".enabled") else k.rsplit(".", 1)[-1]) for k in shown}
    return point_label({names[k]: (point[k] if point[k] != "" else "none") for k in shown if k in point})


def varying_keys(points: list[dict[str, Any]]) -> list[str]:
    """The keys whose values differ between ``points`` (what tells layouts apart)."""
    keys = list(dict.fromkeys(k for p in points for k in p))
    return [k for k in keys if len({repr(p.get(k)) for p in points}) > 1]


def estimate(s: Scenario) -> MemoryEstimate:
    """The memory bound of a layout's scenario on its pipeline ranks."""
    return memory_lower_bound(s, pipeline_ranks(s) if pipelined(s) else None)


def _dominant(stages: dict[str, float] | None) -> str | None:
    return max(stages, key=stages.get) if stages else None


def _entry(point: dict, s: Scenario, summary: dict, est: MemoryEstimate | None, shown: list[str]) -> dict:
    pipe = summary.get("pipeline") or {}
    return {"layout": point, "label": layout_label(point, shown), "tokens_per_s_per_gpu": summary.get("tokens_per_s_per_gpu"),
            "mfu": summary.get("mfu"), "megatron_tflops_per_gpu": summary.get("megatron_tflops_per_gpu"),
            "step_time_s": summary.get("step_time_s"), "peak_memory_bytes": summary.get("peak_memory_bytes"),
            "bound_bytes": est.total if est else None, "fits": bool(summary.get("fits_in_device_memory")),
            "bubble_fraction": pipe.get("bubble_fraction", 0.0), "exposed_s": summary.get("exposed_s"),
            "dominant_stage": _dominant(summary.get("stage_time_s")), "stage_time_s": summary.get("stage_time_s"),
            "micro_batches": s.transformer.micro_batches, "run_dir": summary.get("run_dir")}


def run_plan(base: Scenario, label: str, opts: PlanOptions | None = None) -> dict:
    """The plan of ``base``'s model and cluster (module doc): a JSON-ready result."""
    opts = opts or PlanOptions()
    if opts.executor not in EXECUTORS:  # before the enumeration, not after it
        raise ScenarioError("--executor", opts.executor, "expected one of " + ", ".join(EXECUTORS))
    start = time.perf_counter()
    output_dir = Path(base.run.output_dir).resolve()
    base = base.replace(run={"output_dir": str(output_dir)})
    knobs = plan_knobs(base, opts.space)
    for key, values in opts.knobs.items():
        if key not in knobs:
            raise ScenarioError("--knob", key, f"not a knob of the search (one of {', '.join(knobs)})")
        knobs[key] = list(values)
    device = load_profile(base.cluster.profile).compute.device_memory_GB * 1e9
    limit = min(device, opts.max_memory_bytes) if opts.max_memory_bytes else device
    nodes = base.cluster.microclusters * base.cluster.nodes_per_microcluster
    space = enumerate_layouts(base, knobs, opts.fixed, derive=lambda p: {**cluster_of(nodes, p), **overlap_of(p), **steps_of(p)})
    valid = [p for p in space.valid if not same_as_folded(p, space.valid, base.world_size)]
    shown = varying_keys(valid)
    pruned: dict[str, int] = {}
    kept: list[tuple[dict, Scenario, MemoryEstimate]] = []
    for point in valid:
        s = layout_scenario(base, point)
        est = estimate(s)
        why = est.overflow(limit)
        if why:
            pruned[why] = pruned.get(why, 0) + 1
        else:
            kept.append((point, s, est))
    name = plan_name(base, label)
    result: dict[str, Any] = {
        "name": name, "model": label, "gpus": base.world_size, "profile": base.cluster.profile,
        "global_batch": base.workload.global_batch, "seq_len": base.transformer.seq_len, "space": opts.space,
        "knobs": {k: v for k, v in knobs.items()}, "fixed": opts.fixed, "device_memory_bytes": device,
        "max_memory_bytes": opts.max_memory_bytes, "enumerated": space.size, "refused": dict(space.refused),
        "valid": len(valid), "same_as_folded": len(space.valid) - len(valid), "pruned": pruned,
        "simulated": len(kept), "output_dir": str(output_dir), "shown_keys": shown}
    if not kept:
        raise ScenarioError("MODEL", label, f"no layout of the {space.size} considered fits: {len(valid)} valid, "
                            f"pruned by the memory bound {pruned}, refused {dict(space.refused)}")
    sweep = Sweep(name, base, points=[_diff(base, s) for _, s, _ in kept], repeats=1)
    res = run_sweep(sweep, jobs=opts.jobs, executor=opts.executor, address=opts.address, fresh=opts.fresh,
                    progress=opts.progress)
    entries = [_entry(point, s, res.summaries[(i, "sim", 0)], est, shown) for i, (point, s, est) in enumerate(kept)]
    over_device = [e for e in entries if not e["fits"]]
    over_cap = [e for e in entries if e["fits"] and opts.max_memory_bytes
                and e["peak_memory_bytes"] > opts.max_memory_bytes]
    ranked = sorted((e for e in entries if e["fits"] and e not in over_cap),
                    key=lambda e: -(e["tokens_per_s_per_gpu"] or 0.0))
    for r, e in enumerate(ranked, 1):
        e["rank"] = r
    result.update({
        "ran_now": res.ran, "not_fitting": {"device memory": len(over_device), "--max-memory": len(over_cap)},
        # the bound's own check: a layout simulated below its closed-form lower bound (none expected)
        "bound_above_peak": sum(1 for e in entries if e["bound_bytes"] > (e["peak_memory_bytes"] or 0)),
        "ranked": len(ranked), "ranking": ranked, "top": ranked[:TOP], "not_ranked": over_device + over_cap,
        "knob_keys": knob_keys(knobs)})
    if opts.published and ranked:
        result["published"] = place_published(base, name, ranked, knob_keys(knobs), opts, shown)
        result["published_order"] = published_order(result["published"])
    result["wall_s"] = time.perf_counter() - start
    return result


# ---- the published runs ----------------------------------------------------------------------
def matching_published(base: Scenario, directory: Path = PUBLISHED) -> list[tuple[str, Scenario]]:
    """The published scenarios of ``base``'s model preset, GPU count, profile, global batch and
    sequence length, each with the plan's steps (``STEPS``: none of them pages)."""
    if not base.model.preset:
        return []
    out = []
    sets = [f"{k}={v}" for k, v in STEPS.items()] + [f"run.output_dir={base.run.output_dir}",
                                                      f"sim.representative_slice={str(base.sim.representative_slice).lower()}"]
    for path in sorted(directory.glob("*.toml")):
        try:
            s = load_scenario(path, sets)
        except ScenarioError:
            continue  # a file that does not load is configs/published/README.md's to list
        same = (s.model.preset == base.model.preset and s.world_size == base.world_size
                and s.cluster.profile == base.cluster.profile and s.workload.global_batch == base.workload.global_batch
                and s.transformer.seq_len == base.transformer.seq_len)
        if same:
            out.append((path.name, s))
    return out


def _published_figure(config: str) -> list[dict]:
    return [{"id": r.id, "unit": r.unit, "value": r.value} for r in ROWS if r.config == config]


def place_published(base: Scenario, name: str, ranked: list[dict], keys: list[str], opts: PlanOptions,
                    shown: list[str]) -> list[dict]:
    """Each matching published run simulated as its file states it, and its place among the
    plan's ranked layouts: its rank (1 + the layouts faster), its gap to the best, whether it
    is in the top 5 or within 5%, whether its layout is in the plan's space (and there its
    rank), the fields outside the layout in which it differs from the plan's base, and where
    it misses, why (the stage it spends most more time in than the best)."""
    runs = matching_published(base)
    if not runs:
        return []
    sweep = Sweep.of_scenarios(f"{name}-published", [s for _, s in runs], repeats=1)
    res = run_sweep(sweep, jobs=opts.jobs, executor=opts.executor, address=opts.address, fresh=opts.fresh,
                    progress=opts.progress)
    out = []
    for i, (config, s) in enumerate(runs):
        summary = res.summaries[(i, "sim", 0)]
        e = _entry({k: v for k, v in _flat(s).items() if k in keys}, s, summary, None, shown)
        tps = e["tokens_per_s_per_gpu"] or 0.0
        e["config"] = config
        e["published"] = _published_figure(config)
        # placed among the layouts of its own precision (a numerics choice the run held fixed, not a
        # layout's); its place among all of them besides
        held = {k: e["layout"][k] for k in HELD_KEYS if k in e["layout"]}
        pool = [r for r in ranked if all(r["layout"].get(k) == v for k, v in held.items())] or ranked
        best = pool[0]
        e["held"] = held
        e["rank"] = 1 + sum(1 for r in pool if (r["tokens_per_s_per_gpu"] or 0.0) > tps)
        e["of"] = len(pool)
        e["gap_to_best"] = (best["tokens_per_s_per_gpu"] - tps) / best["tokens_per_s_per_gpu"]
        e["rank_of_all"] = 1 + sum(1 for r in ranked if (r["tokens_per_s_per_gpu"] or 0.0) > tps)
        e["gap_to_best_of_all"] = (ranked[0]["tokens_per_s_per_gpu"] - tps) / ranked[0]["tokens_per_s_per_gpu"]
        e["placed"] = e["rank"] <= PLACED_RANK or e["gap_to_best"] <= PLACED_GAP
        layout, twin = e["layout"], {**e["layout"], "parallelism.moe_layout": "folded"}
        same = [r for r in ranked if all(r["layout"].get(k) == v for k, v in layout.items())]
        if not same and same_as_folded(layout, [twin], base.world_size):  # searched as its folded twin
            same = [r for r in ranked if all(r["layout"].get(k) == v for k, v in twin.items())]
        e["layout_in_space"] = bool(same)
        e["plan_rank_of_layout"] = same[0]["rank"] if same else None
        flat = _flat(s)
        try:
            plan_flat = _flat(layout_scenario(base, e["layout"]))
        except ScenarioError as err:  # its knobs alone do not make a layout of the plan's base (an uneven pipeline)
            plan_flat, e["outside_space_because"] = _flat(base), str(err)
        skip = set(keys) | {f"{a}.{b}" for a, b in DERIVED_BY_BATCH} | {"run.output_dir", "notes"}
        e["differs_from_base"] = {k: [v, plan_flat.get(k)] for k, v in flat.items()
                                  if k not in skip and not k.startswith("cluster.") and plan_flat.get(k) != v}
        e["why"] = None if e["placed"] else why_slower(e, best)
        out.append(e)
    return out


def why_slower(e: dict, best: dict) -> str:
    """Why the plan's best beats ``e``: by how much, the stage it spends most more time in, the
    bubbles, the layout's differences."""
    a, b = e.get("stage_time_s") or {}, best.get("stage_time_s") or {}
    stage = max(a, key=lambda k: a[k] - b.get(k, 0.0)) if a else None
    knobs = [f"{k.rsplit('.', 1)[-1]} {e['layout'].get(k)} -> {v}" for k, v in best["layout"].items()
             if k in e["layout"] and e["layout"].get(k) != v]
    text = f"the plan's best ({best['label']}) is {100 * e['gap_to_best']:.1f}% faster"
    if stage:
        text += (f"; the published layout spends {a[stage] - b.get(stage, 0.0):.3f} s more a step in {stage} "
                 f"({a[stage]:.3f} s against {b.get(stage, 0.0):.3f} s)")
    text += (f"; bubble {100 * (e['bubble_fraction'] or 0):.1f}% against {100 * (best['bubble_fraction'] or 0):.1f}%"
             f" ({e.get('micro_batches')} micro-batches against {best.get('micro_batches')})")
    if knobs:
        text += "; layout: " + ", ".join(knobs)
    return text


def published_order(placed: list[dict]) -> list[dict]:
    """Per published unit (MFU, TFLOP/s), whether the plan's simulated throughput orders the
    published runs as their published figures do (issue 27, item 3)."""
    out = []
    units = {f["unit"] for p in placed for f in p["published"]}
    for unit in sorted(units):
        rows = [(f["value"], p["tokens_per_s_per_gpu"], p["config"], f["id"]) for p in placed
                for f in p["published"] if f["unit"] == unit]
        if len(rows) < 2:
            continue
        by_published = [r[2] for r in sorted(rows)]
        by_plan = [r[2] for r in sorted(rows, key=lambda r: r[1])]
        out.append({"unit": unit, "published_order": by_published, "plan_order": by_plan,
                    "agrees": by_published == by_plan, "rows": [r[3] for r in sorted(rows)]})
    return out


def knob_effects(result: dict) -> dict[str, dict[str, dict[str, float]]]:
    """Per knob key and value: the best and median tokens/s per GPU of the ranked layouts with it."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key in result.get("knob_keys", []):
        groups: dict[str, list[float]] = {}
        for e in result["ranking"]:
            if key in e["layout"]:
                groups.setdefault(str(e["layout"][key]), []).append(e["tokens_per_s_per_gpu"] or 0.0)
        if len(groups) > 1:
            out[key] = {v: {"best": max(x), "median": statistics.median(x), "layouts": len(x)}
                        for v, x in groups.items()}
    return out
