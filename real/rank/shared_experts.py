"""The shared experts of every MoE layer on one rank (``model.shared_experts``): FFNs every
token goes through beside its routed top-k (DeepSeek-MoE, arXiv 2401.06066 §3.2;
DeepSeek-V3 eq. 12: h = x + sum_shared FFN_s(x) + sum_routed g FFN_e(x)).

Each of the ``model.shared_experts`` experts is an FFN of ``model.shared_ffn_hidden_size``
(``model.ffn_hidden_size`` unless given) with the model's activation: w1 [H, W] (gate and up
side by side with SwiGLU, ``real.kernels.ffn_activation``) and w2 [F_s, H], as a routed
expert's. With ``model.shared_expert_gate`` their sum is scaled by sigmoid(x w_g), w_g
[H, 1] (Qwen2-MoE's ``shared_expert_gate``, HF ``modeling_qwen2_moe.py``).

Their weights are drawn whole, in ``model.dtype``, seeded by (run.seed, layer, expert).
Without tensor parallelism every rank holds them whole and runs them on its own tokens (no
token travels for them); their gradients are summed over all ranks with the router's, in
the layer's gradient bucket (``RankState.layer_params``).

Tensor parallelism (``parallelism.tp_size`` t > 1, ``real.rank.dense_model.TensorGroup``):
as Megatron-Core's SharedExpertMLP, an MLP split as a dense FFN
(``megatron/core/transformer/moe/shared_experts.py`` @ d98e8a64; the plan's
``testbed.policy.tensor_parallel_ops.shared_expert_parts``): each rank keeps its 1/t of every
expert's w1 columns (SwiGLU: the same 1/t of the gate's and of the up's) and of its w2 rows,
cut from the whole weight the unsplit run draws (``real.comm.tensor_parallel.shard``); with
sequence parallelism the layer's input rows are all-gathered over the group, each rank runs
its columns on the group's rows and the partial outputs are reduce-scattered back to each
rank's own rows (backward: the other way round). Those two collectives count in the stages
the plan puts them in, ``dense`` and ``dense_backward`` (the block's, ``Planner``'s tensor
parallel ops), whatever stage the MoE layer is in. The gate stays whole on every rank, on its
own rows (Megatron's ``gate_weight``; ``testbed.model.whole_model.shared_expert_params_per_gpu``).
The split weights' gradients, and the gate's, go with the dense shards' (summed over the GPUs
of one tensor-parallel index: ``Planner.dense_sync_ops``). Without sequence parallelism, and
with the gate under tensor parallelism, ``real.backend`` refuses the scenario (its
``_check_model_features`` says why).

``transformer.recompute_modules`` with ``shared_experts`` (``real.rank.recompute``): their
forward, gate included, is checkpointed (Megatron-Core's SharedExpertMLP under
``shared_experts``, shared_experts.py:200-207): only their input is kept, the rest run
again in the backward. Under tensor parallelism the collectives stay outside the
checkpoint (as the dense FFN's under ``mlp``, ``real.rank.dense_model``): the FFNs on the
gathered rows are checkpointed, and the gate's score.
"""

from __future__ import annotations

import torch

from real.comm.tensor_parallel import shard
from real.kernels.ffn_activation import ffn_forward, input_width
from real.rank.clock import StageClock
from real.rank.dense_model import TensorGroup
from real.rank.layer import seed_of
from real.rank.recompute import Recompute
from testbed.core.errors import ScenarioError
from testbed.scenario.scenario import Scenario


