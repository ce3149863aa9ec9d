"""What the simulator does not model of the models people train, refused with the field
named (``testbed.core.errors.ScenarioError``) before a run starts, never run as if the
field were absent (``testbed.run.features`` says which features it models at all).

- fp8 GEMMs on a machine without an fp8 ceiling (``compute.peak_tflops.fp8`` 0: the
  A100, the CPU profiles);
- recompute modules (``transformer.recompute_modules``) without the whole transformer
  (they recompute parts of its layers), and the combinations Megatron-Core refuses
  (``testbed.model.recompute_modules.check_recompute_modules``): beside full recompute,
  ``moe_act`` without grouped expert GEMMs (``sim.expert_kernel``), ``mla_up_proj``
  without MLA, ``shared_experts`` under the shared-expert overlap (``overlap.shared_experts``),
  ``moe_act`` or ``layernorm`` with fp8's tensor (delayed) scaling. ``moe`` is refused by
  Megatron-Core only beside its EP all-to-all overlap, which the testbed does not have;
- MLA under tensor parallelism without sequence parallelism: Megatron-Core's down
  projections then run on the group's replicated rows, and the planner plans MLA's
  collectives with sequence parallelism only (``testbed.policy.tensor_parallel_ops``).
  Shared experts, dense-first layers and MTP modules under tensor parallelism are
  modelled (their collectives ``tensor_parallel_ops``');
- Ulysses attention (``parallelism.attention_parallel = "ulysses"``) with heads or kv heads
  not divisible by the group, with MLA, beside context parallelism or without sequence
  parallelism (``testbed.policy.ulysses.check_ulysses``).
"""

from __future__ import annotations

from testbed.core.errors import ScenarioError
from testbed.model.recompute_modules import GROUPED_EXPERT_KERNELS, check_recompute_modules
from testbed.model.whole_model import shape_of
from testbed.policy.ulysses import check_ulysses
from testbed.scenario.profile import MachineProfile
from testbed.scenario.scenario import Scenario


def check_model_support(scenario: Scenario, profile: MachineProfile) -> None:
    """Raise ``ScenarioError`` for the first model feature the simulator cannot model in
    this scenario on this machine (module doc)."""
    s, m, t = scenario, scenario.model, scenario.transformer
    if m.gemm_dtype == "fp8" and profile.compute.peak("fp8") <= 0:
        raise ScenarioError("model.gemm_dtype", m.gemm_dtype, f"the profile {profile.name} has no fp8 matmul "
                            "ceiling (compute.peak_tflops.fp8 is 0)")
    check_recompute(scenario)
    check_ulysses(scenario)
    tp = s.parallelism.tp_size
    if tp <= 1:
        return
    if t.enabled and t.attention == "mla" and not s.parallelism.sequence_parallel:
        raise ScenarioError("transformer.attention", t.attention, f"with parallelism.tp_size = {tp} and "
                            "sequence_parallel = false: the simulator models MLA's tensor parallelism with sequence "
                            "parallelism (its down projections on each GPU's own rows)")

def check_recompute(scenario: Scenario) -> None:
    """Raise ``ScenarioError`` naming ``transformer.recompute_modules`` for modules the
    simulator cannot recompute here (module doc)."""
    s, t, m = scenario, scenario.transformer, scenario.model
    if not t.recompute_modules.strip():
        return
    if not t.enabled:
        raise ScenarioError("transformer.recompute_modules", t.recompute_modules, "recomputes parts of the "
                            "transformer's layers: it needs transformer.enabled")
    names = [n.strip() for n in t.recompute_modules.split(",") if n.strip()]
    try:
        check_recompute_modules(names, shape_of(s), full_recompute=t.recompute == "full",
                                shared_expert_overlap=s.overlap.shared_experts,
                                fp8_delayed_scaling=m.gemm_dtype == "fp8" and m.fp8_scaling == "tensor",
                                grouped_experts=s.sim.expert_kernel in GROUPED_EXPERT_KERNELS,
                                moe_a2a_overlap=s.overlap.moe_expert_parallel_comm)
    except ScenarioError as e:  # the field's value as the scenario spells it (a string), the reason Megatron's
        raise ScenarioError("transformer.recompute_modules", t.recompute_modules, e.reason) from None
