"""The shared experts of an MoE layer on one rank (``model.shared_experts``: DeepSeek's,
Qwen2-MoE's): every token of the rank passes through them on the rank it sits on, so
they cost the same on every rank and move no token.

Per MoE layer, on the rank's ``workload.tokens_per_rank`` tokens T (the closed forms:
``testbed.model.transformer_shape``, one MoE layer's shape ``moe_layer_shape``):

- compute: each shared expert's FFN (``model.ffn_activation``'s matrices of H x F_s,
  F_s = ``model.shared_ffn_hidden_size``) and the gate's H x 1, dense GEMMs of T rows at
  the profile's ``dense`` curve (the FFN's at fp8's ceiling with fp8 GEMMs, plus their
  casts; the gate stays at the model dtype, as the router's); the backward twice the
  forward, with full recompute the forward first. Split as Megatron-Core's shared-expert
  overlap splits it (``moe_shared_expert_overlap``, SharedExpertMLP): the first GEMM and
  the activation (``first_share`` of the FLOPs) beside the dispatch, the second beside
  the combine (the phase builder places them: ``overlap.shared_experts``);
- activations kept for the backward per token: each shared expert's first GEMM's output
  and its output ((matrices - 1) F_s + H: as an expert row, whose input is the layer's);
  none with full recompute;
- Megatron-Core's recompute modules (``transformer.recompute_modules``): ``shared_experts``
  and ``moe`` each run their forward once more in the backward (both: twice more, the
  inner checkpoint running again inside the outer's recompute), before their backward,
  in ``backward_s``'s first part (its recomputed activations live inside that part, which
  the phases' memory, taken at a phase's end, does not see); their activations are the
  figure above less Megatron-Core's saving (``testbed.model.whole_model.recompute_savings``'
  ``shared``), none where that is larger (every tensor of theirs is freed);
- weights: whole on every rank (replicated, as dense weights: their gradients are summed
  with the dense ones, ``testbed.model.whole_model.block_grad_bytes``), in the model
  dtype; with fp8 GEMMs their fp8 copies while the layer's forward and backward run.

Tensor parallelism (``parallelism.tp_size`` t > 1): Megatron-Core's SharedExpertMLP is an
MLP split as a dense FFN (column-parallel fc1, row-parallel fc2;
``megatron/core/transformer/moe/shared_experts.py`` @ d98e8a64) on the group's t T rows,
whose collectives are ``testbed.policy.tensor_parallel_ops``' (``shared_expert_parts``,
timed with the block's). Per GPU: the same FLOPs (t T rows over 1/t of the columns), 1/t
of their weights, gradients and fp8 copies and the whole gate
(``testbed.model.whole_model.shared_expert_params_per_gpu``; their gradients summed with
the dense ones over the GPUs of one tensor-parallel index); the activations above with
sequence parallelism (fc1's output 1/t as wide on t times the rows, the output
reduce-scattered to the GPU's rows), without it the output of the group's rows (t T H)
before its all-reduce.
"""

from __future__ import annotations

from sim.hardware.compute import ComputeModel
from testbed.model.fp8_casts import cached_input_bytes, linears_copy_bytes
from testbed.model.memory_bound_kernels import shared_expert_bytes
from testbed.model.whole_model import (
    dense_weight_split,
    moe_layer_shape,
    recompute_modules_of,
    recompute_savings,
    shape_of,
    shared_expert_params_per_gpu,
)
from testbed.scenario.scenario import Scenario