class SharedExperts:
    """The shared experts of MoE layers ``first .. first + layers - 1`` of the model
    (module doc); their weights per layer in ``weights[layer]`` (name -> tensor): whole, or
    with ``tp`` this rank's shard of them. ``clock``: the rank's stage clock, whose stages
    the tensor-parallel collectives' bytes are counted in."""

    def __init__(self, scenario: Scenario, layers: int, dtype: torch.dtype, device: torch.device, first: int = 0,
                 tp: TensorGroup | None = None, clock: StageClock | None = None):
        m = scenario.model
        self.swiglu = m.ffn_activation == "swiglu"
        self.tp, self.clock = tp, clock
        h, f = m.hidden_size, m.shared_ffn
        if tp is not None and f % tp.size:
            raise ScenarioError("model.shared_ffn_hidden_size", f,
                                f"is not a multiple of parallelism.tp_size = {tp.size}")
        self.weights: list[dict[str, torch.Tensor]] = []
        for layer in range(first, first + layers):
            out = {}
            for j in range(m.shared_experts):
                g = torch.Generator().manual_seed(seed_of(scenario.run.seed, layer, j, 0x5E))
                out[f"{j}.w1"] = self._columns(torch.randn(h, input_width(f, self.swiglu), generator=g) / h ** 0.5)
                out[f"{j}.w2"] = self._rows(torch.randn(f, h, generator=g) / f ** 0.5)
            if m.shared_expert_gate:
                g = torch.Generator().manual_seed(seed_of(scenario.run.seed, layer, 0x6A7E))
                out["gate"] = torch.randn(h, 1, generator=g) / h ** 0.5  # whole on every rank, split or not
            self.weights.append({k: w.to(device, dtype).requires_grad_() for k, w in out.items()})
        self.count = m.shared_experts
        self.recompute = Recompute.of(scenario)

    @property
    def split(self) -> bool:
        """Whether the FFNs are split over a tensor-parallel group (their gradients then go
        with the dense shards', not with the router's)."""
        return self.tp is not None

    def _columns(self, w1: torch.Tensor) -> torch.Tensor:
        """This rank's 1/t of w1's columns: with SwiGLU the same columns of the gate and of
        the up, side by side as ``ffn_activation`` reads them."""
        if self.tp is None:
            return w1
        halves = w1.chunk(2, dim=1) if self.swiglu else (w1,)
        return torch.cat([shard(part, 1, self.tp.index, self.tp.size) for part in halves], dim=1)

    def _rows(self, w2: torch.Tensor) -> torch.Tensor:
        return w2 if self.tp is None else shard(w2, 0, self.tp.index, self.tp.size)

    def named_layer_params(self, layer: int) -> list[tuple[str, torch.Tensor]]:
        return [(f"shared{layer}.{k}", w) for k, w in self.weights[layer].items()]

    def forward(self, layer: int, x_TH: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [T, H] for MoE layer ``layer``'s input ``x_TH`` (the
        rank's own rows), checkpointed under ``shared_experts``."""
        w = self.weights[layer]
        if self.tp is None:
            return self.recompute.run("shared_experts", self._forward, x_TH, w)
        group_TH = self._in_dense_stage(self.tp.gather, x_TH)  # the group's rows
        out_TH = self._in_dense_stage(self.tp.scatter, self.recompute.run("shared_experts", self._ffns, group_TH, w))
        if "gate" not in w:
            return out_TH
        return out_TH * self.recompute.run("shared_experts", _gate_score, x_TH, w["gate"])

    def _forward(self, x_TH: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self._ffns(x_TH, w)
        return out * _gate_score(x_TH, w["gate"]) if "gate" in w else out

    def _ffns(self, x_TH: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """The experts' summed outputs (tensor parallel: this rank's partial sums)."""
        return sum(ffn_forward(x_TH, w[f"{j}.w1"], w[f"{j}.w2"], self.swiglu) for j in range(self.count))

    def _in_dense_stage(self, collective, x: torch.Tensor) -> torch.Tensor:
        """``collective(x)`` with its bytes counted where the plan puts them: forward in
        ``dense``, its backward in ``dense_backward``; the clock is back in the stage it was
        in afterwards, both ways."""
        clock = self.clock
        if clock is None:
            return collective(x)
        before: list[str | None] = []
        x = _ResumeStage.apply(x, clock, before)
        with clock.region("dense"):
            y = collective(x)
        return _EnterStage.apply(y, clock, "dense_backward", before)


def _gate_score(x_TH: torch.Tensor, gate_H1: torch.Tensor) -> torch.Tensor:
    """sigmoid(x w_g) [T, 1]."""
    return torch.sigmoid(x_TH @ gate_H1)


class _EnterStage(torch.autograd.Function):
    """Identity; backward: the clock's stage noted in ``before``, then the clock in ``stage``."""

    @staticmethod
    def forward(ctx, x, clock: StageClock, stage: str, before: list):
        ctx.args = (clock, stage, before)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        clock, stage, before = ctx.args
        before.append(clock.current)
        clock.switch(stage)
        return grad, None, None, None


class _ResumeStage(torch.autograd.Function):
    """Identity; backward: the clock back in the stage ``_EnterStage`` noted."""

    @staticmethod
    def forward(ctx, x, clock: StageClock, before: list):
        ctx.args = (clock, before)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        clock, before = ctx.args
        if before:
            clock.switch(before.pop())
        return grad, None, None
