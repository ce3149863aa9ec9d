"""The non-MoE work of a whole transformer (``transformer.enabled``, issue 13): what each
MoE layer's block adds before its route, and the embedding and output head.

A block is the MoE layer's own attention and the ``moe_every - 1`` dense layers before
it (attention and a dense FFN each). Per rank, on its ``workload.tokens_per_rank``
tokens (sequences of ``transformer.seq_len``):

- GEMMs (Q, K, V, O; the dense FFN's two matrices; the output head) at the efficiency
  the profile's dense GEMM curve gives that many rows (``compute.efficiency.dense``);
- flash attention's core, 2 x 2 x s x H FLOPs per token halved by the causal mask, at
  the profile's ``compute.efficiency.attention`` for a sequence of s;
- the backward twice the forward, and with ``transformer.recompute = full`` the forward
  once more;
- activations kept for the backward per layer as ``testbed.policy.whole_model`` gives them
  (Korthikanti et al.; flash attention keeps no scores), scaled from 16-bit to the
  model's dtype; with full recompute only each layer's input.

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

from sim.hardware.compute import ComputeModel
from testbed.policy.whole_model import activation_bytes_per_layer, attention_core_flops, shape_of
from testbed.scenario.scenario import Scenario


class DenseLayers:
    """Seconds and bytes of the dense work of one rank, per MoE layer's block."""

    def __init__(self, scenario: Scenario, compute: ComputeModel):
        s, t, m = scenario, scenario.transformer, scenario.model
        self.enabled = t.enabled
        if not self.enabled:
            return
        self.shape = shape_of(s)
        tokens, h = s.workload.tokens_per_rank, m.hidden_size
        attention_gemms = compute.gemm_time(2.0 * tokens * self.shape.attention_params, tokens, kernel="dense")
        core = compute.gemm_time(attention_core_flops(tokens, t.seq_len, h), t.seq_len, kernel="attention")
        ffn = compute.gemm_time(2.0 * tokens * self.shape.dense_ffn_params, tokens, kernel="dense")
        #: forward seconds of one block: moe_every attentions, moe_every - 1 dense FFNs
        self.block_forward_s = t.moe_every * (attention_gemms + core) + (t.moe_every - 1) * ffn
        recompute = t.recompute == "full"
        #: backward seconds of one block (with full recompute, its forward again)
        self.block_backward_s = 2.0 * self.block_forward_s + (self.block_forward_s if recompute else 0.0)
        p = s.parallelism
        # Korthikanti's eq. 4 / 5 on the tensor-parallel group's sequences (each GPU's own tokens x tp)
        per_layer = activation_bytes_per_layer(t.seq_len, p.tp_size * tokens // t.seq_len, h, t.num_heads,
                                               tp=p.tp_size, sequence_parallel=p.sequence_parallel,
                                               recompute=recompute, flash=True) * m.dtype_bytes / 2.0
        #: activation bytes one block keeps from its forward to its backward
        self.block_activation_bytes = t.moe_every * per_layer
        #: the output head's forward (the embedding is a lookup) and backward seconds
        self.head_forward_s = compute.gemm_time(2.0 * tokens * h * t.vocab_size, tokens, kernel="dense")
        self.head_backward_s = 2.0 * self.head_forward_s
        #: logits kept for the loss's backward
        self.head_activation_bytes = tokens * t.vocab_size * m.dtype_bytes
        #: parameters a rank holds besides its experts and routers: 1/tp of attention, dense FFNs and embeddings
        self.dense_params = self.shape.dense_params // p.tp_size
        #: the routers' weights and biases (whole on every rank, fp32)
        self.router_params = self.shape.moe_layers * (h * self.shape.experts + self.shape.experts)
        self.param_bytes = self.dense_params * m.dtype_bytes  # the routers' are the phase builder's router_grad_bytes
