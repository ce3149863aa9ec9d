"""The FLOPs Megatron-LM reports for a training step, so that the testbed's MFU can be
set beside the MFU papers quote (DeepSeek-V3's, MegaScale-MoE's, Megatron's own).

This follows ``num_floating_point_operations`` (its standard-transformer path,
``transformer_flops``) in NVIDIA Megatron-LM ``megatron/training/training.py`` at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553, term by term, for one global batch of
``batch`` sequences of ``seq_len`` tokens (no packing: T = batch x seq_len tokens and
batch x seq_len^2 for the attention core):

- 3 x (forward, backward data and weight gradients) x 2 (a multiply-add) per weight;
  no recompute counted;
- per token, MLP: 3 x 2 x H x (F_d f N_dense + F top_k f N_moe + F_shared f N_moe), f = 3
  with SwiGLU (else 2), F_shared the width of all shared experts together; the router,
  the shared-expert gate, dropped or padded tokens cost nothing;
- attention, GQA: 3 x 2 x (H (q + 2 kv) + q H) per token and layer, q = d n, kv = d k;
  the core 3 x 2 x q / 2 x 2 per token x position (causal: the / 2; QK^T and the
  weighted values: the x 2) for every layer, sliding windows or not (Megatron counts a
  window layer as a whole-sequence one);
- attention, MLA: 3 x 2 x (r_q (H + n (d_nope + d_rope) + 1) + r_kv (H + n (d_nope + d_v)
  + 1) + H d_rope + n d_v H) (H n (d_nope + d_rope) for the query without a latent; the
  "+ 1"s stand for the latents' norms), the core 3 x 2 x (n (d_nope + d_rope) / 2 + n d_v / 2);
- MTP: each module one more layer (MoE when the last layer is), plus 3 x 2 x (3 H + 2 H^2)
  for its norms and projection, and one more head;
- the head: 3 x 2 x H x V_padded x (MTP modules + 1); the embedding is free.

``testbed.model.transformer_shape`` counts the same model its own way (sliding windows'
bands, routers, gates); where the two differ is what Megatron leaves out.
"""

from __future__ import annotations

from testbed.model.transformer_shape import TransformerShape

#: Megatron-LM's --make-vocab-size-divisible-by default
VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab: int, tp: int = 1, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary Megatron-LM pads to: a multiple of ``multiple`` x ``tp``
    (``_vocab_size_with_padding`` in megatron/training/tokenizer)."""
    step = multiple * tp
    return -(-vocab // step) * step


def megatron_flops(shape: TransformerShape, batch: int, seq_len: int, padded_vocab: int | None = None) -> float:
    """FLOPs Megatron-LM counts for one global batch of ``batch`` sequences of ``seq_len``
    tokens, forward and backward (module doc); ``padded_vocab``: Megatron's
    padded vocabulary (default ``padded_vocab_size(shape.vocab)``)."""
    s = shape
    vocab = padded_vocab if padded_vocab is not None else padded_vocab_size(s.vocab)
    tokens, seq_squares = batch * seq_len, batch * seq_len * seq_len
    fwd_bwd, fma = 3, 2  # forward + wgrad + dgrad; a multiply-add is 2 FLOPs
    ffn_factor = 3 if s.ffn_matrices == 3 else 2  # SwiGLU's gate and up, and down; else up and down
    h = s.hidden

    num_layers = s.layers
    if s.experts:
        pattern = [1 if s.is_moe_layer(i) else 0 for i in range(s.layers)]  # moe_layer_freq as a list
        num_moe, routed_to, last_is_moe = sum(pattern), s.top_k, pattern[-1]
    else:
        num_moe, routed_to, last_is_moe = 0, 0, 0
    num_dense = s.layers - num_moe
    mtp = s.mtp_layers
    if mtp:  # each MTP module's layer is MoE when the last layer is
        num_moe += last_is_moe * mtp
        num_dense += (1 - last_is_moe) * mtp
        num_layers += mtp
    shared = s.shared_experts * s.shared_ffn_width if s.experts else 0

    if s.attention == "mla":
        n, qk = s.heads, s.qk_nope_head_dim + s.qk_rope_head_dim
        q_term = s.q_lora_rank * (h + n * qk + 1) if s.q_lora_rank else h * n * qk
        attn = fwd_bwd * fma * (q_term + s.kv_lora_rank * (h + n * (s.qk_nope_head_dim + s.v_head_dim) + 1)
                                + h * s.qk_rope_head_dim + n * s.v_head_dim * h)
        core = fwd_bwd * fma * (n * qk / 2 + n * s.v_head_dim / 2)
    else:
        q = s.head_dim * s.heads
        kv = s.head_dim * s.kv_heads
        attn = fwd_bwd * fma * (h * (q + kv + kv) + q * h)
        core = fwd_bwd * fma * q / 2 * 2  # causal mask (/ 2); QK^T and (QK^T)V (x 2)

    per_token = (
        fwd_bwd * fma * h * (s.dense_ffn * ffn_factor * num_dense
                             + s.expert_ffn * routed_to * ffn_factor * num_moe
                             + shared * ffn_factor * num_moe)
        + attn * num_layers
        + fwd_bwd * fma * mtp * (3 * h + 2 * h * h)  # MTP norms and its 2H x H projection
        + fwd_bwd * fma * h * vocab * (mtp + 1)  # the head, once per MTP module more
    )
    return tokens * per_token + seq_squares * core * num_layers


def megatron_flops_per_token(shape: TransformerShape, seq_len: int, padded_vocab: int | None = None) -> float:
    """Megatron-LM's FLOPs of one token in sequences of ``seq_len`` (forward + backward)."""
    return megatron_flops(shape, 1, seq_len, padded_vocab) / seq_len
