"""The collectives of the whole transformer's tensor parallelism (``parallelism.tp_size``
t > 1, issue 13), which both backends run and the simulator times; the real backend's
implementation is ``real.comm.tensor_parallel``.

A tensor-parallel group is t consecutive GPUs of a node; each holds 1/t of every
attention's heads, every dense FFN's columns and the vocabulary (Shoeybi et al. 2019,
"Megatron-LM", §3). Every GPU brings its own T tokens (rows of H values, ``rows`` bytes),
and each MoE layer routes a GPU's own tokens. Between them:

- with sequence parallelism (``parallelism.sequence_parallel``, Korthikanti et al. 2022,
  §4.2.2) each GPU keeps only its own rows: each attention and dense FFN all-gathers the
  group's rows before it and reduce-scatters its partial outputs after it (backward: the
  other way round);
- without it the group's t T rows are replicated on every member inside the blocks: each
  attention and dense FFN all-reduces its partial outputs (forward) and its input's
  gradient (backward); an MoE layer's output is all-gathered into the replicated rows
  (after it) and its input's gradient too (in the backward). The same bytes per
  sublayer as the pair above (a ring all-reduce is a reduce-scatter and an all-gather),
  plus the MoE layers' gathers, and every member holds the group's activations.

The vocabulary-split embedding all-gathers the group's token ids and targets (int64) and
sums the partial lookups (reduce-scatter, or all-reduce into replicated rows); the output
head computes the logits of its vocabulary shard on the group's rows (all-gathered first
with sequence parallelism) and assembles the cross entropy from three all-reduces of one
fp32 per token of the group (largest logit, sum of exponentials, target logit).

The models' features, as Megatron-Core splits them (NVIDIA/Megatron-LM @ d98e8a64,
``megatron/core/transformer/``): the dense-first layers (``transformer.first_dense_layers``)
are dense layers of MoE layer 0's block, each an attention and a dense FFN with their
collectives; the shared experts (``model.shared_experts``, ``moe/shared_experts.py``) a
dense FFN on the MoE layer's input (``shared_expert_parts``); MLA
(``multi_latent_attention.py``) splits its up and output projections by heads, its down
projections run whole (``parallel_mode = "duplicated"``) on each GPU's own rows, so with
sequence parallelism its attention gathers the latents its up projections take (the query's
r_q, the key-value r_kv) and the RoPE key (d_rope) rather than the rows; their gradients are
summed over the group after the backward (``Planner.dense_sync_ops``); an MTP module
(``multi_token_prediction.py``) is its embedding, its projection and one layer
(``mtp_parts``), and the shared head runs once more per module.

Under Ulysses attention (``parallelism.attention_parallel = "ulysses"``) the group holds every
weight whole and each GPU its own rows: the only collectives of the dense work are the
attentions' all-to-alls (``testbed.policy.ulysses.UlyssesOps``); the embedding, the head, the
dense FFNs, the shared experts and the MTP projections run on each GPU's own rows with none.
"""

from __future__ import annotations

from testbed.model.mtp_layers import mtp_modules
from testbed.model.whole_model import is_ulysses, shape_of
from testbed.policy.collectives import CollectiveOp
from testbed.policy.ulysses import UlyssesOps
from testbed.scenario.scenario import Scenario


