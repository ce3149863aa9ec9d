"""The whole transformer's dense part on one rank of the real backend (issue 13,
``transformer.enabled``): the embedding, each MoE layer's block of attention and dense
FFN layers before its route, and the output head with its loss.

The shapes are ``testbed.model.whole_model``'s (``transformer_shape``), so the simulator
counts the same parameters, FLOPs and gradient bytes (``Planner.layer_grad_bytes``):

- MoE layer l's block: ``moe_every`` sublayers; sublayer j is a causal attention
  (``real.rank.attention``: grouped-query with ``num_kv_heads`` key/value heads, a
  ``head_dim`` of its own, biases by ``attention_bias``; or MLA), then a dense FFN when j <
  ``moe_every - 1``; the last sublayer's FFN is the MoE layer itself. A dense FFN is
  gelu(x W1) W2, or with ``model.ffn_activation = "swiglu"`` (silu(x W1) * x W3) W2, W1 the
  gate and W3 the up (Shazeer 2020). Each adds its output to its input (residual) after a
  parameter-free RMS normalisation of the input (norms carry no weights here, as
  ``whole_model`` leaves them out).
- ``transformer.first_dense_layers`` layers of attention and a dense FFN come before MoE
  layer 0's block (DeepSeek-V3's first three), their weights in its bucket.
- The embedding (V x H) looks the tokens up before layer 0; the output head (H x V, or
  the embedding's transpose when ``tied_embeddings``) turns the last layer's output into
  logits, and the loss is their cross entropy with the target tokens.
- ``transformer.mtp_layers`` multi-token-prediction modules after the last layer
  (``real.rank.mtp``): each a projection of the hidden state and the embedding of a token
  ahead, an attention sublayer, an MoE layer and the shared head.

Every weight is initialised whole from a generator seeded by (run.seed, layer, sublayer,
kind): the same on every rank and in every run, in ``model.dtype``. Biases are drawn with
std ``BIAS_STD`` (assumed: small, and not zero, so that a misplaced bias shows at the first
step). Without tensor parallelism every rank holds all of them (data parallelism); with it
(``parallelism.tp_size`` t, ``real.comm.tensor_parallel``) each rank of a group keeps its 1/t
of the heads, FFN columns and vocabulary, so a run with t = 2 computes what t = 1 does. With
context parallelism (``parallelism.cp_size``) a rank's rows are its chunks of its CP group's
sequences and its attention cores run around the group's ring (``real.rank.context_parallel``);
everything else is per token, as without.

Recompute by module (``transformer.recompute_modules``, ``real.rank.recompute``): ``mlp``
checkpoints each dense FFN (its GEMMs and activation; the norm before it is its own here,
not fused into the first GEMM as in Transformer Engine's spec); ``layernorm`` checkpoints
each sublayer's norm without its output (the attention's input norm, a dense FFN's; an MoE
layer here reads its input unnormalised, so it has no norm of its own); the attention's
modules are ``real.rank.attention``'s.
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
from real.rank.attention import Attention, attention_weights
from real.rank.context_parallel import ContextParallelAttention
from real.rank.layer import seed_of
from real.rank.mtp import MTP_LAYER, mtp_weights, tokens_ahead
from real.rank.recompute import Recompute
from testbed.model.whole_model import shape_of
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


#: std of every bias's initial values (assumed; module doc)
BIAS_STD = 0.1
#: sublayer index the first dense layers' weights are seeded by (i added): past any block's sublayers
FIRST_DENSE_SUB = 1000


def _init_bias(size: int, seed: int, dtype, device, tp: TensorGroup | None = None,
               split: int | None = None) -> torch.Tensor:
    """A bias [size] of std ``BIAS_STD``: whole, or this rank's 1/t of it (``split`` 0)."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(size, generator=g) * BIAS_STD
    if tp is not None and split is not None:
        b = shard(b, split, tp.index, tp.size)
    return b.to(device, dtype).requires_grad_()


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """x over its root mean square per row (no learned scale)."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class DenseModel:
    """The dense weights of one rank and their forward (module doc)."""

    def __init__(self, scenario: Scenario, dtype: torch.dtype, device: torch.device, tp: TensorGroup | None = None,
                 place=None, ring=None):
        """``tp``: this rank's tensor-parallel group (or None); ``place``: its pipeline stage
        (or None); ``ring``: its context-parallel ring (``real.rank.context_parallel.context_ring``,
        or None), around which its attention cores run."""
        s, t, m = scenario, scenario.transformer, scenario.model
        self.s, self.shape, self.tp = s, shape_of(s), tp
        # pipeline stages (testbed.policy.pipeline_stages): the embedding on the first, the head on the last,
        # and every weight seeded by its place in the whole model
        first_layer, layers = (place.first_layer, place.layers) if place is not None else (0, m.num_layers)
        self.has_embedding = place is None or place.first_stage
        self.has_head = place is None or place.last_stage
        parts = tp.size if tp is not None else 1
        h = m.hidden_size
        # this rank's heads (all, or its 1/t of the query and of the key/value heads); under context
        # parallelism their core around the ring
        heads = (t.num_heads // parts, t.kv_heads // parts)
        #: the recompute modules (transformer.recompute_modules): layernorm and mlp here, attention's in attend
        self.recompute = Recompute.of(s)
        self.attend = (Attention(t, h, *heads, t.seq_len, self.recompute) if ring is None
                       else ContextParallelAttention(t, h, *heads, t.seq_len, ring))
        self.seq_len = t.seq_len
        self.swiglu = m.ffn_activation == "swiglu"
        f = self.shape.dense_ffn
        seed = s.run.seed
        #: the first vocabulary id of this rank's shard
        self.vocab_lo = t.vocab_size // parts * (tp.index if tp is not None else 0)

        def w(shape, layer, sub, kind, split=None):
            return _init(shape, seed_of(seed, first_layer + layer, sub, kind, 0xD5), dtype, device, tp, split)

        def b(size, layer, sub, kind, split=None):
            return _init_bias(size, seed_of(seed, first_layer + layer, sub, kind, 0xB1A5), dtype, device, tp, split)

        def attention(layer, sub):
            return attention_weights(t, h, lambda shape, kind, split: w(shape, layer, sub, kind, split),
                                     lambda size, kind, split: b(size, layer, sub, kind, split))

        def ffn(layer, sub):  # W1 (the gate with SwiGLU) and W3 (the up) split by columns, W2 by rows
            out = {"w1": w((h, f), layer, sub, 5, 1), "w2": w((f, h), layer, sub, 6, 0)}
            if self.swiglu:
                out["w3"] = w((h, f), layer, sub, 9, 1)
            return out

        #: per MoE layer: its block's attention sublayers and the dense FFNs between them
        self.attention: list[list[dict[str, torch.Tensor]]] = []
        self.ffn: list[list[dict[str, torch.Tensor]]] = []
        for layer in range(m.num_layers):
            self.attention.append([attention(layer, j) for j in range(t.moe_every)])
            self.ffn.append([ffn(layer, j) for j in range(t.moe_every - 1)])
        #: ``transformer.first_dense_layers`` (attention, dense FFN) before MoE layer 0's block, in its bucket
        self.first_dense = [(attention(0, FIRST_DENSE_SUB + i), ffn(0, FIRST_DENSE_SUB + i))
                            for i in range(t.first_dense_layers if first_layer == 0 else 0)]
        #: ``transformer.mtp_layers`` modules after the last layer (``real.rank.mtp``): MoE layers L, L + 1, ...
        self.mtp = [mtp_weights(h, lambda shape, kind, split, d=d: w(shape, MTP_LAYER + d, 0, kind, split),
                                lambda size, kind, split, d=d: b(size, MTP_LAYER + d, 0, kind, split),
                                lambda layer_w, layer_b: attention_weights(t, h, layer_w, layer_b))
                    for d in range(t.mtp_layers)]
        #: [V, H] (or this rank's V / t rows); looked up by token, and the output head when tied
        past = layers - first_layer  # seeded past the model's layers
        self.embedding = w((t.vocab_size, h), past, 0, 7, 0) if self.has_embedding else None
        if self.embedding is not None:
            with torch.no_grad():  # embeddings of O(1) entries, as the MoE stack's inputs are
                self.embedding.mul_(h ** 0.5)
        self.head = None if t.tied_embeddings or not self.has_head else w((h, t.vocab_size), past, 0, 8, 1)
        self._targets = None  # tensor parallel: the group's targets, gathered with its token ids

    # ---- what the optimizer and the gradient sync see ---------------------------------------------
    @property
    def moe_layers(self) -> int:
        """MoE layers whose buckets carry these weights: the model's, then one per MTP module."""
        return len(self.attention) + len(self.mtp)

    def named_layer_params(self, layer: int) -> list[tuple[str, torch.Tensor]]:
        """(name, weight) of the dense weights whose gradients MoE layer ``layer``'s bucket
        carries (``testbed.model.whole_model.block_grad_bytes``), in bucket order: its
        block's (attention, dense FFNs); with the last MoE layer (ready first in the
        backward) the MTP modules' projections and attentions (``real.rank.mtp``: their MoE
        layers have no block) and the output head's; with layer 0 the first dense layers'
        and the embedding's (ready last)."""
        out = []
        if layer < len(self.attention):
            out = [(f"layer{layer}.attention{j}.{k}", p) for j, sub in enumerate(self.attention[layer])
                   for k, p in sub.items()]
            out += [(f"layer{layer}.ffn{j}.{k}", p) for j, sub in enumerate(self.ffn[layer]) for k, p in sub.items()]
        if layer == self.moe_layers - 1:
            for d, module in enumerate(self.mtp):
                out.append((f"mtp{d}.proj", module["proj"]))
                out += [(f"mtp{d}.attention.{k}", p) for k, p in module["attention"].items()]
            if self.head is not None:
                out.append(("head", self.head))
        if layer == 0:
            for i, (att, ffn) in enumerate(self.first_dense):
                out += [(f"dense{i}.attention.{k}", p) for k, p in att.items()]
                out += [(f"dense{i}.ffn.{k}", p) for k, p in ffn.items()]
            if self.embedding is not None:
                out.append(("embedding", self.embedding))
        return out

    def layer_params(self, layer: int) -> list[torch.Tensor]:
        """The weights of ``named_layer_params``."""
        return [p for _, p in self.named_layer_params(layer)]

    def params(self) -> list[torch.Tensor]:
        return [p for layer in range(self.moe_layers) for p in self.layer_params(layer)]

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
        """MoE layer ``layer``'s block: its attentions and the dense FFNs between them (layer
        0's after the first dense layers), on this rank's own rows in and out. Tensor
        parallel without sequence parallelism: on the group's rows, replicated (from the
        embedding as they are, from an MoE layer gathered), this rank's own handed to its
        MoE layer."""
        tp = self.tp
        if tp is not None and not tp.sequence_parallel:
            x_rep = x_TH if layer == 0 and self.has_embedding else tp.replicate(x_TH)
            return tp.own(self._layers(layer, x_rep))
        return self._layers(layer, x_TH)

    def _layers(self, layer: int, x_TH: torch.Tensor) -> torch.Tensor:
        if layer == 0:
            for att, ffn in self.first_dense:
                x_TH = self._attention_sublayer(x_TH, att)
                x_TH = x_TH + self._sublayer(x_TH, lambda y: self._dense_ffn(y, ffn))
        for j, att in enumerate(self.attention[layer]):
            x_TH = self._attention_sublayer(x_TH, att)
            if j < len(self.ffn[layer]):
                ffn = self.ffn[layer][j]
                x_TH = x_TH + self._sublayer(x_TH, lambda y: self._dense_ffn(y, ffn))
        return x_TH

    def _attention_sublayer(self, x_TH: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """x + attention(norm(x)), the output bias (``transformer.attention_bias = "all"``)
        added once, after tensor parallelism's sum."""
        out = x_TH + self._sublayer(x_TH, lambda y: self.attend(y, w))
        return out + w["bo"] if "bo" in w else out

    def _dense_ffn(self, y: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """A dense FFN, checkpointed under ``mlp``."""
        return self.recompute.run("mlp", self._ffn, y, w)

    def _ffn(self, y: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """A dense FFN: gelu(y W1) W2, or SwiGLU's (silu(y W1) * y W3) W2."""
        if self.swiglu:
            return (F.silu(y @ w["w1"]) * (y @ w["w3"])) @ w["w2"]
        return F.gelu(y @ w["w1"]) @ w["w2"]

    def mtp_block(self, d: int, h_TH: torch.Tensor, tokens_T: torch.Tensor) -> torch.Tensor:
        """MTP module ``d``'s input to its MoE layer (``real.rank.mtp``): the projection of
        [norm(h); norm(embedding of the token d + 1 ahead)] through its attention sublayer."""
        ahead, valid = tokens_ahead(tokens_T, d + 1, self.seq_len)
        e = self.embedding.index_select(0, ahead) * valid[:, None].to(self.embedding.dtype)
        x_TH = torch.cat([rms_norm(h_TH), rms_norm(e)], dim=-1) @ self.mtp[d]["proj"]
        return self._attention_sublayer(x_TH, self.mtp[d]["attention"])

    def mtp_loss(self, d: int, x_TH: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        """MTP module ``d``'s cross entropy, fp32: the head's logits of its output against
        the targets d + 1 positions ahead, the mean over the positions that have them."""
        head = self.embedding.t() if self.head is None else self.head
        ahead, valid = tokens_ahead(targets_T, d + 1, self.seq_len)
        losses = F.cross_entropy((rms_norm(x_TH) @ head).float(), ahead, reduction="none")
        return (losses * valid.float()).sum() / valid.sum()

    def _sublayer(self, x_TH: torch.Tensor, fn) -> torch.Tensor:
        """``fn`` on the normalised input; tensor parallel: on the group's tokens (gathered),
        its partial outputs summed back to this rank's own. The norm is checkpointed without
        its output under ``layernorm`` (module doc)."""
        return self.recompute.run_without_output("layernorm", rms_norm, lambda y: self._on_group(y, fn), x_TH)

    def _on_group(self, y: torch.Tensor, fn) -> torch.Tensor:
        tp = self.tp
        if tp is None:
            return fn(y)
        if not tp.sequence_parallel:  # x_TH holds the group's rows already
            return tp.sum(fn(tp.enter(y)))
        return tp.scatter(fn(tp.gather(y)))

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
