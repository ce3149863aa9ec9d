"""The non-MoE work of a whole transformer (``transformer.enabled``, issue 13): what each
MoE layer's block adds before its route, and the embedding and output head.

A block is the MoE layer's own attention and the ``moe_every - 1`` dense layers before
it (attention and a dense FFN each); MoE layer 0's block also holds the dense-first
layers (``transformer.first_dense_layers``, DeepSeek-V3's 3) before them. Per rank, on
its ``workload.tokens_per_rank`` tokens (sequences of ``transformer.seq_len``), with the
shape's closed forms (``testbed.policy.transformer_shape``):

- GEMMs (the attention's projections: GQA's fused Q, K, V and O, n heads of
  ``transformer.head_dim``, or MLA's down and up projections; the dense FFN's matrices,
  three with SwiGLU; the output head) at the efficiency the profile's dense GEMM curve
  gives that many rows (``compute.efficiency.dense``); with fp8 GEMMs the linear layers'
  at fp8's ceiling plus their casts (``sim.hardware.compute``), the head at the model
  dtype; biases and attention sinks cost no FLOPs (as Megatron-LM counts);
- flash attention's core over the positions a query attends (whole causal sequence, or
  a sliding window's band in the layers that have one: ``transformer.sliding_window``,
  ``full_attention_every``), 2 x 2 x keys x n d FLOPs per token (MLA: n (d_nope +
  d_rope) for the scores, n d_v for the values), at the profile's
  ``compute.efficiency.attention`` for a sequence of s;
- the backward twice the forward's GEMMs plus the backward's casts, and with
  ``transformer.recompute = full`` the forward once more;
- activations kept for the backward per layer as ``testbed.policy.whole_model``'s
  ``layer_activation_bytes`` gives them (Korthikanti et al.; flash attention keeps no
  scores; the shape's attention and dense-FFN terms), scaled from 16-bit to the model's
  dtype; with full recompute only each layer's input. With fp8 GEMMs the fp8 copies of
  the block's weights are held from its forward to its backward besides;
- the MTP modules (``transformer.mtp_layers``, DeepSeek-V3 §2.2) run with the output
  head, after the last MoE layer: each its projection 2H x H, one layer (whole-sequence
  attention; an MoE FFN when the last layer is MoE) and the shared head once more. An
  MTP module's MoE FFN is its router, its shared experts and its routed experts on
  balanced routing (each of the rank's E/P experts T k P / E rows, P = EP size: the rank
  computes T k rows), its token exchange not simulated (the planner plans
  ``model.num_layers`` MoE layers). Its activations: its layer's, its projection's input
  (2H per token), its logits; its weights: the projection, attention and dense FFN or
  shared experts 1/tp (dense), its router whole (fp32), its E/P routed experts.

Tensor parallelism (``parallelism.tp_size`` t) over t GPUs of a node: each holds 1/t
of the heads, the dense FFNs' columns and the vocabulary. Per GPU the FLOPs stay those
of its own tokens (t x the tokens over 1/t of the weights) and the weights and their
gradients shrink to 1/t. With sequence parallelism each keeps its own tokens between
sublayers, so its activations are those of its own tokens (Korthikanti et al.'s eq. 5);
without it the group's tokens are replicated inside the blocks (eq. 4 on the group's
sequences: 10 s b H whole, 24 s b H / t). The collectives are
``testbed.policy.tensor_parallel_ops``'s, chained after the block's compute (not overlapped).
The dense gradients are summed over the GPUs with the same tensor-parallel index
(``Planner.dense_sync_ops``). Pipeline parallelism is ``sim.pipeline.run``'s.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from sim.hardware.compute import ComputeModel
from sim.hardware.shared_experts import SharedExperts
from testbed.policy.fp8_casts import linears_copy_bytes
from testbed.policy.transformer_shape import attention_core_flops
from testbed.policy.whole_model import (
    expert_row_elements,
    layer_activation_bytes,
    mtp_dense_params,
    shape_of,
    zero_shards,
)
from testbed.scenario.scenario import Scenario


def grouped_sum(items: list, value) -> float:
    """Sum of ``value(item)`` over ``items``, each distinct item's value taken once and
    multiplied by its count (in order of first appearance): a block of n equal layers is
    n x one layer's figure, as the simulator has always computed it (the same float)."""
    return sum(count * value(item) for item, count in Counter(items).items())


