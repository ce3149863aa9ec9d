"""The non-MoE work of a whole transformer (``transformer.enabled``, issue 13): what each
MoE layer's block adds before its route, and the embedding and output head.

A block is the MoE layer's own attention and the ``moe_every - 1`` dense layers before
it (attention and a dense FFN each); MoE layer 0's block also holds the dense-first
layers (``transformer.first_dense_layers``, DeepSeek-V3's 3) before them. Per rank, on
its ``workload.tokens_per_rank`` tokens (sequences of ``transformer.seq_len``), with the
shape's closed forms (``testbed.model.transformer_shape``):

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
  ``transformer.recompute = full`` the forward once more; with Megatron-Core's recompute
  modules (``transformer.recompute_modules``, ``testbed.model.recompute_modules``) what
  each layer's modules run again before its backward (``recompute_s``: ``core_attn``,
  ``mlp``, ``layernorm``, ``mla_up_proj``; the MoE FFN's ``moe_act``, ``moe`` and
  ``shared_experts`` are the phase builder's and the shared experts'): its GEMMs as the
  forward's linears (``ComputeModel.linears_time``, fp8's casts included), attention's
  core at the ``attention`` curve, and its memory-bound kernels' elements read and written
  in the model dtype at ``memory_GBps`` (``kernel_seconds``; the pre-MLP norm of an MoE
  layer recomputes here too, before the block's backward rather than inside the MoE
  FFN's);
- activations kept for the backward per layer as ``testbed.model.whole_model``'s
  ``layer_activation_bytes`` gives them (Korthikanti et al.; flash attention keeps no
  scores; the shape's attention and dense-FFN terms), scaled from 16-bit to the model's
  dtype; with full recompute only each layer's input; with recompute modules less what
  they free of the layer's own tensors (``layer_activation_bytes``' ``recompute_modules``;
  the recomputed ones live inside the block's backward phase, which the phases' memory,
  taken at a phase's end, does not see). With fp8 GEMMs the fp8 copies of
  the block's weights are held from its forward to its backward besides;
- the MTP modules (``transformer.mtp_layers`` D, DeepSeek-V3 §2.2) after the last MoE
  layer: each a projection 2H x H, one layer (whole-sequence attention and an MoE FFN)
  and the shared head once more. Module d's MoE FFN is MoE layer L + d of the controller
  (``testbed.model.mtp_layers``: planned, routed, exchanged, paged and synced as every
  MoE layer), so its block here is module d's projection (on the rank's T tokens; the
  norms and the embedding lookup cost nothing) and its attention sublayer: ``forward_s``
  and the other per-block lists hold L + D blocks. Its activations: its attention
  sublayer's and MoE layer's input as a layer's (``layer_activation_bytes``, the experts'
  are the phase builder's), its projection's input (2H per token); its logits are the
  head's; its weights: the projection and attention 1/tp (dense). The head runs once
  per module more, after MoE layer L + D - 1 (``head_forward_s``).

Tensor parallelism (``parallelism.tp_size`` t) over t GPUs of a node: each holds 1/t
of the heads, the dense FFNs' columns and the vocabulary. Per GPU the FLOPs stay those
of its own tokens (t x the tokens over 1/t of the weights) and the weights and their
gradients shrink to 1/t. With sequence parallelism each keeps its own tokens between
sublayers, so its activations are those of its own tokens (Korthikanti et al.'s eq. 5);
without it the group's tokens are replicated inside the blocks (eq. 4 on the group's
sequences: 10 s b H whole, 24 s b H / t). The collectives are
``testbed.policy.tensor_parallel_ops``'s, chained after the block's compute (not overlapped).
The dense gradients are summed over the GPUs with the same tensor-parallel index
(``Planner.dense_sync_ops``). The dense-first layers and the MTP modules split as every
layer (their collectives ``tensor_parallel_ops``'). MLA (with sequence parallelism, as
Megatron-Core runs it: ``megatron/core/transformer/multi_latent_attention.py`` @ d98e8a64)
splits its up and output projections by heads and runs its down projections whole on each
GPU's own rows, the same FLOPs per GPU as the rest; their weights are whole on every GPU
(``testbed.model.whole_model.mla_down_projection_params``) and their gradients summed over
the tensor-parallel group too (``Planner.replicated_grad_ops``). Pipeline parallelism is ``sim.pipeline.run``'s.

Context parallelism (``parallelism.cp_size`` CP, ``testbed.policy.context_parallel``): a GPU
holds seq_len / CP rows of each of its CP group's sequences (chunks r and 2 CP - 1 - r), so
its ``tokens_per_rank`` are its own and everything but attention's core is per token on
them, as without. Attention's core under the load-balanced causal split computes the same
pairs on every GPU, 1/CP of the sequence's: the FLOPs above on the GPU's own tokens, which
its ring runs in CP equal steps (``ring_core_s``), each a kernel on its seq_len / CP
queries (the ``attention`` curve's efficiency at seq_len / CP). The ring's sends are the
planner's (``ContextParallelOps``) and its steps the phase builder's
(``sim.step.context_parallel_ring``: each step's core beside the send of the next block).
The activations are those of the GPU's own tokens (Korthikanti's terms on CP-rank
sequences of seq_len / CP rows).

Ulysses attention (``parallelism.attention_parallel = "ulysses"``, ``testbed.policy.ulysses``)
over the tensor-parallel group's U GPUs: every weight whole on each GPU (the dense parameters
not divided by U), every GEMM on the GPU's own T rows, attention's core on the group's whole
sequences for n / U heads: U T x 1/U of the core's FLOPs, the same per GPU as above, at the
``attention`` curve's efficiency for a sequence of seq_len. The activations are those of the
GPU's own rows (Korthikanti's eq. 5 terms, as with sequence parallelism: inside the core each
GPU holds U T rows of n / U heads, the bytes of its T rows of n). The all-to-alls are the
planner's (``UlyssesOps``), chained after the block's compute as the other collectives.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from sim.hardware.compute import ComputeModel, linear_shape
from testbed.model.fp8_casts import cached_input_bytes, linears_copy_bytes
from testbed.model.memory_bound_kernels import (
    attention_sublayer_bytes,
    dense_ffn_sublayer_bytes,
    loss_bytes,
    moe_norm_residual_bytes,
)
from testbed.model.mtp_layers import mtp_block_params, mtp_modules
from testbed.model.recompute_modules import LayerRecompute, RecomputeWork
from testbed.model.transformer_shape import attention_core_flops
from testbed.model.whole_model import (
    dense_weight_split,
    is_ulysses,
    layer_activation_bytes,
    mla_down_projection_params,
    recompute_modules_of,
    shape_of,
)
from testbed.scenario.scenario import Scenario

#: the recompute modules of a layer's attention and dense FFN, recomputed before its block's
#: backward (the MoE FFN's, moe_act, moe and shared_experts, before the MoE layer's: the phase builder's)
BLOCK_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "mla_up_proj")


#: how a dense FFN's two linears split over tensor-parallel GPUs (Megatron-Core's MLP: linear_fc1
#: column-parallel, linear_fc2 row-parallel); the shared experts' the same
FFN_SPLITS = ("column", "row")


def attention_splits(shape) -> list[str]:
    """How each of ``shape.attention_linears`` splits over tensor-parallel GPUs (Megatron-Core):
    GQA's fused Q, K, V column-parallel and O row-parallel; MLA's down projections whole on each
    GPU's own rows (``mla_down_projection_params``), its up projections column-parallel, O row."""
    if shape.attention != "mla":
        return ["column", "row"]
    q = ["whole", "column"] if shape.q_lora_rank else ["column"]
    return q + ["whole", "column", "row"]


