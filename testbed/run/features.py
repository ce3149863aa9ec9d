"""Which model features each backend runs, so that a scenario using one a backend does not
model is refused with the field and value named, never run as if the field were absent.

A feature is in use when its field leaves its default (``FEATURES``); ``SUPPORTED`` lists,
per backend, the features it models. The models people train (SwiGLU, shared experts,
sigmoid and group-limited routing, bias balancing, dense-first layers, MLA, sliding
windows, MTP, fp8 GEMMs, the DeepEP-style dispatcher) enter ``SUPPORTED`` as each backend
models them: docs/models.md says which backend models what.
"""

from __future__ import annotations

from collections.abc import Callable

from testbed.core.errors import ScenarioError
from testbed.scenario.scenario import Scenario

#: dotted field -> whether a scenario uses the feature it names
FEATURES: dict[str, Callable[[Scenario], bool]] = {
    "model.ffn_activation": lambda s: s.model.ffn_activation != "gelu",
    "model.shared_experts": lambda s: s.model.shared_experts > 0,
    "model.gemm_dtype": lambda s: s.model.gemm_dtype != "model",
    "router.score": lambda s: s.router.score != "softmax",
    "router.normalize_top_k": lambda s: not s.router.normalize_top_k,
    "router.routed_scaling_factor": lambda s: s.router.routed_scaling_factor != 1.0,
    "router.expert_groups": lambda s: s.router.expert_groups > 0,
    "router.bias_update_rate": lambda s: s.router.bias_update_rate > 0,
    "router.seq_aux_loss_coef": lambda s: s.router.seq_aux_loss_coef > 0,
    "transformer.first_dense_layers": lambda s: s.transformer.enabled and s.transformer.first_dense_layers > 0,
    "transformer.head_dim": lambda s: s.transformer.enabled and s.transformer.head_dim > 0,
    "transformer.attention": lambda s: s.transformer.enabled and s.transformer.attention != "gqa",
    "transformer.sliding_window": lambda s: s.transformer.enabled and s.transformer.sliding_window > 0,
    "transformer.attention_sinks": lambda s: s.transformer.enabled and s.transformer.attention_sinks,
    "transformer.mtp_layers": lambda s: s.transformer.enabled and s.transformer.mtp_layers > 0,
    "comm.token_strategy": lambda s: s.comm.token_strategy == "deepep",
}

#: backend -> the features of ``FEATURES`` it models
SUPPORTED: dict[str, set[str]] = {"sim": set(), "real": set()}


def used_features(scenario: Scenario) -> list[str]:
    """The dotted fields of ``FEATURES`` the scenario uses."""
    return [name for name, used in FEATURES.items() if used(scenario)]


def check_features(scenario: Scenario, backend: str) -> None:
    """Raise ``ScenarioError`` for the first feature the scenario uses that ``backend``
    does not model (a backend not listed in ``SUPPORTED`` is not checked)."""
    if backend not in SUPPORTED:
        return
    for name in used_features(scenario):
        if name not in SUPPORTED[backend]:
            section, key = name.split(".")
            value = getattr(getattr(scenario, section), key)
            raise ScenarioError(name, value, f"the {backend} backend does not model this yet (docs/models.md)")
