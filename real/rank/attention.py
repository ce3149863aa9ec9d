"""One attention sublayer of the real whole transformer: its weights and its causal forward
within each sequence of ``transformer.seq_len`` consecutive tokens, with the shapes of
``testbed.model.transformer_shape`` (so its parameters are the model card's).

- Grouped-query attention (``transformer.attention = "gqa"``; Ainslie et al. 2023): Q
  (H x n d), K and V (H x k d: ``num_kv_heads`` heads, each serving n / k query heads), O
  (n d x H), the head dimension d ``transformer.head_dim`` (H / n unless given). Biases
  (``transformer.attention_bias``): of Q, K and V (``qkv``, Qwen2) or of all four
  (``all``, gpt-oss). No positional encoding (the testbed's GQA layers never had one).
- Multi-head latent attention (``"mla"``; DeepSeek-V2 §2.1, HF ``modeling_deepseek.py``
  ``DeepseekV2Attention``): the query from a latent of rank r_q, c_q = norm(x W_dq) (H x
  r_q), q = c_q W_uq (r_q x n (d_nope + d_rope)), or q = x W_q when
  ``transformer.q_lora_rank`` is 0; keys and values from one latent and a shared RoPE key,
  [c_kv, k_rope] = x W_dkv (H x (r_kv + d_rope)), [k_nope, v] = norm(c_kv) W_ukv (r_kv x n
  (d_nope + d_v)); each head's key [k_nope; k_rope] against its query [q_nope; q_rope],
  both RoPE parts rotated by position, scaled by 1 / sqrt(d_nope + d_rope); the output
  n d_v x H. The latents' norms carry no weights (the model's norms never do here).
- RoPE (Su et al. 2021, "RoFormer"; the rotate-half form of HF's ``apply_rotary_pos_emb``):
  dimension pair (i, i + d/2) of a head rotated by p theta^(-2i/d) at position p of its
  sequence, theta = ``ROPE_THETA``.

Weights are [fan_in, fan_out] (``real.rank.dense_model``'s init), biases 1-D. Under tensor
parallelism each rank holds its 1/t of the heads: Q, K, V (and their biases) split by
columns, O by rows; MLA and an output bias are not split (refused: ``real.backend``).

Recompute by module (``transformer.recompute_modules``, ``real.rank.recompute``): ``core_attn``
checkpoints the causal core (scaled dot-product attention: it keeps Q, K, V as its inputs
and frees its softmax statistics); ``mla_up_proj`` checkpoints MLA's up projections
without their output (Megatron-Core's ``qkv_up_proj_and_rope_apply``,
multi_latent_attention.py:983-987): from the latents [c_q (x without a query latent),
[c_kv, k_rope]] through the latents' norms, the up projections and RoPE to Q, K, V, which
the core then keeps no copy of (refilled in the backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from real.rank.recompute import NO_RECOMPUTE

#: RoPE's base (DeepSeek-V2/V3's config.json ``rope_theta``: 10000; its YaRN scaling is not modelled)
ROPE_THETA = 10000.0


def attention_weights(t, hidden: int, w, b) -> dict[str, torch.Tensor]:
    """One sublayer's weights, in the order the gradient buckets carry them: ``w(shape,
    kind, split)`` makes a matrix, ``b(size, kind, split)`` a bias (split: the dimension
    tensor parallelism cuts, or None). Kinds 1-4 are Q, K, V, O as before MLA and biases."""
    if t.attention == "mla":
        n, qk = t.num_heads, t.qk_nope_head_dim + t.qk_rope_head_dim
        out = {}
        if t.q_lora_rank:
            out["wq_a"] = w((hidden, t.q_lora_rank), 20, None)
            out["wq_b"] = w((t.q_lora_rank, n * qk), 21, None)
        else:
            out["wq"] = w((hidden, n * qk), 1, None)
        out["wkv_a"] = w((hidden, t.kv_lora_rank + t.qk_rope_head_dim), 22, None)
        out["wkv_b"] = w((t.kv_lora_rank, n * (t.qk_nope_head_dim + t.v_head_dim)), 23, None)
        out["wo"] = w((n * t.v_head_dim, hidden), 4, None)
        return out
    n, k = t.num_heads, t.kv_heads
    d = t.head_dim or hidden // n
    out = {"wq": w((hidden, n * d), 1, 1), "wk": w((hidden, k * d), 2, 1), "wv": w((hidden, k * d), 3, 1),
           "wo": w((n * d, hidden), 4, 0)}
    if t.attention_bias in ("qkv", "all"):
        out.update(bq=b(n * d, 10, 0), bk=b(k * d, 11, 0), bv=b(k * d, 12, 0))
    if t.attention_bias == "all":
        out["bo"] = b(hidden, 13, None)
    return out


def rope(x: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """x [b, heads, s, d] rotated by position along s (module doc)."""
    s, d = x.shape[-2], x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)  # [d / 2]
    angle = torch.arange(s, dtype=torch.float32, device=x.device)[:, None] * inv[None, :]  # [s, d / 2]
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(x.dtype), torch.cat([angle.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def latent_norm(x: torch.Tensor) -> torch.Tensor:
    """RMS normalisation of a latent (no learned scale, as every norm here)."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class Attention:
    """The forward of attention sublayers of one shape: ``heads`` query and ``kv_heads``
    key/value heads (this rank's), ``seq_len`` tokens a sequence."""

    def __init__(self, t, hidden: int, heads: int, kv_heads: int, seq_len: int, recompute=NO_RECOMPUTE):
        self.t, self.heads, self.kv_heads, self.seq_len = t, heads, kv_heads, seq_len
        self.head_dim = t.head_dim or hidden // t.num_heads
        self.mla = t.attention == "mla"
        #: the recompute modules (``real.rank.recompute.Recompute``): core_attn and mla_up_proj are wired here
        self.recompute = recompute

    def __call__(self, x_TH: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """Causal attention of normalised rows ``x_TH`` (whole sequences) -> [T, H]; the
        output bias, if any, is added by the caller after tensor parallelism's sum."""
        return self._mla(x_TH, w) if self.mla else self._gqa(x_TH, w)

    def _gqa_qkv(self, x_TH, w, s: int):
        """Q [b, n, s, d] and K, V [b, k, s, d] of rows ``x_TH`` in sequences of ``s`` rows,
        with their biases if any."""
        T, n, k, d = x_TH.shape[0], self.heads, self.kv_heads, self.head_dim
        b = T // s

        def project(name):
            y = x_TH @ w["w" + name]
            return y + w["b" + name] if "b" + name in w else y

        q = project("q").view(b, s, n, d).transpose(1, 2)
        kk = project("k").view(b, s, k, d).transpose(1, 2)
        v = project("v").view(b, s, k, d).transpose(1, 2)
        return q, kk, v

    def _gqa(self, x_TH, w):
        T, n, k, d = x_TH.shape[0], self.heads, self.kv_heads, self.head_dim
        q, kk, v = self._gqa_qkv(x_TH, w, self.seq_len)
        if k < n:  # grouped-query attention: each key/value head serves n / k query heads
            kk, v = kk.repeat_interleave(n // k, dim=1), v.repeat_interleave(n // k, dim=1)
        out = self.recompute.run("core_attn", causal_core, q, kk, v)
        return out.transpose(1, 2).reshape(T, n * d) @ w["wo"]

    def _mla_qkv(self, x_TH, w, s: int, rotate):
        """MLA's Q and K [b, n, s, nope + pe] and V [b, n, s, dv] of rows ``x_TH`` in sequences
        of ``s`` rows; ``rotate`` applies RoPE to the last dimension (at the rows' positions)."""
        return self._mla_up(self._mla_latents(x_TH, w), w, s, rotate)

    @staticmethod
    def _mla_latents(x_TH, w):
        """The up projections' inputs: (c_q = x W_dq, or x without a query latent;
        [c_kv, k_rope] = x W_dkv)."""
        return (x_TH @ w["wq_a"] if "wq_a" in w else x_TH), x_TH @ w["wkv_a"]

    def _mla_up(self, latents, w, s: int, rotate):
        """Q, K, V (``_mla_qkv``) from the latents: their norms, the up projections, RoPE."""
        t = self.t
        c_q, kv_a = latents
        T, n = c_q.shape[0], self.heads
        b = T // s
        nope, pe, dv, r = t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank
        q = latent_norm(c_q) @ w["wq_b"] if "wq_a" in w else c_q @ w["wq"]
        q = q.view(b, s, n, nope + pe).transpose(1, 2)  # [b, n, s, nope + pe]
        c_kv, k_pe = kv_a[:, :r], kv_a[:, r:]
        kv = (latent_norm(c_kv) @ w["wkv_b"]).view(b, s, n, nope + dv).transpose(1, 2)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k_pe = rotate(k_pe.view(b, 1, s, pe)).expand(b, n, s, pe)  # one RoPE key shared by the heads
        q = torch.cat([q[..., :nope], rotate(q[..., nope:])], -1)
        return q, torch.cat([k_nope, k_pe], -1), v

    def _mla(self, x_TH, w):
        T, n, dv = x_TH.shape[0], self.heads, self.t.v_head_dim

        def core(qkv):  # the up projections' consumer: it keeps no copy of Q, K, V under mla_up_proj
            return self.recompute.run("core_attn", causal_core, *qkv)  # scale 1 / sqrt(nope + pe)

        out = self.recompute.run_without_output(
            "mla_up_proj", lambda *latents: self._mla_up(latents, w, self.seq_len, rope), core,
            *self._mla_latents(x_TH, w))
        return out.transpose(1, 2).reshape(T, n * dv) @ w["wo"]


def causal_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention's core [b, n, s, d_v] within each sequence: causal softmax(q k^T / sqrt(d)) v."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
