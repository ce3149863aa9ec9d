"""The whole transformer's dense part on one rank of the real backend (issue 13,
``transformer.enabled``): the embedding, each MoE layer's block of attention and dense
FFN layers before its route, and the output head with its loss.

The shapes are ``testbed.whole_model``'s, so the simulator counts the same parameters,
FLOPs and gradient bytes (``Planner.layer_grad_bytes``):

- MoE layer l's block: ``moe_every`` sublayers; sublayer j is a causal multi-head
  attention (Q, K, V, O; ``num_kv_heads`` key/value heads shared by groups of query
  heads), then a dense FFN (W1, gelu, W2) when j < ``moe_every - 1``; the last
  sublayer's FFN is the MoE layer itself. Each adds its output to its input (residual)
  after a parameter-free RMS normalisation of the input (norms carry no weights here, as
  ``whole_model`` leaves them out).
- The embedding (V x H) looks the tokens up before layer 0; the output head (H x V, or
  the embedding's transpose when ``tied_embeddings``) turns the last layer's output into
  logits, and the loss is their cross entropy with the target tokens.

Every rank holds every dense weight (data parallelism; tensor parallelism is the
simulator's only), in ``model.dtype``, initialised from generators seeded by
(run.seed, layer, sublayer, kind): the same on every rank and in every run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from real.layer import seed_of
from testbed.scenario import Scenario
from testbed.whole_model import shape_of


def _init(shape: tuple[int, int], seed: int, dtype, device) -> torch.Tensor:
    """A [fan_in, fan_out] weight of std 1/sqrt(fan_in), as a leaf that takes gradients."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) / shape[0] ** 0.5
    return w.to(device, dtype).requires_grad_()


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """x over its root mean square per row (no learned scale)."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class DenseModel:
    """The dense weights of one rank and their forward (module doc)."""

    def __init__(self, scenario: Scenario, dtype: torch.dtype, device: torch.device):
        s, t, m = scenario, scenario.transformer, scenario.model
        self.s, self.shape = s, shape_of(s)
        h, n, k, d = m.hidden_size, t.num_heads, t.kv_heads, m.hidden_size // t.num_heads
        self.heads, self.kv_heads, self.head_dim, self.seq_len = n, k, d, t.seq_len
        f = self.shape.dense_ffn
        seed = s.run.seed

        def w(shape, layer, sub, kind):
            return _init(shape, seed_of(seed, layer, sub, kind, 0xD5), dtype, device)

        #: per MoE layer: [(wq, wk, wv, wo) per sublayer], [(w1, w2) per dense FFN]
        self.attention: list[list[tuple[torch.Tensor, ...]]] = []
        self.ffn: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for layer in range(m.num_layers):
            self.attention.append([(w((h, n * d), layer, j, 1), w((h, k * d), layer, j, 2), w((h, k * d), layer, j, 3),
                                    w((n * d, h), layer, j, 4)) for j in range(t.moe_every)])
            self.ffn.append([(w((h, f), layer, j, 5), w((f, h), layer, j, 6)) for j in range(t.moe_every - 1)])
        #: [V, H]; looked up by token, and the output head when tied
        self.embedding = w((t.vocab_size, h), m.num_layers, 0, 7)  # seeded past the layers
        with torch.no_grad():  # embeddings of O(1) entries, as the MoE stack's inputs are
            self.embedding.mul_(h ** 0.5)
        self.head = None if t.tied_embeddings else w((h, t.vocab_size), m.num_layers, 0, 8)

    # ---- what the optimizer and the gradient sync see ---------------------------------------------
    def layer_params(self, layer: int) -> list[torch.Tensor]:
        """The dense weights whose gradients MoE layer ``layer``'s bucket carries
        (``testbed.whole_model.block_grad_bytes``): its block's, the output head's with the
        last layer, the embedding's with layer 0."""
        out = [p for sub in self.attention[layer] for p in sub] + [p for sub in self.ffn[layer] for p in sub]
        if layer == len(self.attention) - 1 and self.head is not None:
            out.append(self.head)
        if layer == 0:
            out.append(self.embedding)
        return out

    def params(self) -> list[torch.Tensor]:
        return [p for layer in range(len(self.attention)) for p in self.layer_params(layer)]

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params())

    # ---- forward -----------------------------------------------------------------------------------
    def embed(self, tokens_T: torch.Tensor) -> torch.Tensor:
        return self.embedding.index_select(0, tokens_T)

    def block(self, layer: int, x_TH: torch.Tensor) -> torch.Tensor:
        """MoE layer ``layer``'s block: its attentions and the dense FFNs between them."""
        for j, qkvo in enumerate(self.attention[layer]):
            x_TH = x_TH + self._attention(rms_norm(x_TH), *qkvo)
            if j < len(self.ffn[layer]):
                w1, w2 = self.ffn[layer][j]
                x_TH = x_TH + F.gelu(rms_norm(x_TH) @ w1) @ w2
        return x_TH

    def _attention(self, x_TH, wq, wk, wv, wo) -> torch.Tensor:
        """Causal attention within each sequence of ``seq_len`` consecutive tokens."""
        T, n, k, d = x_TH.shape[0], self.heads, self.kv_heads, self.head_dim
        b, s = T // self.seq_len, self.seq_len
        q = (x_TH @ wq).view(b, s, n, d).transpose(1, 2)  # [b, n, s, d]
        kk = (x_TH @ wk).view(b, s, k, d).transpose(1, 2)
        v = (x_TH @ wv).view(b, s, k, d).transpose(1, 2)
        if k < n:  # grouped-query attention: each key/value head serves n / k query heads
            kk, v = kk.repeat_interleave(n // k, dim=1), v.repeat_interleave(n // k, dim=1)
        out = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
        return out.transpose(1, 2).reshape(T, n * d) @ wo

    def loss(self, x_TH: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        """Cross entropy of the output head's logits with the target tokens (fp32)."""
        head = self.embedding.t() if self.head is None else self.head
        logits = rms_norm(x_TH) @ head
        return F.cross_entropy(logits.float(), targets_T)
