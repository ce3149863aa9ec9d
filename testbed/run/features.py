"""Which model features each backend runs, so that a scenario using one a backend does not
model is refused with the field and value named, never run as if the field were absent.

A feature is in use when its field leaves its default; each ``Feature`` says which
backends model it. The models people train (SwiGLU, shared experts, sigmoid and
group-limited routing, bias balancing, dense-first layers, MLA, sliding windows, MTP, fp8
GEMMs, the DeepEP-style dispatcher) are marked as each backend comes to model them:
docs/models.md says which backend models what.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from testbed.core.errors import ScenarioError
from testbed.scenario.scenario import Scenario


@dataclass(frozen=True)
class Feature:
    """One model feature: whether a scenario uses it, and which backends model it."""

    used: Callable[[Scenario], bool]
    sim: bool = False  # the simulator models it
    real: bool = False  # the real backend runs it


#: dotted field -> its feature (one line each: a backend that models it sets its flag here)
FEATURES: dict[str, Feature] = {
    "model.ffn_activation": Feature(lambda s: s.model.ffn_activation != "gelu", sim=True, real=True),
    "model.shared_experts": Feature(lambda s: s.model.shared_experts > 0, sim=True, real=True),
    "model.ffn_bias": Feature(lambda s: s.model.ffn_bias, sim=True),
    "transformer.attention_bias": Feature(lambda s: s.transformer.enabled and s.transformer.attention_bias != "none", sim=True, real=True),
    "model.gemm_dtype": Feature(lambda s: s.model.gemm_dtype != "model", sim=True),
    "router.score": Feature(lambda s: s.router.score != "softmax", sim=True, real=True),
    "router.normalize_top_k": Feature(lambda s: not s.router.normalize_top_k, sim=True, real=True),
    "router.routed_scaling_factor": Feature(lambda s: s.router.routed_scaling_factor != 1.0, sim=True, real=True),
    "router.expert_groups": Feature(lambda s: s.router.expert_groups > 0, sim=True, real=True),
    "router.bias_update_rate": Feature(lambda s: s.router.bias_update_rate > 0, sim=True, real=True),
    "router.seq_aux_loss_coef": Feature(lambda s: s.router.seq_aux_loss_coef > 0, sim=True, real=True),
    "transformer.first_dense_layers": Feature(lambda s: s.transformer.enabled and s.transformer.first_dense_layers > 0, sim=True, real=True),
    "transformer.head_dim": Feature(lambda s: s.transformer.enabled and s.transformer.head_dim > 0, sim=True, real=True),
    "transformer.attention": Feature(lambda s: s.transformer.enabled and s.transformer.attention != "gqa", sim=True, real=True),
    "transformer.sliding_window": Feature(lambda s: s.transformer.enabled and s.transformer.sliding_window > 0, sim=True),
    "transformer.attention_sinks": Feature(lambda s: s.transformer.enabled and s.transformer.attention_sinks, sim=True),
    "transformer.mtp_layers": Feature(lambda s: s.transformer.enabled and s.transformer.mtp_layers > 0, sim=True, real=True),
    "comm.token_strategy": Feature(lambda s: s.comm.token_strategy == "deepep", sim=True, real=True),
    # Megatron-Core's and DeepSeek's layouts (issue 25)
    "workload.global_batch": Feature(lambda s: s.workload.global_batch > 0, sim=True, real=True),
    "parallelism.cp_size": Feature(lambda s: s.parallelism.cp_size > 1, sim=True, real=True),
    "parallelism.etp_size": Feature(lambda s: s.parallelism.etp_size > 1, sim=True, real=True),
    "parallelism.moe_layout": Feature(lambda s: s.parallelism.moe_layout != "folded", sim=True, real=True),
    "parallelism.pipeline_layout": Feature(lambda s: s.parallelism.pipeline_layout != "", sim=True),
    "parallelism.decoder_first_pipeline_num_layers": Feature(lambda s: s.parallelism.decoder_first_pipeline_num_layers > 0, sim=True),
    "parallelism.decoder_last_pipeline_num_layers": Feature(lambda s: s.parallelism.decoder_last_pipeline_num_layers > 0, sim=True),
    "parallelism.pipeline_schedule": Feature(lambda s: s.parallelism.pipeline_schedule != "1f1b", sim=True),
    "parallelism.attention_parallel": Feature(lambda s: s.parallelism.attention_parallel != "tp", sim=True),
    "overlap.moe_expert_parallel_comm": Feature(lambda s: s.overlap.moe_expert_parallel_comm, sim=True),
    "overlap.tp_comm": Feature(lambda s: s.overlap.tp_comm, sim=True),
    "transformer.recompute_modules": Feature(lambda s: s.transformer.recompute_modules.strip() != "", sim=True, real=True),
    "transformer.overlap_grad_reduce": Feature(lambda s: s.transformer.overlap_grad_reduce, sim=True),
    "transformer.overlap_param_gather": Feature(lambda s: s.transformer.overlap_param_gather, sim=True),
    "transformer.grad_reduce_dtype": Feature(lambda s: s.transformer.grad_reduce_dtype != "model", sim=True),
    "sim.representative_slice": Feature(lambda s: s.sim.representative_slice, sim=True),
}


def used_features(scenario: Scenario) -> list[str]:
    """The dotted fields of ``FEATURES`` the scenario uses."""
    return [name for name, f in FEATURES.items() if f.used(scenario)]


def check_features(scenario: Scenario, backend: str) -> None:
    """Raise ``ScenarioError`` for the first feature the scenario uses that ``backend``
    does not model (a backend other than sim and real is not checked)."""
    if backend not in ("sim", "real"):
        return
    for name in used_features(scenario):
        if not getattr(FEATURES[name], backend):
            section, key = name.split(".")
            value = getattr(getattr(scenario, section), key)
            raise ScenarioError(name, value, f"the {backend} backend does not model this yet (docs/models.md)")
