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
    build_process_groups(scenario.world_size, p.tp_size, p.cp_size, p.pp_size, p.ep_size, p.etp_size, p.moe_layout)
    check_features(scenario, "sim")
    get_backend("sim").check(scenario)


def enumerate_layouts(base: Scenario, knobs: dict[str, list], fixed: dict[str, Any] | None = None,
                      check: Callable[[Scenario], None] = simulator_check) -> LayoutSpace:
    """Every combination of ``knobs`` (with ``fixed`` keys pinned to one value) on ``base``,
    each valid when the scenario loads with it and ``check`` passes it (module doc)."""
    fixed = fixed or {}
    unknown = [k for k in fixed if k not in knobs]
    if unknown:
        raise ScenarioError("--fix", unknown[0], f"not a knob of the search (one of {', '.join(knobs)})")
    keys = list(knobs)
    values = [[fixed[k]] if k in fixed else list(knobs[k]) for k in keys]
    space = LayoutSpace()
    for combo in itertools.product(*values):
        point = dict(zip(keys, combo))
        try:
            check(layout_scenario(base, point))
        except ScenarioError as e:
            space.refused[e.field] += 1
            continue
        space.valid.append(point)
    return space
