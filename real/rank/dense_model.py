"""The whole transformer's dense part on one rank of the real backend (issue 13,
``transformer.enabled``): the embedding, each MoE layer's block of attention and dense
FFN layers before its route, and the output head with its loss.

The shapes are ``testbed.policy.whole_model``'s, so the simulator counts the same parameters,
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

Every weight is initialised whole from a generator seeded by (run.seed, layer, sublayer,
kind): the same on every rank and in every run, in ``model.dtype``. Without tensor
parallelism every rank holds all of them (data parallelism); with it
(``parallelism.tp_size`` t, ``real.comm.tensor_parallel``) each rank of a group keeps its 1/t
of the heads, FFN columns and vocabulary, so a run with t = 2 computes what t = 1 does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from real.comm.collectives import AllGather, ReduceScatter
from real.comm.tensor_parallel import (
    EnterShard,
    FromReplicated,
    SumPartials,
    ToReplicated,
    VocabParallelCrossEntropy,
    shard,
)
from real.rank.layer import seed_of
from testbed.policy.whole_model import shape_of
from testbed.scenario.scenario import Scenario


@dataclass
class TensorGroup:
    """This rank's tensor-parallel group: ``size`` ranks ``members`` (sorted), this rank at
    ``index``, their process group and the rank's counted collectives."""

    size: int
    index: int
    members: tuple[int, ...]
    group: object
    comm: object

    sequence_parallel: bool = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of ``x``, in member order (backward: a reduce-scatter)."""
        return AllGather.apply(x.contiguous(), self.comm, self.members, self.group)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group of ``x``, this rank's rows of it (backward: an all-gather)."""
        return ReduceScatter.apply(x.contiguous(), self.comm, self.members, self.group)

    # without sequence parallelism (real.comm.tensor_parallel)
    def replicate(self, x: torch.Tensor) -> torch.Tensor:
        return ToReplicated.apply(x, self.comm, self.members, self.group, self.index)

    def own(self, x: torch.Tensor) -> torch.Tensor:
        return FromReplicated.apply(x, self.comm, self.members, self.group, self.index)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return EnterShard.apply(x, self.comm, self.members, self.group)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return SumPartials.apply(x, self.comm, self.members, self.group)