class TensorParallelOps:
    """Lists of concurrent ops (one per group), in the order they run, per piece of work."""

    def __init__(self, scenario: Scenario, groups: list[tuple[int, ...]]):
        self.s, self.groups = scenario, groups
        p, m = scenario.parallelism, scenario.model
        self.on = p.tp_size > 1 and scenario.transformer.enabled
        #: Ulysses attention (module doc): its all-to-alls instead of every op below
        self.ulysses = UlyssesOps(scenario, groups) if self.on and is_ulysses(scenario) else None
        self.tp, self.sp = p.tp_size, p.sequence_parallel
        self.tokens = scenario.workload.tokens_per_rank
        self.rows = self.tokens * m.hidden_size * m.dtype_bytes  # one GPU's own rows, bytes
        #: L: the model's MoE layers; the controller's layers L .. L + D - 1 are the MTP modules'
        self.model_layers = m.num_layers - mtp_modules(scenario)
        #: values per token an attention all-gathers with sequence parallelism: the rows (H), or
        #: MLA's (its down projections run whole on each GPU's own rows, module doc): the query's
        #: latent (H without one), the key-value latent and the shared RoPE key
        shape = shape_of(scenario) if self.on else None
        if shape is not None and shape.attention == "mla":
            self._gathered_width = [shape.q_lora_rank or m.hidden_size, shape.kv_lora_rank, shape.qk_rope_head_dim]
        else:
            self._gathered_width = [m.hidden_size]

    def dense(self, layer: int, backward: bool) -> list[list[CollectiveOp]]:
        """Every collective of MoE layer ``layer``'s dense work: its block's, with layer 0
        the embedding's and with the last layer the output head's (forward: the
        embedding's first, the head's last; backward the other way round); under Ulysses
        only its attentions' all-to-alls."""
        if self.ulysses is not None:
            return self.ulysses.block(layer, backward)
        out = self.block(layer, backward)
        if layer == 0:
            out = out + self.embedding(backward) if backward else self.embedding(backward) + out
        if layer == self.s.model.num_layers - 1:
            out = self.head(backward) + out if backward else out + self.head(backward)
        return out

    def block(self, layer: int, backward: bool) -> list[list[CollectiveOp]]:
        """MoE layer ``layer``'s attentions and the dense FFNs before it (module doc), with
        layer 0 the dense-first layers' (before them), with an MTP module's MoE layer its
        embedding, projection and attention instead (``mtp_parts``), and the MoE layer's
        shared experts' (after them; backward first); without sequence parallelism also the
        gathers of the MoE layer before it (whose output enters the block replicated) and,
        backward, of this one's input gradient."""
        if not self.on:
            return []
        t = self.s.transformer
        parts = []
        if backward:
            parts += self.shared_expert_parts(backward)
        if not self.sp and (backward or layer > 0):  # the MoE layer's rows into the replicated ones
            parts.append(("all_gather", self.rows, "MoE rows"))
        first = [("dense-first attention", i) for i in range(t.first_dense_layers)] if layer == 0 else []
        first = [p for name, i in first for p in ((name, i), ("dense-first FFN", i))]
        mtp = layer >= self.model_layers  # MTP module layer - L's block (testbed.model.mtp_layers)
        if mtp:
            sublayers = [("MTP attention", layer - self.model_layers)]
        else:
            sublayers = [(part, k) for k, part in enumerate(["attention"] * t.moe_every
                                                           + ["dense FFN"] * (t.moe_every - 1))]
        if mtp and not backward:
            parts += self.mtp_parts(backward)
        for part, k in (sublayers + first if backward else first + sublayers):
            parts += self.sublayer_parts(part, k, backward)
        if mtp and backward:
            parts += self.mtp_parts(backward)
        if not backward:
            parts += self.shared_expert_parts(backward)
        return self._batches(parts, layer, backward)

    def sublayer_parts(self, part: str, k: int, backward: bool) -> list[tuple[str, int, str]]:
        """One attention's or dense FFN's collectives (module doc); MLA's attention with
        sequence parallelism gathers its latents rather than the rows (``_gathered_width``)."""
        width = self._gathered_width if "attention" in part else [self.s.model.hidden_size]
        if self.sp:
            pair = [("all_gather", self.tokens * w * self.s.model.dtype_bytes) for w in width]
            pair.append(("reduce_scatter", self.tp * self.rows))
            return [(kind, size, f"{part} {k}") for kind, size in (reversed(pair) if backward else pair)]
        return [("all_reduce", self.tp * self.rows, f"{part} {k}")]

    def shared_expert_parts(self, backward: bool) -> list[tuple[str, int, str]]:
        """The shared experts of an MoE layer (``model.shared_experts``): Megatron-Core's
        SharedExpertMLP, an MLP split as a dense FFN (column-parallel fc1, row-parallel fc2;
        ``megatron/core/transformer/moe/shared_experts.py``) on the group's rows: with
        sequence parallelism the layer's input all-gathered before (its fc1's, or with the
        shared-expert overlap ``pre_forward_comm``'s) and the output reduce-scattered after
        (fc2's, or ``post_forward_comm``'s); without it the output all-reduced. Their gate
        (H x 1) runs on each GPU's own rows, whole."""
        if not self.s.model.shared_experts:
            return []
        return self.sublayer_parts("shared experts", 0, backward)

    def mtp_parts(self, backward: bool) -> list[tuple[str, int, str]]:
        """An MTP module's embedding and projection (DeepSeek-V3 §2.2; Megatron-Core's
        ``multi_token_prediction.py``): the vocabulary-split embedding's partial lookups
        summed as the model's (its token ids are the group's, gathered at the model's
        embedding); the projection ``eh_proj`` a column-parallel 2H x H whose output is
        all-gathered along H (``gather_from_tensor_model_parallel_region``, each GPU's
        1/t of H on the group's rows: ``rows`` bytes) and, with sequence parallelism, its
        input (2H per token) all-gathered before, its output scattered back to each GPU's
        rows (no bytes). Backward: the scatter's gather (sequence parallel), the projection
        input's gradient reduce-scattered (or all-reduced), the embedding's gradient
        gathered as the model's (sequence parallel)."""
        r, tp = self.rows, self.tp
        if backward:
            if self.sp:
                return [("all_gather", r, "MTP projection"), ("reduce_scatter", tp * 2 * r, "MTP projection"),
                        ("all_gather", r, "MTP embedding")]
            return [("all_reduce", tp * 2 * r, "MTP projection")]
        embed = ("reduce_scatter" if self.sp else "all_reduce", tp * r, "MTP embedding")
        gathers = [("all_gather", 2 * r, "MTP projection")] if self.sp else []
        return [embed] + gathers + [("all_gather", r, "MTP projection")]

    def embedding(self, backward: bool) -> list[list[CollectiveOp]]:
        """Forward: the group's token ids and targets gathered, the partial lookups summed;
        backward (sequence parallel): the gradients of each GPU's rows gathered."""
        if not self.on:
            return []
        if backward:
            parts = [("all_gather", self.rows, "embedding")] if self.sp else []
        else:
            sums = ("reduce_scatter", self.tp * self.rows) if self.sp else ("all_reduce", self.tp * self.rows)
            parts = [("all_gather", self.tokens * 2 * 8, "embedding"), sums + ("embedding",)]
        return self._batches(parts, 0, backward)

    def head(self, backward: bool) -> list[list[CollectiveOp]]:
        """Forward: the last MoE layer's rows gathered, then the cross entropy's three
        all-reduces; backward: the gathered rows' gradient summed (reduce-scattered to
        each GPU's rows, or all-reduced into the replicated ones)."""
        if not self.on:
            return []
        if backward:
            parts = [("reduce_scatter" if self.sp else "all_reduce", self.tp * self.rows, "output head")]
        else:
            parts = [("all_gather", self.rows, "output head")] + [("all_reduce", self.tp * self.tokens * 4,
                                                                   "output head")] * 3
        parts = parts * (1 + mtp_modules(self.s))  # the shared head once more per MTP module
        return self._batches(parts, self.s.model.num_layers - 1, backward)

    def _batches(self, parts, layer: int, backward: bool) -> list[list[CollectiveOp]]:
        stage = "dense_backward" if backward else "dense"
        return [[CollectiveOp(kind, g, stage, layer, size=size, batch=k, label=f"tensor parallel, {what}")
                 for g in self.groups] for k, (kind, size, what) in enumerate(parts)]
