"""The layouts of a model on a cluster that a scenario accepts (issue 27, item 1: the space
``testbed plan`` searches): every combination of the layout knobs, each checked as a run
would be checked, the refused ones counted by the field that refuses them.

A knob is a scenario key (``parallelism.tp_size``) with its candidate values; a layout is
one value per knob, applied to a base scenario (``layout_scenario``). Nothing here restates
a rule: a layout is valid when the scenario loads with it (``Scenario``'s own checks),
Megatron-Core forms its process groups (``testbed.layout.process_groups``), the simulator
models every feature it uses (``testbed.run.features.check_features``) and the simulator's
check before a run passes it, so the space is what ``testbed run --backend sim`` runs of
what Megatron-Core accepts, and a refusal's reason is the one-line error a user would get.

``default_knobs`` gives the candidates a search starts from for a model and cluster:
tensor parallelism inside a node, pipeline stages of whole nodes, expert parallelism over
the divisors of the experts, expert TP 1 or TP, folded or nested groups, and the micro-batch,
dispatcher and GEMM dtype. ``--fix KEY=VALUE`` pins a knob to one value.

``plan_knobs`` is the space ``testbed plan`` searches (issue 27), by ``space``: ``default``
the layout proper (TP, PP, EP; folded groups with expert TP 1, or nested ones with expert
TP = TP, the two the published Megatron-Core runs use) at micro-batch 1, the all-to-all
dispatcher, the model's dtype or fp8 GEMMs (where the profile has an fp8 ceiling), no
recompute, no paging, no context parallelism or virtual pipeline; ``wide`` every expert TP
with either grouping, CP 1 or 2, virtual chunks, micro-batch 2, every dispatcher, selective
and full recompute, paging on (room for
every local expert). A knob's candidate
may be a **bundle** (a {key: value} of several fields that only go together: recompute's
mode and modules, paging and its budget); a layout then holds each of its keys.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from testbed.core.errors import ScenarioError
from testbed.layout.process_groups import build_process_groups
from testbed.run.backend import get_backend
from testbed.run.features import check_features
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import DERIVED_BY_BATCH, Scenario


@dataclass
class LayoutSpace:
    """The valid layouts (one {key: value} each, in the knobs' product order) and the
    refused ones' count by the field their error names."""

    valid: list[dict[str, Any]] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)

    @property
    def size(self) -> int:
        """Every combination considered."""
        return len(self.valid) + sum(self.refused.values())


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def default_knobs(base: Scenario) -> dict[str, list]:
    """The candidate values of each layout knob for ``base``'s model and cluster (module doc)."""
    c, m = base.cluster, base.model
    nodes = c.microclusters * c.nodes_per_microcluster
    return {
        "parallelism.tp_size": _powers_of_two(c.gpus_per_node),
        "parallelism.pp_size": _divisors(nodes),
        "parallelism.ep_size": _divisors(m.num_experts, base.world_size),
        "parallelism.etp_size": [1, 2, 4, 8],
        "parallelism.moe_layout": ["folded", "nested"],
        "workload.micro_batch_size": [1, 2],
        "comm.token_strategy": ["alltoall", "allgather", "deepep"],
        "model.gemm_dtype": ["model", "fp8"],
    }


def layout_scenario(base: Scenario, point: dict[str, Any]) -> Scenario:
    """``base`` with the layout ``point`` ({key: value}); what ``base``'s global batch derived
    for its own layout (the tokens per GPU and micro-batches a step, ``DERIVED_BY_BATCH``) is
    left for the new layout to derive. A ScenarioError names the first field it cannot run."""
    data = base.to_dict()
    if base.workload.global_batch > 0:
        for section, key in DERIVED_BY_BATCH:
            data.get(section, {}).pop(key, None)
    return _apply(data, point)


def _apply(data: dict, point: dict[str, Any]) -> Scenario:
    for key, value in point.items():
        section, _, name = key.partition(".")
        data.setdefault(section, {})[name] = value
    return Scenario.from_dict(data)


def simulator_check(scenario: Scenario) -> None:
    """A layout Megatron-Core forms (``testbed.layout.process_groups``: the testbed runs
    others too, and notes them) and that ``testbed run --backend sim`` runs: the features the
    simulator models and its own check before a run (a ScenarioError naming the field)."""
    p = scenario.parallelism
    if p.pp_chunks > 1 and p.pp_size == 1:  # Megatron-LM's arguments.py: interleaving needs pipeline stages
        raise ScenarioError("parallelism.pp_chunks", p.pp_chunks, "Megatron-Core's interleaved schedule needs "
                            "parallelism.pp_size > 1")
    build_process_groups(scenario.world_size, p.tp_size, p.cp_size, p.pp_size, p.ep_size, p.etp_size, p.moe_layout)
    check_features(scenario, "sim")
    get_backend("sim").check(scenario)


