"""What the simulator does not model of the models people train, refused with the field
named (``testbed.core.errors.ScenarioError``) before a run starts, never run as if the
field were absent (``testbed.run.features`` says which features it models at all).

- fp8 GEMMs on a machine without an fp8 ceiling (``compute.peak_tflops.fp8`` 0: the
  A100, the CPU profiles);
- under tensor parallelism (``parallelism.tp_size`` > 1), the features whose collectives
  ``testbed.policy.tensor_parallel_ops`` does not plan: shared experts (split, they
  would need the group's tokens; whole, their gradients would be summed over all ranks,
  not over a shard's peers as the planner's tensor-parallel buckets do), the dense-first
  layers and the MTP modules (their attention's and FFN's collectives), and MLA (its
  down projections are not split over the ranks in Megatron-Core, unlike the heads).
"""

from __future__ import annotations

from testbed.core.errors import ScenarioError
from testbed.scenario.profile import MachineProfile
from testbed.scenario.scenario import Scenario


def check_model_support(scenario: Scenario, profile: MachineProfile) -> None:
    """Raise ``ScenarioError`` for the first model feature the simulator cannot model in
    this scenario on this machine (module doc)."""
    s, m, t = scenario, scenario.model, scenario.transformer
    if m.gemm_dtype == "fp8" and profile.compute.peak("fp8") <= 0:
        raise ScenarioError("model.gemm_dtype", m.gemm_dtype, f"the profile {profile.name} has no fp8 matmul "
                            "ceiling (compute.peak_tflops.fp8 is 0)")
    tp = s.parallelism.tp_size
    if tp <= 1:
        return
    why = f"with parallelism.tp_size = {tp}: the simulator does not plan its tensor-parallel collectives"
    if m.shared_experts:
        raise ScenarioError("model.shared_experts", m.shared_experts, why)
    if t.enabled:
        for name in ("first_dense_layers", "mtp_layers"):
            if getattr(t, name):
                raise ScenarioError(f"transformer.{name}", getattr(t, name), why)
        if t.attention == "mla":
            raise ScenarioError("transformer.attention", t.attention, f"with parallelism.tp_size = {tp}: MLA's "
                                "down projections are not split over tensor-parallel ranks; the simulator models "
                                "MLA at tp_size 1")