class SharedExperts:
    """Seconds and bytes of one MoE layer's shared experts on one rank (module doc)."""

    def __init__(self, scenario: Scenario, compute: ComputeModel):
        m, t = scenario.model, scenario.transformer
        self.enabled = m.shared_experts > 0
        #: forward seconds of the part beside the dispatch and of the part beside the combine
        self.forward_s = (0.0, 0.0)
        self.backward_s = (0.0, 0.0)  # the part beside the combine_backward, then beside the dispatch_backward
        self.activation_bytes = 0.0  # per layer
        self.params = 0  # per layer, on one GPU
        self.fp8_copy_bytes = 0.0  # per layer, while its forward and backward run
        if not self.enabled:
            return
        shape = moe_layer_shape(scenario)
        tokens, h, f = scenario.workload.tokens_per_rank, m.hidden_size, shape.ffn_matrices
        recompute = t.enabled and t.recompute == "full"
        first, second = shape.ffn_linears(shape.shared_ffn_width)
        first_linears, second_linears = [first] * m.shared_experts, [second] * m.shared_experts
        gate_s = 0.0
        if m.shared_expert_gate:  # T x H times H x 1, at the model dtype (by shape: memory-bound)
            gate_s = (compute.shaped_gemm_seconds(tokens, 1, h, tokens) if compute.shapes.enabled
                      else compute.gemm_time(2.0 * tokens * h, tokens, "dense"))
        # by shape (compute.gemm): fc1 column- and fc2 row-parallel over the tensor-parallel GPUs, as a dense FFN
        tp = dense_weight_split(scenario)
        split = {"splits": ["column"] * m.shared_experts, "tp": tp}, {"splits": ["row"] * m.shared_experts, "tp": tp}
        fwd = (compute.linears_time(tokens, first_linears, **split[0]),
               compute.linears_time(tokens, second_linears, **split[1]) + gate_s)
        bwd = (compute.linears_time(tokens, second_linears, backward=True, recompute=recompute, **split[1])
               + (3.0 if recompute else 2.0) * gate_s,
               compute.linears_time(tokens, first_linears, backward=True, recompute=recompute, **split[0]))
        # their activation, a memory-bound kernel (testbed.model.memory_bound_kernels), with the first GEMM
        act = shared_expert_bytes(shape, m.dtype_bytes)
        fwd = (fwd[0] + compute.memory_seconds(tokens * act.forward_token), fwd[1])
        act_again = act.forward_token if recompute else 0.0  # full recompute runs it again, as its GEMMs
        bwd = (bwd[0], bwd[1] + compute.memory_seconds(tokens * (act.backward_token + act_again)))
        self.forward_s, self.backward_s = fwd, bwd
        p = scenario.parallelism
        out_rows = 1 if p.sequence_parallel else p.tp_size  # without SP the group's rows, replicated (doc)
        if not recompute:
            self.activation_bytes = float(tokens * m.shared_experts
                                          * ((f - 1) * shape.shared_ffn_width + out_rows * h) * m.dtype_bytes)
        modules = recompute_modules_of(scenario)
        #: times their forward runs again in the backward (recompute modules, module doc)
        self.recomputes = ("shared_experts" in modules) + ("moe" in modules)
        if self.recomputes:
            again = self.recomputes * (fwd[0] + fwd[1])
            self.backward_s = (bwd[0] + again, bwd[1])
        fp8_input = cached_input_bytes(m.fp8_scaling) if compute.fp8 and not recompute else 0.0
        if modules or fp8_input:  # per GPU the same tensors' bytes under sequence parallelism (module doc)
            saved = recompute_savings(shape_of(scenario), True, modules, t.seq_len, m.dtype_bytes,
                                      fp8_input_bytes=fp8_input).shared
            self.activation_bytes = max(self.activation_bytes - tokens * saved, 0.0)
        self.params = shared_expert_params_per_gpu(scenario)  # 1/tp of their FFNs, the gate whole
        if compute.fp8:
            self.fp8_copy_bytes = float(linears_copy_bytes(first_linears + second_linears, m.fp8_scaling)) \
                / dense_weight_split(scenario)

    @property
    def forward_total_s(self) -> float:
        return self.forward_s[0] + self.forward_s[1]

    @property
    def backward_total_s(self) -> float:
        return self.backward_s[0] + self.backward_s[1]
