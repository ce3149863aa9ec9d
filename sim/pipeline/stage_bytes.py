"""The bytes a pipeline rank moves in a step, from its simulated stage (``sim.pipeline.run``).

A simulated stage is one micro-batch of a stage scenario: what its micro-batch stages
(``MICRO_BATCH_STAGES``) move counts m times, what runs once a step (the gradient sync, the
heat all-reduce) once. A replayed trace's stage (``SimulatedStage.micro_batches_counted``,
``sim.backend.trace_routing``) decided every micro-batch from its own counts and counted
each one's bytes already: they count once.

The dense gradient sync of a stage scenario carries the input embedding's gradient with its
first MoE layer's bucket and the output head's with its last's (``testbed.model.whole_model.block_grad_bytes``,
as every simulated stage has both), but a pipeline rank sums only the weights it holds: the
embedding on the first stage, the head on the last (a real pipeline rank all-reduces its own
weights' gradients in the planner's buckets, ``real.comm.gradient_sync``). The sync ops of the
buckets that carry a weight the rank does not hold are counted at their size less that weight's
gradient (``held_sync_ops``): exactly, for the all-reduces; with the distributed optimizer the
reduce-scatter's and parameter all-gather's shards are re-rounded from the padded sizes, within
a byte a member of the exact ones. The simulated stage's timing keeps the full buckets.
"""

from __future__ import annotations

import dataclasses

from sim.pipeline.stage_work import MICRO_BATCH_STAGES, SimulatedStage
from testbed.model.whole_model import dense_weight_split
from testbed.policy.collectives import ByteLedger, CollectiveOp
from testbed.policy.distributed_optimizer import reduced_bytes
from testbed.policy.pipeline_stages import RankStages
from testbed.policy.planner import Planner


def unheld_weight_bytes(x: SimulatedStage, rank: RankStages) -> dict[int, int]:
    """{layer of the stage scenario: bytes in ``model.dtype`` of the embedding or head weights
    its dense-sync bucket carries that pipeline rank ``rank`` does not hold} (module doc). A tied
    embedding is layer 0's alone and held by the ranks with the embedding or the loss."""
    s = x.builder.s
    t = s.transformer
    if not t.enabled:
        return {}
    embedding = t.vocab_size * s.model.hidden_size * s.model.dtype_bytes
    out: dict[int, int] = {}
    if t.tied_embeddings:
        if not (rank.embedding or rank.loss):
            out[0] = embedding
        return out
    if not rank.embedding:
        out[0] = embedding
    if not rank.loss:
        last = s.model.num_layers - 1
        out[last] = out.get(last, 0) + embedding
    return out


def held_sync_ops(x: SimulatedStage, rank: RankStages) -> list[tuple[CollectiveOp, CollectiveOp]]:
    """(the simulated stage's dense-sync op, the same op for pipeline rank ``rank``'s weights) of
    every op that carries a weight the rank does not hold (module doc)."""
    unheld = unheld_weight_bytes(x, rank)
    if not unheld:
        return []
    s = x.builder.s
    split = dense_weight_split(s)
    out = []
    for ph in x.phases:
        for op in ph.ops or ():
            if op.stage != "dense_sync" or "dense gradients" not in op.label:
                continue
            removed = sum(unheld.get(layer, 0) for layer in Planner.bucket_layers(op)) // split
            if not removed:
                continue
            p = len(op.members)
            if op.kind == "all_reduce":
                size = op.size - reduced_bytes(s, removed)
            elif op.kind == "reduce_scatter":  # padded to equal shards
                size = -(-(op.size - reduced_bytes(s, removed)) // p) * p
            else:  # the distributed optimizer's all-gather of a member's shard of the updated parameters
                size = -(-(op.size * p - removed) // p)
            out.append((op, dataclasses.replace(op, size=max(size, 0))))
    return out


def rank_bytes(x: SimulatedStage, rank: RankStages, micro_batches: int, rs_as_ar: bool) -> tuple[dict, dict]:
    """(bytes by stage, bytes by link level) pipeline rank ``rank`` moves in the step from its
    simulated stage ``x``: its micro-batch stages' ``micro_batches`` times (once when ``x``
    counted every micro-batch), the rest once, the dense sync of the weights it holds (module
    doc). ``rs_as_ar``: reduce-scatters counted as the library runs them (gloo: all-reduces)."""
    m = 1 if x.micro_batches_counted else micro_batches
    by_stage = {k: v * (m if k in MICRO_BATCH_STAGES else 1) for k, v in x.record.bytes_by_stage.items()}
    once = ByteLedger(x.layout, None, rs_as_ar)
    for ph in x.phases:
        if ph.kind == "ops" and ph.stage not in MICRO_BATCH_STAGES:
            for op in ph.ops:
                once.add_op(op)
    once_levels = once.level_dict()
    by_level = {lvl: once_levels.get(lvl, 0) + m * (b - once_levels.get(lvl, 0))
                for lvl, b in x.record.bytes_by_level.items()}
    full, held = ByteLedger(x.layout, None, rs_as_ar), ByteLedger(x.layout, None, rs_as_ar)
    for op, mine in held_sync_ops(x, rank):
        full.add_op(op)
        held.add_op(mine)
    for k, v in full.by_stage.items():
        by_stage[k] -= v - held.by_stage.get(k, 0)
    held_levels = held.level_dict()
    for lvl, v in full.level_dict().items():
        by_level[lvl] = by_level.get(lvl, 0) - (v - held_levels.get(lvl, 0))
    return by_stage, by_level
