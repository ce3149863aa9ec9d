"""Which MoE layers the controller plans when the transformer has multi-token prediction
(``transformer.mtp_layers`` D; DeepSeek-V3 §2.2, arXiv 2412.19437): the seam both
backends use.

Each MTP module is a projection 2H x H, one transformer layer and the shared output head;
its layer's FFN is an MoE layer (Megatron-LM's MTP takes the decoder's last layer's spec,
and a scenario's last layer is always MoE: its blocks end in their MoE layer). That MoE
layer is one more MoE layer for the controller: the main model's L MoE layers are its
layers 0 .. L-1 and module d's is layer L + d (``controller_scenario``), so its routing,
pages, token exchange, expert sync, router, shared experts and balancing bias are planned
as every MoE layer's, on the real ranks (``real.rank.mtp``) and in the simulator
(``sim.step.phase_builder``) alike. MoE layer L + d's block (its dense work before the
route) is module d's projection and attention sublayer.

The dense model's figures (parameters, FLOPs, MFU, the model card) stay on the model's
scenario, which counts the MTP modules once each (``testbed.model.whole_model.shape_of``).
"""

from __future__ import annotations

from testbed.model.transformer_shape import TransformerShape
from testbed.scenario.scenario import Scenario


def mtp_modules(scenario: Scenario) -> int:
    """D: MTP modules of the whole transformer (none without it)."""
    t = scenario.transformer
    return t.mtp_layers if t.enabled else 0


def controller_scenario(scenario: Scenario) -> Scenario:
    """The scenario whose ``model.num_layers`` MoE layers the controller plans: the model's
    and, after them, one per MTP module (module doc); the scenario itself without MTP."""
    d = mtp_modules(scenario)
    return scenario.replace(model={"num_layers": scenario.model.num_layers + d}) if d else scenario


def mtp_block_params(shape: TransformerShape) -> int:
    """Parameters of one MTP module's block (what MoE layer L + d holds before its route):
    its projection 2H x H and its attention sublayer. Its router, shared and routed
    experts are its MoE layer's, as every MoE layer's."""
    return 2 * shape.hidden * shape.hidden + shape.attention_params