class DenseLayers:
    """Seconds and bytes of the dense work of one rank, per MoE layer's block."""

    def __init__(self, scenario: Scenario, compute: ComputeModel, shared: SharedExperts | None = None):
        s, t, m = scenario, scenario.transformer, scenario.model
        self.enabled = t.enabled
        if not self.enabled:
            return
        self.s, self.compute = s, compute
        self.shape = shape = shape_of(s)
        p = s.parallelism
        tokens, h = s.workload.tokens_per_rank, m.hidden_size
        self.tokens, self.recompute = tokens, t.recompute == "full"
        # Korthikanti's eq. 4 / 5 on the tensor-parallel group's sequences (each GPU's own tokens x tp)
        self._act_args = {"seq_len": t.seq_len, "micro_batch": p.tp_size * tokens // t.seq_len, "tp": p.tp_size,
                          "sequence_parallel": p.sequence_parallel, "recompute": self.recompute, "flash": True}
        self._attention = {w: self._attention_parts(w) for w in (False, True)}
        ffn_linears = shape.ffn_linears(shape.dense_ffn)
        self._ffn = (compute.gemm_time(2.0 * tokens * shape.dense_ffn_matrix_params, tokens, "dense", fp8=True),
                     compute.linears_cast_seconds(tokens, ffn_linears),
                     compute.linears_cast_seconds(tokens, ffn_linears, backward=True))
        self._attention_copies = self._copies(shape.attention_linears)
        self._ffn_copies = self._copies(ffn_linears)
        #: per MoE layer: forward and backward seconds of its block, the activation bytes it
        #: keeps from its forward to its backward, and what it holds meanwhile (with fp8 copies)
        self.forward_s, self.backward_s, self.activation_bytes, self.held_bytes = [], [], [], []
        #: (forward, backward) seconds of the dense-first layers alone (in MoE layer 0's block)
        self.first_dense_s = self._block(list(range(t.first_dense_layers)))[:2] if t.first_dense_layers else (0.0, 0.0)
        for layer in range(m.num_layers):
            fwd, bwd, act, held = self._block(self.block_layers(layer))
            self.forward_s.append(fwd)
            self.backward_s.append(bwd)
            self.activation_bytes.append(act)
            self.held_bytes.append(held)
        #: the output head's forward (the embedding is a lookup) and backward seconds, the MTP modules' with it
        self.head_forward_s = compute.gemm_time(2.0 * tokens * h * t.vocab_size, tokens, kernel="dense")
        self.head_backward_s = 2.0 * self.head_forward_s
        #: logits kept for the loss's backward (and the MTP modules' activations)
        self.head_activation_bytes = tokens * t.vocab_size * m.dtype_bytes
        self.head_held_bytes = self.head_activation_bytes
        #: parameters a rank holds besides its experts and routers: 1/tp of attention, dense FFNs and embeddings
        self.dense_params = shape.dense_params // p.tp_size
        #: the routers' weights and biases (whole on every rank, fp32)
        self.router_params = shape.moe_layers * (h * shape.experts + shape.experts)
        #: the MTP modules' routed experts on this rank (model dtype) and their gradient bytes, and their
        #: routers' gradient bytes (fp32)
        self.mtp_expert_params, self.mtp_expert_grad_bytes, self.mtp_router_grad_bytes = 0, 0.0, 0
        if t.mtp_layers:
            self._add_mtp(scenario, shared)
        self.param_bytes = self.dense_params * m.dtype_bytes  # the routers' are the phase builder's router_grad_bytes
        if t.mtp_layers:
            self.param_bytes += self.mtp_expert_params * m.dtype_bytes + self.mtp_router_grad_bytes

    # ---- which layers ---------------------------------------------------------------------
    def block_layers(self, layer: int) -> list[int]:
        """Layers (of the whole model, 0-based) of MoE layer ``layer``'s block: the dense-first
        ones with layer 0, then the ``moe_every`` layers ending in the MoE one."""
        t = self.s.transformer
        first = t.first_dense_layers + layer * t.moe_every
        return (list(range(t.first_dense_layers)) if layer == 0 else []) + list(range(first, first + t.moe_every))

    # ---- pieces ---------------------------------------------------------------------------
    def _copies(self, linears) -> float:
        return float(linears_copy_bytes(linears, self.s.model.fp8_scaling)) if self.compute.fp8 else 0.0

    def _attention_parts(self, sliding: bool) -> tuple[float, float, float]:
        """(forward GEMM and core seconds, forward cast seconds, backward cast seconds) of one
        layer's attention, over the whole sequence or a sliding window."""
        shape, c, tokens, t = self.shape, self.compute, self.tokens, self.s.transformer
        gemms = c.gemm_time(2.0 * tokens * shape.attention_matrix_params, tokens, kernel="dense", fp8=True)
        if shape.attention == "mla":
            core_flops = tokens * shape.attention_core_flops_per_token(t.seq_len, sliding)
        else:
            window = shape.sliding_window if sliding else 0
            core_flops = attention_core_flops(tokens, t.seq_len, shape.heads * shape.head_dim, window=window)
        core = c.gemm_time(core_flops, t.seq_len, kernel="attention")
        linears = shape.attention_linears
        return gemms + core, c.linears_cast_seconds(tokens, linears), c.linears_cast_seconds(tokens, linears, True)

    def layer_activation(self, moe: bool) -> float:
        """Activation bytes one layer keeps (model dtype), an MoE layer's or a dense-FFN one's."""
        return layer_activation_bytes(self.shape, moe=moe, **self._act_args) * self.s.model.dtype_bytes / 2.0

    def _block(self, layers: list[int]) -> tuple[float, float, float, float]:
        """(forward s, backward s, activation bytes, held bytes) of the layers ``layers``."""
        shape = self.shape
        parts = []  # ("attention", sliding) per layer, ("ffn",) per dense-FFN layer
        for i in layers:
            parts.append(("attention", shape.is_sliding_layer(i)))
            if not shape.is_moe_layer(i):
                parts.append(("ffn",))

        def piece(k):
            return self._attention[k[1]] if k[0] == "attention" else self._ffn

        gemm = grouped_sum(parts, lambda k: piece(k)[0])
        cast_f = sum(piece(k)[1] for k in parts)
        cast_b = sum(piece(k)[2] for k in parts)
        forward = gemm + cast_f
        backward = 2.0 * gemm + cast_b + (forward if self.recompute else 0.0)
        acts = [self.layer_activation(shape.is_moe_layer(i)) for i in layers]
        act = grouped_sum(acts, lambda v: v)
        copies = sum(self._attention_copies + (0.0 if shape.is_moe_layer(i) else self._ffn_copies) for i in layers)
        return forward, backward, act, act + copies

    def _add_mtp(self, scenario: Scenario, shared: SharedExperts | None) -> None:
        """The MTP modules' seconds, bytes and parameters (module doc), with the head's."""
        s, m, t, c, shape = scenario, scenario.model, scenario.transformer, self.compute, self.shape
        tokens, h, n = self.tokens, m.hidden_size, t.mtp_layers
        moe = shape.mtp_ffn_is_moe
        projection = [(2 * h, h)]
        attention = self._attention[False]
        gemm = c.gemm_time(2.0 * tokens * 2 * h * h, tokens, "dense", fp8=True) + attention[0]
        cast_f = c.linears_cast_seconds(tokens, projection) + attention[1]
        cast_b = c.linears_cast_seconds(tokens, projection, True) + attention[2]
        copies = self._copies(projection) + self._attention_copies
        act = self.layer_activation(moe) + 2 * tokens * h * m.dtype_bytes  # its layer; the projection's input
        if moe:  # router, shared experts, routed experts on balanced routing
            local = m.num_experts // s.parallelism.ep_size
            rows = np.full((1, local), tokens * m.top_k * s.parallelism.ep_size / m.num_experts)
            kernel = s.sim.expert_kernel
            router = c.router_time(tokens, h, m.num_experts)
            experts_f = float(c.expert_times(rows, h, m.ffn_hidden_size, kernel, False, m.ffn_matrices)[0])
            experts_b = float(c.expert_times(rows, h, m.ffn_hidden_size, kernel, True, m.ffn_matrices)[0])
            sh_f = shared.forward_total_s if shared is not None else 0.0
            sh_b = shared.backward_total_s if shared is not None else 0.0
            ffn_forward = router + experts_f + sh_f
            # the backward's own figures (the shared experts' include their recompute)
            ffn_backward = 2.0 * router + experts_b + sh_b + ((router + experts_f) if self.recompute else 0.0)
            if not self.recompute:
                act += (tokens * h + tokens * m.top_k * expert_row_elements(h, m.ffn_hidden_size, m.ffn_matrices)) \
                    * m.dtype_bytes + (shared.activation_bytes if shared is not None else 0.0)
            expert_params = shape.expert_params
            self.mtp_expert_params = n * local * expert_params
            _, expert_shard, _, _ = zero_shards(s)
            self.mtp_expert_grad_bytes = n * local * expert_params * m.dtype_bytes / expert_shard
            self.mtp_router_grad_bytes = n * (h * m.num_experts + m.num_experts) * 4
            self.router_params += n * (h * m.num_experts + m.num_experts)
            copies += (local * float(linears_copy_bytes(shape.ffn_linears(m.ffn_hidden_size), m.fp8_scaling))
                       + (shared.fp8_copy_bytes if shared is not None else 0.0)) if c.fp8 else 0.0
        else:
            ffn_forward = self._ffn[0] + self._ffn[1]
            ffn_backward = 2.0 * self._ffn[0] + self._ffn[2] + (ffn_forward if self.recompute else 0.0)
            copies += self._ffn_copies
        head = self.head_forward_s
        forward = gemm + cast_f + ffn_forward + head
        backward = 2.0 * gemm + cast_b + ((gemm + cast_f) if self.recompute else 0.0) + ffn_backward + 2.0 * head
        self.head_forward_s += n * forward
        self.head_backward_s += n * backward
        logits = tokens * t.vocab_size * m.dtype_bytes
        self.head_activation_bytes += n * (act + logits)
        self.head_held_bytes = self.head_activation_bytes + n * copies
        self.dense_params = (shape.dense_params + n * mtp_dense_params(shape)) // s.parallelism.tp_size

    # ---- one block, for a glance: the last MoE layer's --------------------------------------
    @property
    def block_forward_s(self) -> float:
        """Forward seconds of the last MoE layer's block (every block's without dense-first
        layers and sliding windows)."""
        return self.forward_s[-1]

    @property
    def block_backward_s(self) -> float:
        return self.backward_s[-1]

    @property
    def block_activation_bytes(self) -> float:
        return self.activation_bytes[-1]
