"""The single-process reference's model (``real.rank.reference``): the FFNs, shared experts
and the whole transformer around the MoE layers written out from their formulas, head by
head and sequence by sequence, not with the modules the distributed run uses, so that a
mistake there is not made twice. Only the initial weights and their names are taken from
the run's constructors (``DenseModel``, ``SharedExperts``, ``initial_router``), so that both
start from the same numbers.

- RMS norm: x / sqrt(mean(x^2) + 1e-6), no learned scale.
- FFN: gelu(x W1) W2, gelu(z) = z Phi(z); SwiGLU: (silu(x W_gate) * (x W_up)) W2, silu(z) =
  z sigmoid(z) (Shazeer 2020). An expert's W1 holds W_gate's columns then W_up's.
- Shared experts: sum_j FFN_j(x), times sigmoid(x w_g) with a gate (DeepSeek-V3 eq. 12,
  Qwen2-MoE).
- Attention, per sequence of ``transformer.seq_len`` and per head: softmax over the
  positions j <= i of q_i . k_j / sqrt(d_qk), weighting the v_j; GQA's query head i reads
  key/value head i // (n / k); biases added to the projections (Q, K, V; O's after it).
  MLA (DeepSeek-V2 eq. 9-19): q = norm(x W_dq) W_uq (or x W_q); [c, k_R] = x W_dkv;
  [k_C, v] = norm(c) W_ukv; head h's key [k_C,h; RoPE(k_R)], query [q_C,h; RoPE(q_R,h)].
- RoPE at position p: dimensions i and i + d/2 (i < d/2) turned by the angle p 10000^(-2i/d):
  (a, b) -> (a cos - b sin, b cos + a sin).
- The whole transformer: token embedding; ``first_dense_layers`` layers of attention and
  dense FFN, then per MoE layer ``moe_every`` attention sublayers with dense FFNs between
  them and the MoE layer; each sublayer x + f(norm(x)). Loss: the cross entropy -log
  softmax(norm(h) W_head)[target], mean over the rank's tokens.
- MTP module d (DeepSeek-V3 eq. 21-25): x = [norm(h); norm(E[t_{i+d+1}])] M_d, then an
  attention sublayer and its MoE layer; its loss the cross entropy with the target d + 1
  ahead in the sequence, mean over the positions that have one; lambda / D times their sum
  is added to the loss.
"""

from __future__ import annotations

import math

import torch

from real.rank.dense_model import DenseModel
from real.rank.mtp import MTP_LOSS_WEIGHT
from real.rank.rank_state import initial_router
from real.rank.shared_experts import SharedExperts
from testbed.scenario.scenario import Scenario


def rms_by_formula(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def gelu_by_formula(z: torch.Tensor) -> torch.Tensor:
    return z * 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))


