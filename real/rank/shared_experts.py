"""The shared experts of every MoE layer on one rank (``model.shared_experts``): FFNs every
token goes through on the rank it sits on, beside its routed top-k (DeepSeek-MoE,
arXiv 2401.06066 §3.2; DeepSeek-V3 eq. 12: h = x + sum_shared FFN_s(x) + sum_routed g FFN_e(x)).

Each of the ``model.shared_experts`` experts is an FFN of ``model.shared_ffn_hidden_size``
(``model.ffn_hidden_size`` unless given) with the model's activation: w1 [H, W] (gate and up
side by side with SwiGLU, ``real.kernels.ffn_activation``) and w2 [F_s, H], as a routed
expert's. With ``model.shared_expert_gate`` their sum is scaled by sigmoid(x w_g), w_g
[H, 1] (Qwen2-MoE's ``shared_expert_gate``, HF ``modeling_qwen2_moe.py``).

Their weights are replicated on every rank, in ``model.dtype``, seeded by (run.seed,
layer, expert): like the dense weights, their gradients are summed over all ranks in the
layer's gradient bucket (``RankState.layer_params``) and every rank applies the same step.
No tokens travel for them.

``transformer.recompute_modules`` with ``shared_experts`` (``real.rank.recompute``): their
forward, gate included, is checkpointed (Megatron-Core's SharedExpertMLP under
``shared_experts``, shared_experts.py:200-207): only their input is kept, the rest run
again in the backward.
"""

from __future__ import annotations

import torch

from real.kernels.ffn_activation import ffn_forward, input_width
from real.rank.layer import seed_of
from real.rank.recompute import Recompute
from testbed.scenario.scenario import Scenario


class SharedExperts:
    """The shared experts of MoE layers ``first .. first + layers - 1`` of the model
    (module doc); their weights per layer in ``weights[layer]`` (name -> tensor)."""

    def __init__(self, scenario: Scenario, layers: int, dtype: torch.dtype, device: torch.device, first: int = 0):
        m = scenario.model
        self.swiglu = m.ffn_activation == "swiglu"
        h, f = m.hidden_size, m.shared_ffn
        self.weights: list[dict[str, torch.Tensor]] = []
        for layer in range(first, first + layers):
            out = {}
            for j in range(m.shared_experts):
                g = torch.Generator().manual_seed(seed_of(scenario.run.seed, layer, j, 0x5E))
                out[f"{j}.w1"] = torch.randn(h, input_width(f, self.swiglu), generator=g) / h ** 0.5
                out[f"{j}.w2"] = torch.randn(f, h, generator=g) / f ** 0.5
            if m.shared_expert_gate:
                g = torch.Generator().manual_seed(seed_of(scenario.run.seed, layer, 0x6A7E))
                out["gate"] = torch.randn(h, 1, generator=g) / h ** 0.5
            self.weights.append({k: w.to(device, dtype).requires_grad_() for k, w in out.items()})
        self.count = m.shared_experts
        self.recompute = Recompute.of(scenario)

    def named_layer_params(self, layer: int) -> list[tuple[str, torch.Tensor]]:
        return [(f"shared{layer}.{k}", w) for k, w in self.weights[layer].items()]

    def forward(self, layer: int, x_TH: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [T, H] for MoE layer ``layer``'s input ``x_TH``
        (checkpointed under ``shared_experts``)."""
        return self.recompute.run("shared_experts", self._forward, x_TH, self.weights[layer])

    def _forward(self, x_TH: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        out = sum(ffn_forward(x_TH, w[f"{j}.w1"], w[f"{j}.w2"], self.swiglu) for j in range(self.count))
        return out * torch.sigmoid(x_TH @ w["gate"]) if "gate" in w else out