def plan_knobs(base: Scenario, space: str = "default") -> dict[str, list]:
    """The candidates ``testbed plan`` searches for ``base``'s model and cluster (module doc)."""
    if space not in SPACES:
        raise ScenarioError("--space", space, "expected one of " + ", ".join(SPACES))
    c, m = base.cluster, base.model
    nodes = c.microclusters * c.nodes_per_microcluster
    pp = _divisors(nodes)
    knobs = {
        "parallelism.tp_size": _powers_of_two(c.gpus_per_node),
        "parallelism.cp_size": [1],
        "parallelism.pp_size": pp,
        "parallelism.pp_chunks": [1],
        "parallelism.ep_size": _divisors(m.num_experts, base.world_size),
        # MoE parallel folding's expert TP 1, or Megatron-Core's groups before it, expert TP = TP
        # (folded with expert TP = TP forms the same groups as nested)
        "expert_layout": [{"parallelism.moe_layout": "folded", "parallelism.etp_size": 1}]
        + [{"parallelism.moe_layout": "nested", "parallelism.etp_size": t} for t in _powers_of_two(c.gpus_per_node)],
        "workload.micro_batch_size": [1],
        "comm.token_strategy": ["alltoall"],
        # fp8 GEMMs where the profile has an fp8 ceiling (--no-fp8 pins bf16)
        "model.gemm_dtype": ["model", "fp8"] if load_profile(c.profile).compute.peak("fp8") > 0 else ["model"],
        "recompute": [NO_RECOMPUTE],
        "paging": [NO_PAGING],
    }
    if space == "wide":
        layers = m.num_layers
        del knobs["expert_layout"]
        knobs.update({
            "parallelism.etp_size": _powers_of_two(c.gpus_per_node),
            "parallelism.moe_layout": ["folded", "nested"],
            "parallelism.cp_size": [1, 2],
            # virtual chunks that split some pipeline's layers evenly (at most 8 a rank)
            "parallelism.pp_chunks": sorted({v for p in pp if p > 1 for v in _divisors(layers // p, 8)
                                             if layers % p == 0} | {1}),
            "workload.micro_batch_size": [1, 2],
            "comm.token_strategy": ["alltoall", "allgather", "deepep"],
            "model.gemm_dtype": ["model", "fp8"],
            "recompute": [NO_RECOMPUTE, {"transformer.recompute": "none", "transformer.recompute_modules":
                                         "moe_act,layernorm"},
                          {"transformer.recompute": "full", "transformer.recompute_modules": ""}],
            "paging": [NO_PAGING, {"pager.enabled": True, "pager.gpu_budget_bytes": 0}],
        })
    return knobs


SPACES = ("default", "wide")
NO_RECOMPUTE = {"transformer.recompute": "none", "transformer.recompute_modules": ""}
NO_PAGING = {"pager.enabled": False}


def _pin(knobs: dict[str, list], fixed: dict[str, Any]) -> dict[str, list]:
    """``knobs`` with each ``fixed`` key pinned: a knob's to its one value, a key inside a knob's
    bundles to the bundles that give it that value."""
    out = dict(knobs)
    for key, value in fixed.items():
        if key in knobs:
            out[key] = [value]
            continue
        owner = next((k for k, vs in knobs.items() if any(isinstance(v, dict) and key in v for v in vs)), None)
        if owner is None:
            raise ScenarioError("--fix", key, f"not a knob of the search (one of {', '.join(knob_keys(knobs))})")
        kept = [v for v in out[owner] if isinstance(v, dict) and v.get(key) == value]
        if not kept:
            choices = sorted({str(v.get(key)) for v in knobs[owner] if isinstance(v, dict) and key in v})
            raise ScenarioError("--fix", f"{key}={value}", f"not a candidate of the search (one of {', '.join(choices)})")
        out[owner] = kept
    return out


def knob_keys(knobs: dict[str, list]) -> list[str]:
    """The scenario keys the knobs set: each plain knob's, and every key of a knob's bundles."""
    out: list[str] = []
    for k, values in knobs.items():
        keys = [key for v in values if isinstance(v, dict) for key in v] or [k]
        out += [key for key in keys if key not in out]
    return out


def _point(keys: list[str], combo) -> dict[str, Any]:
    point: dict[str, Any] = {}
    for key, value in zip(keys, combo):
        if isinstance(value, dict):
            point.update(value)
        else:
            point[key] = value
    return point


def enumerate_layouts(base: Scenario, knobs: dict[str, list], fixed: dict[str, Any] | None = None,
                      check: Callable[[Scenario], None] = simulator_check,
                      derive: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> LayoutSpace:
    """Every combination of ``knobs`` (with ``fixed`` keys pinned to one value) on ``base``,
    each valid when the scenario loads with it and ``check`` passes it (module doc). A bundle
    candidate adds each of its keys to the layout; ``derive(layout)`` gives keys that follow
    from the others (the cluster's leaves from the pipeline stages), added to it."""
    keys = list(knobs)
    values = [list(v) for v in _pin(knobs, fixed or {}).values()]
    space = LayoutSpace()
    for combo in itertools.product(*values):
        point = _point(keys, combo)
        try:
            if derive is not None:
                point.update(derive(point))
            check(layout_scenario(base, point))
        except ScenarioError as e:
            space.refused[e.field] += 1
            continue
        space.valid.append(point)
    return space
