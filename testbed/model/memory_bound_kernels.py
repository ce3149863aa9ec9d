"""The memory-bound kernels of a training step and the bytes each reads and writes (issue
26, item 2): the norms, RoPE, the residual adds, the FFN activations, the router's
softmax and top-k, the token permutation and its inverse, and the loss. A GPU runs them
at its memory bandwidth (``sim.hardware.compute.ComputeModel.memory_seconds``); their
arithmetic is negligible. The GEMMs, attention's core, the optimizer step and fp8's casts
are costed elsewhere (``ComputeModel``, ``testbed.model.fp8_casts``).

Each kernel moves every element it reads and every element it writes once (a fused
kernel's intermediates stay on chip), in the model dtype unless said. Forward and
backward, per token of the layer (``*_token``) and per expert row, a kept (token, expert)
slot (``*_row``). Read from NVIDIA/Megatron-LM d98e8a64dd (``megatron/core/``) and
Transformer Engine's fused kernels, which Megatron-Core's layer spec uses:

- a norm (RMSNorm or LayerNorm, TE's ``rmsnorm_fwd``/``rmsnorm_bwd``): forward reads H,
  writes H; backward reads the input and the output gradient, writes the input gradient
  (3H; the weight gradient's partial sums are per block, left out). Every layer has two
  (the input norm, the pre-MLP norm; TE's LayerNormLinear runs its norm as a kernel of its
  own before the GEMM). MLA adds its two latent norms (q_lora_rank and kv_lora_rank wide).
- RoPE (TE's fused ``apply_rotary_pos_emb``): forward reads and writes the rotated part of
  the queries and keys, backward the same of their gradients. GQA: all n + k heads' d;
  MLA: the n query heads' and the shared key's d_rope.
- a residual add (``bias_dropout_add``, two a layer): forward reads two H, writes one;
  backward sums the two gradients at the branch (3H). Without dropout or bias.
- the FFN activation (``bias_swiglu``/``bias_gelu`` fusions): forward reads (matrices - 1)
  x F, writes F; backward reads those and F of output gradient, writes (matrices - 1) F:
  (2 matrices - 1) F. Per row for routed experts (Megatron multiplies each row by its
  probability inside the same kernel, experts.py), per token for dense FFNs and the shared
  experts (S F_s).
- the router (``topk_softmax_with_capacity``, TE's fused router): forward reads E logits
  and writes E scores and the routing map (fp32 and a byte: 9E bytes); backward reads the
  scores and their gradient, writes the logits' (12E bytes in fp32).
- the permutation (``moe_permute``, TE's fused permute) on the token's GPU gathers each
  row (reads H, writes H) and its inverse sums each token's weighted rows (reads H per
  row, writes H per token); with more than one expert on a GPU after the EP all-to-all,
  the received rows are sorted by local expert and back (``sort_chunks_by_idxs``: reads
  and writes H per row each way). The backward moves the same bytes of gradients.
- the loss (``VocabParallelCrossEntropy``, fp32): forward reads the logits (model dtype),
  writes their fp32 exponentials and reads them once more to normalise (2 + 4 + 4 = 10
  bytes a vocabulary entry); backward reads them and writes the logits' gradient (4 + 2).

Per GPU under tensor parallelism with sequence parallelism, every figure is per token the
GPU holds between sublayers: a norm or a residual add runs on the GPU's own 1/t of the
group's rows, a split tensor (heads, FFN columns, the vocabulary's logits) on all t of
them at 1/t of the width, which is the same count a token.

Left out: the embedding lookup and its scatter-add (H a token), the softmax statistics of
flash attention (inside its kernel), the index maps of the permutation (int32), the norms'
fp32 statistics. Bytes are per token or per row; sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.model.transformer_shape import TransformerShape

FP32 = 4


@dataclass(frozen=True)
class KernelBytes:
    """Bytes memory-bound kernels read and write: per token and per expert row, forward
    and backward."""

    forward_token: float = 0.0
    backward_token: float = 0.0
    forward_row: float = 0.0
    backward_row: float = 0.0

    def __add__(self, other: KernelBytes) -> KernelBytes:
        return KernelBytes(self.forward_token + other.forward_token, self.backward_token + other.backward_token,
                           self.forward_row + other.forward_row, self.backward_row + other.backward_row)


def attention_sublayer_bytes(shape: TransformerShape, dtype_bytes: int) -> KernelBytes:
    """The input norm, RoPE (and MLA's latent norms) and the residual add of one layer's
    attention sublayer, per token (module doc)."""
    h, n, d = shape.hidden, shape.heads, shape.head_dim
    if shape.attention == "mla":
        rotated = n * shape.qk_rope_head_dim + shape.qk_rope_head_dim
        latents = (shape.q_lora_rank or 0) + shape.kv_lora_rank
    else:
        rotated, latents = (n + shape.kv_heads) * d, 0
    forward = 2 * h + 2 * latents + 2 * rotated + 3 * h  # norms, RoPE, residual add
    backward = 3 * h + 3 * latents + 2 * rotated + 3 * h
    return KernelBytes(forward * dtype_bytes, backward * dtype_bytes)


def ffn_activation_bytes(width: int, matrices: int, dtype_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes of the activation of an FFN of inner width ``width``
    (``matrices`` 2: gelu, 3: SwiGLU), per token or row (module doc)."""
    return matrices * width * dtype_bytes, (2 * matrices - 1) * width * dtype_bytes


def dense_ffn_sublayer_bytes(shape: TransformerShape, dtype_bytes: int) -> KernelBytes:
    """The pre-MLP norm, the activation and the residual add of a dense-FFN sublayer, per token."""
    h = shape.hidden
    act_f, act_b = ffn_activation_bytes(shape.dense_ffn, shape.ffn_matrices, dtype_bytes)
    return KernelBytes(5 * h * dtype_bytes + act_f, 6 * h * dtype_bytes + act_b)


def moe_norm_residual_bytes(shape: TransformerShape, dtype_bytes: int) -> KernelBytes:
    """The pre-MLP norm and the residual add around an MoE FFN, per token (the dense block's)."""
    h = shape.hidden
    return KernelBytes(5 * h * dtype_bytes, 6 * h * dtype_bytes)


def router_bytes(shape: TransformerShape) -> KernelBytes:
    """The router's softmax (or sigmoid) and top-k over E experts, per token (module doc)."""
    e = shape.experts
    return KernelBytes(forward_token=(FP32 + FP32 + 1) * e, backward_token=3 * FP32 * e)


def expert_row_kernel_bytes(shape: TransformerShape, dtype_bytes: int, sorted_on_expert_gpu: bool,
                            expert_ffn: int | None = None) -> KernelBytes:
    """Per expert row a GPU computes: its activation (the routed expert's, of inner width
    ``expert_ffn``: one GPU's slice under expert TP; default the shape's) and, with
    ``sorted_on_expert_gpu``, the sort by local expert and back (module doc)."""
    act_f, act_b = ffn_activation_bytes(expert_ffn or shape.expert_ffn, shape.ffn_matrices, dtype_bytes)
    sort = 4 * shape.hidden * dtype_bytes if sorted_on_expert_gpu else 0.0
    return KernelBytes(forward_row=act_f + sort, backward_row=act_b + sort)


def token_slot_bytes(shape: TransformerShape, dtype_bytes: int) -> KernelBytes:
    """Per routed slot of a GPU's own tokens: the permutation (read H, write H) and its
    inverse (read H, and H per token, counted per slot as H / top_k); the backward the same
    of the gradients (module doc)."""
    h, k = shape.hidden, max(shape.top_k, 1)
    permute = (2 * h + h + h / k) * dtype_bytes
    return KernelBytes(forward_row=permute, backward_row=permute)


def shared_expert_bytes(shape: TransformerShape, dtype_bytes: int) -> KernelBytes:
    """The shared experts' activation, per token: S x F_s wide."""
    if not shape.shared_experts:
        return KernelBytes()
    f, b = ffn_activation_bytes(shape.shared_experts * shape.shared_ffn_width, shape.ffn_matrices, dtype_bytes)
    return KernelBytes(f, b)


def loss_bytes(vocab: int, dtype_bytes: int) -> KernelBytes:
    """The cross-entropy over ``vocab`` logits, per token (module doc)."""
    return KernelBytes((dtype_bytes + 2 * FP32) * vocab, (FP32 + dtype_bytes) * vocab)