def kernel_seconds(compute: ComputeModel, elements):
    """Seconds of memory-bound kernels that read and write ``elements`` elements of the
    model dtype (each moved once) at the profile's memory bandwidth, at least one launch;
    none for no elements. A number, or an array of them (one per rank)."""
    e = np.asarray(elements, dtype=np.float64)
    seconds = np.where(e > 0, np.maximum(e * compute.dtype_bytes / compute.memory_bw, compute.launch), 0.0)
    seconds = seconds * compute.scale
    return float(seconds) if seconds.ndim == 0 else seconds


def grouped_sum(items: list, value) -> float:
    """Sum of ``value(item)`` over ``items``, each distinct item's value taken once and
    multiplied by its count (in order of first appearance): a block of n equal layers is
    n x one layer's figure, as the simulator has always computed it (the same float)."""
    return sum(count * value(item) for item, count in Counter(items).items())


class DenseLayers:
    """Seconds and bytes of the dense work of one rank, per MoE layer's block: the model's
    L, then the D MTP modules' (module doc)."""

    def __init__(self, scenario: Scenario, compute: ComputeModel):
        """``scenario``: the model's (``model.num_layers`` L main MoE layers; not the
        controller's, ``testbed.model.mtp_layers.controller_scenario``)."""
        s, t, m = scenario, scenario.transformer, scenario.model
        self.enabled = t.enabled
        if not self.enabled:
            return
        self.s, self.compute = s, compute
        self.shape = shape = shape_of(s)
        p = s.parallelism
        tokens, h = s.workload.tokens_per_rank, m.hidden_size
        self.tokens, self.recompute = tokens, t.recompute == "full"
        #: Megatron-Core's recompute modules (transformer.recompute_modules), in order
        self.modules = recompute_modules_of(s)
        #: context parallelism (parallelism.cp_size): the GPUs of a CP group hold seq_len / cp rows of each
        #: sequence, and attention's core runs as their ring's cp steps (module doc)
        self.cp, self.local_seq = p.cp_size, t.seq_len // p.cp_size
        # Korthikanti's eq. 4 / 5 on the tensor-parallel group's sequences (each GPU's own tokens x tp; under CP
        # the CP rank's shares of them, seq_len / cp rows each: flash attention keeps nothing of s x s)
        self._act_args = {"seq_len": self.local_seq, "micro_batch": p.tp_size * tokens // self.local_seq,
                          "tp": p.tp_size,
                          # Ulysses: each GPU its own rows, as sequence parallelism (module doc)
                          "sequence_parallel": p.sequence_parallel or is_ulysses(s), "recompute": self.recompute, "flash": True,
                          "recompute_modules": self.modules, "dtype_bytes": m.dtype_bytes,
                          # fp8 GEMMs: the linears' inputs kept quantized (testbed.model.fp8_casts)
                          "fp8_input_bytes": cached_input_bytes(m.fp8_scaling) if compute.fp8 else 0.0}
        #: GPUs a dense weight is split over (tensor parallelism; 1 under Ulysses) and how each of a layer's
        #: attention projections is split (Megatron-Core's column- and row-parallel linears): the shapes
        #: of their GEMMs under GEMM efficiency by shape (``ComputeModel.linears_gemm_seconds``)
        self.tp = dense_weight_split(s)
        self.attention_splits = attention_splits(shape)
        self._core = {}  # sliding -> forward seconds of one layer's attention core (_attention_parts)
        self._attention = {w: self._attention_parts(w) for w in (False, True)}
        ffn_linears = shape.ffn_linears(shape.dense_ffn)
        ffn_gemm = (compute.linears_gemm_seconds(tokens, ffn_linears, splits=FFN_SPLITS, tp=self.tp)
                    if compute.shapes.enabled else
                    compute.gemm_time(2.0 * tokens * shape.dense_ffn_matrix_params, tokens, "dense", fp8=True))
        #: (forward GEMM seconds, forward cast seconds, backward cast seconds, backward GEMM seconds) of a dense FFN
        self._ffn = (ffn_gemm, compute.linears_cast_seconds(tokens, ffn_linears),
                     compute.linears_cast_seconds(tokens, ffn_linears, backward=True),
                     compute.linears_gemm_seconds(tokens, ffn_linears, True, FFN_SPLITS, self.tp)
                     if compute.shapes.enabled else 2.0 * ffn_gemm)
        self._attention_copies = self._copies(shape.attention_linears)
        #: memory-bound kernels (testbed.model.memory_bound_kernels) on the rank's tokens, (forward,
        #: backward) seconds: of an attention sublayer, a dense-FFN sublayer, an MoE FFN's norm and residual
        self._kernels = {name: (compute.memory_seconds(tokens * k.forward_token),
                                compute.memory_seconds(tokens * k.backward_token))
                         for name, k in (("attention", attention_sublayer_bytes(shape, m.dtype_bytes)),
                                         ("ffn", dense_ffn_sublayer_bytes(shape, m.dtype_bytes)),
                                         ("moe", moe_norm_residual_bytes(shape, m.dtype_bytes)))}
        self._ffn_copies = self._copies(ffn_linears)
        #: per MoE layer (the model's L, then the D MTP modules'): forward and backward seconds of
        #: its block, the activation bytes it keeps from its forward to its backward, and what it
        #: holds meanwhile (with fp8 copies)
        self.forward_s, self.backward_s, self.activation_bytes, self.held_bytes = [], [], [], []
        #: (forward, backward) seconds of the dense-first layers alone (in MoE layer 0's block)
        self.first_dense_s = self._block(list(range(t.first_dense_layers)))[:2] if t.first_dense_layers else (0.0, 0.0)
        mtp = mtp_modules(s)
        blocks = [self._block(self.block_layers(layer)) for layer in range(m.num_layers)]
        blocks += [self._mtp_block()] * mtp
        for fwd, bwd, act, held in blocks:
            self.forward_s.append(fwd)
            self.backward_s.append(bwd)
            self.activation_bytes.append(act)
            self.held_bytes.append(held)
        #: the output head's forward (the embedding is a lookup) and backward seconds: the model's
        #: and each MTP module's, after the last MoE layer
        if compute.shapes.enabled:  # the head: column-parallel over the vocabulary, at the model dtype
            head_shape = linear_shape(tokens, h, t.vocab_size, "column", self.tp)
            head = compute.shaped_gemm_seconds(*head_shape, tokens)
            head_back = compute.shaped_gemm_seconds(*head_shape, tokens, backward=True)
        else:
            head = compute.gemm_time(2.0 * tokens * h * t.vocab_size, tokens, kernel="dense")
            head_back = 2.0 * head
        loss = loss_bytes(t.vocab_size, m.dtype_bytes)  # the cross-entropy's memory-bound kernels
        self.head_forward_s = (1 + mtp) * (head + compute.memory_seconds(tokens * loss.forward_token))
        self.head_backward_s = (1 + mtp) * (head_back + compute.memory_seconds(tokens * loss.backward_token))
        #: logits kept for the loss's backward (the model's and each MTP module's)
        self.head_activation_bytes = (1 + mtp) * tokens * t.vocab_size * m.dtype_bytes
        self.head_held_bytes = self.head_activation_bytes
        #: parameters a rank holds besides its experts, shared experts and routers: 1/tp of attention,
        #: dense FFNs, embeddings and the MTP modules' projections and attentions, MLA's down projections whole
        # MLA's down projections whole on every GPU (Megatron-Core's "duplicated" linears), one per attention
        replicated = (shape.layers + mtp) * mla_down_projection_params(shape)
        # (under Ulysses every dense weight whole: dense_weight_split 1)
        self.dense_params = (shape.dense_params + mtp * mtp_block_params(shape) - replicated) \
            // dense_weight_split(s) + replicated
        #: the routers' weights and biases of every MoE layer the controller plans (whole on every rank, fp32)
        self.router_params = (shape.moe_layers + mtp) * (h * shape.experts + shape.experts)
        self.param_bytes = self.dense_params * m.dtype_bytes  # the routers' are the phase builder's router_grad_bytes

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

    def _attention_parts(self, sliding: bool) -> tuple[float, float, float, float]:
        """(forward GEMM and core seconds, forward cast seconds, backward cast seconds, backward
        GEMM and core seconds) of one layer's attention, over the whole sequence or a sliding
        window."""
        shape, c, tokens, t = self.shape, self.compute, self.tokens, self.s.transformer
        linears = shape.attention_linears
        if c.shapes.enabled:
            gemms = c.linears_gemm_seconds(tokens, linears, splits=self.attention_splits, tp=self.tp)
            gemms_back = c.linears_gemm_seconds(tokens, linears, True, self.attention_splits, self.tp)
        else:
            gemms = c.gemm_time(2.0 * tokens * shape.attention_matrix_params, tokens, kernel="dense", fp8=True)
            gemms_back = 2.0 * gemms
        if shape.attention == "mla":
            core_flops = tokens * shape.attention_core_flops_per_token(t.seq_len, sliding)
        else:
            window = shape.sliding_window if sliding else 0
            core_flops = attention_core_flops(tokens, t.seq_len, shape.heads * shape.head_dim, window=window)
        # under CP each of the ring's steps runs a kernel on the GPU's seq_len / cp queries of a sequence
        core = self._core[sliding] = c.gemm_time(core_flops, self.local_seq, kernel="attention")
        return (gemms + core, c.linears_cast_seconds(tokens, linears), c.linears_cast_seconds(tokens, linears, True),
                gemms_back + 2.0 * core)

    def ring_core_s(self, layer: int, backward: bool) -> list[float]:
        """Context parallelism: seconds of the attention core of each attention sublayer of
        MoE layer ``layer``'s block (forward; backward twice that, as every GEMM's), which
        its ring runs in ``parallelism.cp_size`` equal steps (``testbed.policy.context_parallel``:
        every step the same pairs); included in ``forward_s`` / ``backward_s``. An empty list
        without context parallelism."""
        if self.cp == 1:
            return []
        layers = self.block_layers(layer)
        return [(2.0 if backward else 1.0) * self._core[self.shape.is_sliding_layer(i)] for i in layers]

    def layer_activation(self, moe: bool) -> float:
        """Activation bytes one layer keeps (model dtype), an MoE layer's or a dense-FFN one's,
        less what the recompute modules free of it."""
        return layer_activation_bytes(self.shape, moe=moe, **self._act_args)

    def recompute_work(self, moe: bool, sliding: bool) -> RecomputeWork:
        """What one layer's recompute modules of its attention and dense FFN
        (``BLOCK_RECOMPUTE_MODULES``) run again before its block's backward, per token."""
        modules = [name for name in self.modules if name in BLOCK_RECOMPUTE_MODULES]
        return LayerRecompute(self.shape, moe, self.s.transformer.seq_len, sliding).total_work(modules)

    def recompute_s(self, moe: bool, sliding: bool) -> float:
        """Seconds of ``recompute_work`` on the rank's tokens (module doc); 0 without modules."""
        if not self.modules:
            return 0.0
        work, c, tokens = self.recompute_work(moe, sliding), self.compute, self.tokens
        return (c.linears_time(tokens, list(work.token_linears))
                + c.gemm_time(tokens * work.attention_flops, self.s.transformer.seq_len, kernel="attention")
                + kernel_seconds(c, tokens * work.token_kernel_elements))

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
        kernels = [k[0] for k in parts] + ["moe"] * sum(shape.is_moe_layer(i) for i in layers)
        kernel_f = grouped_sum(kernels, lambda k: self._kernels[k][0])
        kernel_b = grouped_sum(kernels, lambda k: self._kernels[k][1])
        forward = gemm + cast_f + kernel_f
        # by shape the backward's GEMMs are the input and weight gradients' own; else twice the forward's
        gemm_b = grouped_sum(parts, lambda k: piece(k)[3]) if self.compute.shapes.enabled else 2.0 * gemm
        backward = gemm_b + cast_b + kernel_b + (forward if self.recompute else 0.0)
        if self.modules:  # each layer's recompute, before its backward (on the critical path)
            backward += grouped_sum([(shape.is_moe_layer(i), shape.is_sliding_layer(i)) for i in layers],
                                    lambda k: self.recompute_s(*k))
        acts = [self.layer_activation(shape.is_moe_layer(i)) for i in layers]
        act = grouped_sum(acts, lambda v: v)
        copies = sum(self._attention_copies + (0.0 if shape.is_moe_layer(i) else self._ffn_copies) for i in layers)
        return forward, backward, act, act + copies

    def _mtp_block(self) -> tuple[float, float, float, float]:
        """(forward s, backward s, activation bytes, held bytes) of one MTP module's block
        (module doc): its projection and its attention over the whole sequence."""
        m, c, tokens, h = self.s.model, self.compute, self.tokens, self.s.model.hidden_size
        projection = [(2 * h, h)]
        attention = self._attention[False]
        if c.shapes.enabled:  # the projection column-parallel (Megatron-Core's eh_proj)
            gemm = c.linears_gemm_seconds(tokens, projection, splits=["column"], tp=self.tp) + attention[0]
            gemm_b = c.linears_gemm_seconds(tokens, projection, True, ["column"], self.tp) + attention[3]
        else:
            gemm = c.gemm_time(2.0 * tokens * 2 * h * h, tokens, "dense", fp8=True) + attention[0]
            gemm_b = 2.0 * gemm
        kernel_f, kernel_b = (self._kernels["attention"][i] + self._kernels["moe"][i] for i in (0, 1))
        forward = gemm + c.linears_cast_seconds(tokens, projection) + attention[1] + kernel_f
        backward = gemm_b + c.linears_cast_seconds(tokens, projection, True) + attention[2] + kernel_b \
            + (forward if self.recompute else 0.0)
        if self.modules:  # its layer's recompute (whole-sequence attention, an MoE FFN); the projection keeps its input
            backward += self.recompute_s(True, False)
        act = self.layer_activation(True) + 2 * tokens * h * m.dtype_bytes  # its layer; the projection's input
        return forward, backward, act, act + self._copies(projection) + self._attention_copies

    # ---- one block, for a glance: the model's last MoE layer's ------------------------------
    @property
    def block_forward_s(self) -> float:
        """Forward seconds of the model's last MoE layer's block (every block's without
        dense-first layers and sliding windows; the MTP modules' are after it)."""
        return self.forward_s[self.s.model.num_layers - 1]

    @property
    def block_backward_s(self) -> float:
        return self.backward_s[self.s.model.num_layers - 1]

    @property
    def block_activation_bytes(self) -> float:
        return self.activation_bytes[self.s.model.num_layers - 1]