def ffn_by_formula(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, swiglu: bool,
                   w_up: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x W1) W2, or SwiGLU's with W_gate = W1 and W_up (``w_up``, else W1's second half)."""
    if not swiglu:
        return gelu_by_formula(x @ w1) @ w2
    if w_up is None:
        f = w2.shape[0]
        w1, w_up = w1[:, :f], w1[:, f:]
    gate = x @ w1
    return (gate * torch.sigmoid(gate) * (x @ w_up)) @ w2


def rope_by_formula(x: torch.Tensor) -> torch.Tensor:
    """x [s, d]: row p turned by position p (module doc)."""
    s, d = x.shape
    half = d // 2
    i = torch.arange(half, dtype=torch.float32)
    angle = torch.arange(s, dtype=torch.float32)[:, None] * torch.pow(10000.0, -2.0 * i / d)[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[:, :half], x[:, half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=1)


def causal_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One head over one sequence: softmax_j<=i(q_i . k_j / sqrt(d)) v_j."""
    scores = q @ k.t() / math.sqrt(q.shape[1])
    future = torch.triu(torch.ones(q.shape[0], q.shape[0], dtype=torch.bool), diagonal=1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


class ReferenceModel:
    """The reference's weights by name (those of the run's ``RankState.named_params``) and
    the formulas above. ``scenario``: the model's; ``moe_layers``: the MoE layers the
    controller plans (the model's and one per MTP module, ``real.rank.mtp``)."""

    def __init__(self, scenario: Scenario, moe_layers: int, dtype: torch.dtype):
        s, m, t = scenario, scenario.model, scenario.transformer
        self.s, self.t, self.moe_layers, self.dtype = s, t, moe_layers, dtype
        self.swiglu = m.ffn_activation == "swiglu"
        cpu = torch.device("cpu")
        named: list[tuple[str, torch.Tensor]] = []
        shared = SharedExperts(s, moe_layers, dtype, cpu) if m.shared_experts else None
        dense = DenseModel(s, dtype, cpu) if t.enabled else None
        for layer in range(moe_layers):
            w, b = initial_router(s.run.seed, layer, s)
            named += [(f"router{layer}.w", w), (f"router{layer}.b", b)]
            if shared is not None:
                named += shared.named_layer_params(layer)
            if dense is not None:
                named += dense.named_layer_params(layer)
        self.p = {k: v.detach().clone().requires_grad_() for k, v in named}

    # ---- the MoE layer's shared experts --------------------------------------------------------
    def shared(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        m, p = self.s.model, self.p
        if not m.shared_experts:
            return None
        out = sum(ffn_by_formula(x, p[f"shared{layer}.{j}.w1"], p[f"shared{layer}.{j}.w2"], self.swiglu)
                  for j in range(m.shared_experts))
        gate = p.get(f"shared{layer}.gate")
        return out if gate is None else out * torch.sigmoid(x @ gate)

    # ---- attention -----------------------------------------------------------------------------
    def attention(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """The attention sublayer of weights ``prefix``* on normalised rows x [T, H]."""
        return self._mla(prefix, x) if self.t.attention == "mla" else self._gqa(prefix, x)

    def _gqa(self, prefix, x):
        t, p = self.t, self.p
        n, k = t.num_heads, t.kv_heads
        d = t.head_dim or x.shape[1] // n
        proj = {}
        for name in ("q", "k", "v"):
            y = x @ p[prefix + "w" + name]
            proj[name] = y + p[prefix + "b" + name] if prefix + "b" + name in p else y
        rows = []
        for first in range(0, x.shape[0], t.seq_len):
            seq = slice(first, first + t.seq_len)
            heads = []
            for i in range(n):
                g = i // (n // k)
                heads.append(causal_head(proj["q"][seq, i * d:(i + 1) * d], proj["k"][seq, g * d:(g + 1) * d],
                                         proj["v"][seq, g * d:(g + 1) * d]))
            rows.append(torch.cat(heads, dim=1))
        out = torch.cat(rows) @ p[prefix + "wo"]
        return out + p[prefix + "bo"] if prefix + "bo" in p else out

    def _mla(self, prefix, x):
        t, p = self.t, self.p
        n, nope, pe, dv, r = t.num_heads, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank
        q = rms_by_formula(x @ p[prefix + "wq_a"]) @ p[prefix + "wq_b"] if t.q_lora_rank else x @ p[prefix + "wq"]
        kv_a = x @ p[prefix + "wkv_a"]
        kv = rms_by_formula(kv_a[:, :r]) @ p[prefix + "wkv_b"]
        rows = []
        for first in range(0, x.shape[0], t.seq_len):
            seq = slice(first, first + t.seq_len)
            k_rope = rope_by_formula(kv_a[seq, r:])  # one per position, shared by the heads
            heads = []
            for i in range(n):
                qh = q[seq, i * (nope + pe):(i + 1) * (nope + pe)]
                kvh = kv[seq, i * (nope + dv):(i + 1) * (nope + dv)]
                query = torch.cat([qh[:, :nope], rope_by_formula(qh[:, nope:])], dim=1)
                key = torch.cat([kvh[:, :nope], k_rope], dim=1)
                heads.append(causal_head(query, key, kvh[:, nope:]))
            rows.append(torch.cat(heads, dim=1))
        return torch.cat(rows) @ p[prefix + "wo"]

    # ---- the whole transformer -----------------------------------------------------------------
    def _sublayers(self, attention: str, ffn: str | None, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(attention, rms_by_formula(h))
        if ffn is not None:
            p = self.p
            h = h + ffn_by_formula(rms_by_formula(h), p[ffn + "w1"], p[ffn + "w2"], self.swiglu, p.get(ffn + "w3"))
        return h

    def _cross_entropy(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head = self.p["embedding"].t() if self.t.tied_embeddings else self.p["head"]
        logits = (rms_by_formula(h) @ head).float()
        return -(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, moe) -> tuple[torch.Tensor, torch.Tensor, list]:
        """One rank's (main output [T, H], objective: the cross entropy plus lambda / D times
        the MTP modules', their cross entropies) for token ids ``tokens``; ``moe(layer, h)``
        is the reference's MoE layer ``layer`` on its input."""
        t, p = self.t, self.p
        h = p["embedding"][tokens]
        for i in range(t.first_dense_layers):
            h = self._sublayers(f"dense{i}.attention.", f"dense{i}.ffn.", h)
        main = self.moe_layers - t.mtp_layers
        for layer in range(main):
            for j in range(t.moe_every):
                h = self._sublayers(f"layer{layer}.attention{j}.", f"layer{layer}.ffn{j}." if j < t.moe_every - 1
                                    else None, h)
            h = moe(layer, h)
        out, objective, mtp = h, self._cross_entropy(h, targets).mean(), []
        seq, T = t.seq_len, tokens.shape[0]
        for d in range(t.mtp_layers):
            k = d + 1
            valid = torch.tensor([(i % seq) + k < seq for i in range(T)])
            ahead = torch.tensor([int(tokens[i + k]) if valid[i] else 0 for i in range(T)])
            ahead_targets = torch.tensor([int(targets[i + k]) if valid[i] else 0 for i in range(T)])
            emb = p["embedding"][ahead] * valid[:, None].to(h.dtype)
            x = torch.cat([rms_by_formula(h), rms_by_formula(emb)], dim=1) @ p[f"mtp{d}.proj"]
            h = moe(main + d, self._sublayers(f"mtp{d}.attention.", None, x))
            ce = self._cross_entropy(h, ahead_targets)[valid].mean()
            mtp.append(ce)
            objective = objective + MTP_LOSS_WEIGHT / t.mtp_layers * ce
        return out, objective, mtp