def _init(shape: tuple[int, int], seed: int, dtype, device, tp: TensorGroup | None = None,
          split: int | None = None) -> torch.Tensor:
    """A [fan_in, fan_out] weight of std 1/sqrt(fan_in), as a leaf that takes gradients:
    whole, or this rank's 1/t of it along dimension ``split``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) / shape[0] ** 0.5
    if tp is not None and split is not None:
        w = shard(w, split, tp.index, tp.size)
    return w.to(device, dtype).requires_grad_()


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """x over its root mean square per row (no learned scale)."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class DenseModel:
    """The dense weights of one rank and their forward (module doc)."""

    def __init__(self, scenario: Scenario, dtype: torch.dtype, device: torch.device, tp: TensorGroup | None = None,
                 place=None):
        s, t, m = scenario, scenario.transformer, scenario.model
        self.s, self.shape, self.tp = s, shape_of(s), tp
        # pipeline stages (testbed.policy.pipeline_stages): the embedding on the first, the head on the last,
        # and every weight seeded by its place in the whole model
        first_layer, layers = (place.first_layer, place.layers) if place is not None else (0, m.num_layers)
        self.has_embedding = place is None or place.first_stage
        self.has_head = place is None or place.last_stage
        parts = tp.size if tp is not None else 1
        h, n, k, d = m.hidden_size, t.num_heads, t.kv_heads, m.hidden_size // t.num_heads
        # this rank's heads (all, or its 1/t of the query and of the key/value heads)
        self.heads, self.kv_heads, self.head_dim, self.seq_len = n // parts, k // parts, d, t.seq_len
        f = self.shape.dense_ffn
        seed = s.run.seed
        #: the first vocabulary id of this rank's shard
        self.vocab_lo = t.vocab_size // parts * (tp.index if tp is not None else 0)

        def w(shape, layer, sub, kind, split=None):
            return _init(shape, seed_of(seed, first_layer + layer, sub, kind, 0xD5), dtype, device, tp, split)

        #: per MoE layer: [(wq, wk, wv, wo) per sublayer], [(w1, w2) per dense FFN]
        self.attention: list[list[tuple[torch.Tensor, ...]]] = []
        self.ffn: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for layer in range(m.num_layers):  # Q, K, V split by heads (columns), O by its rows; W1 columns, W2 rows
            self.attention.append([(w((h, n * d), layer, j, 1, 1), w((h, k * d), layer, j, 2, 1),
                                    w((h, k * d), layer, j, 3, 1), w((n * d, h), layer, j, 4, 0))
                                   for j in range(t.moe_every)])
            self.ffn.append([(w((h, f), layer, j, 5, 1), w((f, h), layer, j, 6, 0)) for j in range(t.moe_every - 1)])
        #: [V, H] (or this rank's V / t rows); looked up by token, and the output head when tied
        past = layers - first_layer  # seeded past the model's layers
        self.embedding = w((t.vocab_size, h), past, 0, 7, 0) if self.has_embedding else None
        if self.embedding is not None:
            with torch.no_grad():  # embeddings of O(1) entries, as the MoE stack's inputs are
                self.embedding.mul_(h ** 0.5)
        self.head = None if t.tied_embeddings or not self.has_head else w((h, t.vocab_size), past, 0, 8, 1)
        self._targets = None  # tensor parallel: the group's targets, gathered with its token ids

    # ---- what the optimizer and the gradient sync see ---------------------------------------------
    def layer_params(self, layer: int) -> list[torch.Tensor]:
        """The dense weights whose gradients MoE layer ``layer``'s bucket carries
        (``testbed.policy.whole_model.block_grad_bytes``): its block's, the output head's with the
        last layer, the embedding's with layer 0."""
        out = [p for sub in self.attention[layer] for p in sub] + [p for sub in self.ffn[layer] for p in sub]
        if layer == len(self.attention) - 1 and self.head is not None:
            out.append(self.head)
        if layer == 0 and self.embedding is not None:
            out.append(self.embedding)
        return out

    def params(self) -> list[torch.Tensor]:
        return [p for layer in range(len(self.attention)) for p in self.layer_params(layer)]

    # ---- forward -----------------------------------------------------------------------------------
    def embed(self, tokens_T: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        """This rank's tokens' embeddings [T, H]. Tensor parallel: the group's ids (with
        their targets, for the loss) gathered, each rank's rows of the vocabulary looked
        up, the partial embeddings summed back to each rank's own tokens."""
        tp = self.tp
        if tp is None:
            return self.embedding.index_select(0, tokens_T)
        both = tp.comm.all_gather(torch.stack([tokens_T, targets_T], dim=1).contiguous(), tp.members, tp.group)
        ids, self._targets = both[:, 0], both[:, 1]
        local = ids - self.vocab_lo
        mine = (local >= 0) & (local < self.embedding.shape[0])
        rows = self.embedding.index_select(0, local.clamp(0, self.embedding.shape[0] - 1))
        partial = rows * mine[:, None].to(rows.dtype)
        # sequence parallel: each rank's own rows; else the group's, replicated (layer 0's block takes them so)
        return tp.scatter(partial) if tp.sequence_parallel else tp.sum(partial)

    def block(self, layer: int, x_TH: torch.Tensor) -> torch.Tensor:
        """MoE layer ``layer``'s block: its attentions and the dense FFNs between them, on
        this rank's own rows in and out. Tensor parallel without sequence parallelism: on
        the group's rows, replicated (from the embedding as they are, from an MoE layer
        gathered), this rank's own handed to its MoE layer."""
        tp = self.tp
        if tp is not None and not tp.sequence_parallel:
            x_rep = x_TH if layer == 0 and self.has_embedding else tp.replicate(x_TH)
            return tp.own(self._layers(layer, x_rep))
        return self._layers(layer, x_TH)

    def _layers(self, layer: int, x_TH: torch.Tensor) -> torch.Tensor:
        for j, qkvo in enumerate(self.attention[layer]):
            x_TH = x_TH + self._sublayer(x_TH, lambda y: self._attention(y, *qkvo))
            if j < len(self.ffn[layer]):
                w1, w2 = self.ffn[layer][j]
                x_TH = x_TH + self._sublayer(x_TH, lambda y: F.gelu(y @ w1) @ w2)
        return x_TH

    def _sublayer(self, x_TH: torch.Tensor, fn) -> torch.Tensor:
        """``fn`` on the normalised input; tensor parallel: on the group's tokens (gathered),
        its partial outputs summed back to this rank's own."""
        y = rms_norm(x_TH)
        tp = self.tp
        if tp is None:
            return fn(y)
        if not tp.sequence_parallel:  # x_TH holds the group's rows already
            return tp.sum(fn(tp.enter(y)))
        return tp.scatter(fn(tp.gather(y)))

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

    def loss(self, x_TH: torch.Tensor, targets_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what this rank's backward starts from, the mean cross entropy over its own
        tokens) of the output head's logits with the target tokens, fp32.

        Without tensor parallelism both are the mean over the rank's tokens. Tensor
        parallel: the group's gathered states, each rank the logits of its vocabulary
        shard (``VocabParallelCrossEntropy``), every member then knows every group
        token's loss; each starts its backward from the sum of the group's per-rank means,
        because the others' losses depend on its shard too and their backward reaches
        only theirs - so the gradients are those of the ranks' means summed, as without."""
        head = self.embedding.t() if self.head is None else self.head
        tp = self.tp
        if tp is None:
            loss = F.cross_entropy((rms_norm(x_TH) @ head).float(), targets_T)
            return loss, loss
        if not self.has_embedding:  # a pipeline stage without the embedding: the group's targets here
            self._targets = tp.comm.all_gather(targets_T.contiguous(), tp.members, tp.group)
        if tp.sequence_parallel:
            logits = tp.gather(rms_norm(x_TH)) @ head
        else:  # the group's rows replicated, then into this rank's vocabulary shard
            logits = tp.enter(rms_norm(tp.replicate(x_TH))) @ head
        losses = VocabParallelCrossEntropy.apply(logits, self._targets, self.vocab_lo, tp.comm, tp.members, tp.group)
        T = x_TH.shape[0]
        return losses.sum() / T, losses[tp.index * T:(tp.index + 1) * T].mean()
