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
"""

from __future__ import annotations

from testbed.policy.collectives import CollectiveOp
from testbed.scenario.scenario import Scenario


class TensorParallelOps:
    """Lists of concurrent ops (one per group), in the order they run, per piece of work."""

    def __init__(self, scenario: Scenario, groups: list[tuple[int, ...]]):
        self.s, self.groups = scenario, groups
        p, m = scenario.parallelism, scenario.model
        self.on = p.tp_size > 1 and scenario.transformer.enabled
        self.tp, self.sp = p.tp_size, p.sequence_parallel
        self.tokens = scenario.workload.tokens_per_rank
        self.rows = self.tokens * m.hidden_size * m.dtype_bytes  # one GPU's own rows, bytes

    def dense(self, layer: int, backward: bool) -> list[list[CollectiveOp]]:
        """Every collective of MoE layer ``layer``'s dense work: its block's, with layer 0
        the embedding's and with the last layer the output head's (forward: the
        embedding's first, the head's last; backward the other way round)."""
        out = self.block(layer, backward)
        if layer == 0:
            out = out + self.embedding(backward) if backward else self.embedding(backward) + out
        if layer == self.s.model.num_layers - 1:
            out = self.head(backward) + out if backward else out + self.head(backward)
        return out

    def block(self, layer: int, backward: bool) -> list[list[CollectiveOp]]:
        """MoE layer ``layer``'s attentions and the dense FFNs before it (module doc);
        without sequence parallelism also the gathers of the MoE layer before it (whose
        output enters the block replicated) and, backward, of this one's input gradient."""
        if not self.on:
            return []
        t = self.s.transformer
        parts = []
        if not self.sp and (backward or layer > 0):  # the MoE layer's rows into the replicated ones
            parts.append(("all_gather", self.rows, "MoE rows"))
        for k, part in enumerate(["attention"] * t.moe_every + ["dense FFN"] * (t.moe_every - 1)):
            if self.sp:
                pair = [("all_gather", self.rows), ("reduce_scatter", self.tp * self.rows)]
                parts += [(kind, size, f"{part} {k}") for kind, size in (reversed(pair) if backward else pair)]
            else:
                parts.append(("all_reduce", self.tp * self.rows, f"{part} {k}"))
        return self._batches(parts, layer, backward)

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
        return self._batches(parts, self.s.model.num_layers - 1, backward)

    def _batches(self, parts, layer: int, backward: bool) -> list[list[CollectiveOp]]:
        stage = "dense_backward" if backward else "dense"
        return [[CollectiveOp(kind, g, stage, layer, size=size, batch=k, label=f"tensor parallel, {what}")
                 for g in self.groups] for k, (kind, size, what) in enumerate(parts)]
