"""The non-MoE work of a whole transformer (``transformer.enabled``, issue 13): what each
MoE layer's block adds before its route, and the embedding and output head.

A block is the MoE layer's own attention and the ``moe_every - 1`` dense layers before
it (attention and a dense FFN each). Per rank, on its ``workload.tokens_per_rank``
tokens (sequences of ``transformer.seq_len``):

- GEMMs (Q, K, V, O; the dense FFN's two matrices; the output head) at the efficiency
  the profile gives a GEMM of that many rows (``compute.efficiency.grouped``, one group);
- flash attention's core, 2 x 2 x s x H FLOPs per token halved by the causal mask, at
  the profile's ``compute.efficiency.attention`` for a sequence of s;
- the backward twice the forward, and with ``transformer.recompute = full`` the forward
  once more;
- activations kept for the backward per layer as ``testbed.whole_model`` gives them
  (Korthikanti et al.; flash attention keeps no scores), scaled from 16-bit to the
  model's dtype; with full recompute only each layer's input.

Tensor parallelism (``parallelism.tp_size`` t) with sequence parallelism, over t GPUs
of a node: each holds 1/t of the heads, the dense FFNs' columns and the vocabulary, and
its own tokens between blocks. So per GPU the FLOPs and the activations stay those of
its own tokens (t x the tokens over 1/t of the weights; Korthikanti et al.'s eq. 5),
the weights and their gradients shrink to 1/t, and each attention and dense FFN adds an
all-gather of the group's tokens before it and a reduce-scatter after it (forward; the
backward mirrors them: ``Planner.tp_ops``); the vocabulary-split embedding and output
head add theirs (``Planner.tp_embedding_ops``, ``tp_head_ops``: the group's token ids
gathered and the partial embeddings reduce-scattered; the last hidden states gathered
and the cross entropy's three all-reduces). The dense gradients are summed over the
GPUs with the same tensor-parallel index (``Planner.dense_sync_ops``). No pipeline
parallelism yet.
"""

from __future__ import annotations

from sim.compute import ComputeModel
from testbed.scenario import Scenario
from testbed.whole_model import activation_bytes_per_layer, shape_of


class DenseLayers:
    """Seconds and bytes of the dense work of one rank, per MoE layer's block."""

    def __init__(self, scenario: Scenario, compute: ComputeModel):
        s, t, m = scenario, scenario.transformer, scenario.model
        self.enabled = t.enabled
        if not self.enabled:
            return
        self.shape = shape_of(s)
        tokens, h = s.workload.tokens_per_rank, m.hidden_size
        attention_gemms = compute.gemm_time(2.0 * tokens * self.shape.attention_params, tokens)
        core = compute.gemm_time(2.0 * 2.0 * tokens * t.seq_len * h * 0.5, t.seq_len, kernel="attention")
        ffn = compute.gemm_time(2.0 * tokens * self.shape.dense_ffn_params, tokens)
        #: forward seconds of one block: moe_every attentions, moe_every - 1 dense FFNs
        self.block_forward_s = t.moe_every * (attention_gemms + core) + (t.moe_every - 1) * ffn
        recompute = t.recompute == "full"
        #: backward seconds of one block (with full recompute, its forward again)
        self.block_backward_s = 2.0 * self.block_forward_s + (self.block_forward_s if recompute else 0.0)
        per_layer = activation_bytes_per_layer(t.seq_len, tokens // t.seq_len, h, t.num_heads,
                                               recompute=recompute, flash=True) * m.dtype_bytes / 2.0
        #: activation bytes one block keeps from its forward to its backward
        self.block_activation_bytes = t.moe_every * per_layer
        #: the output head's forward (the embedding is a lookup) and backward seconds
        self.head_forward_s = compute.gemm_time(2.0 * tokens * h * t.vocab_size, tokens)
        self.head_backward_s = 2.0 * self.head_forward_s
        #: logits kept for the loss's backward
        self.head_activation_bytes = tokens * t.vocab_size * m.dtype_bytes
        tp = s.parallelism.tp_size
        routers = self.shape.moe_layers * h * self.shape.experts
        split = self.shape.params - self.shape.moe_layers * self.shape.experts * 2 * h * m.ffn_hidden_size - routers
        #: parameters a rank holds besides its experts and routers: 1/tp of attention, dense FFNs and embeddings
        self.dense_params = split // tp
        #: the routers' weights and biases (whole on every rank, fp32)
        self.router_params = self.shape.moe_layers * (h * self.shape.experts + self.shape.experts)
        self.param_bytes = self.dense_params * m.dtype_bytes  # the routers' are the phase builder's router_grad_bytes
