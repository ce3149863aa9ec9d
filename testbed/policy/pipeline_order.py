"""The order of a pipeline stage's forwards and backwards in one step (1F1B, interleaved 1F1B, combined 1F1B):
a policy both backends share. The simulator times these orders (``sim.pipeline.schedule``); the real backend's
pipeline ranks run them (``real.rank.worker``: 1F1B, one chunk a stage).

``p`` stages run ``m`` micro-batches through ``v`` model chunks per stage; model chunk ``g = c * p + s`` (chunk
``c`` of stage ``s``) is the g-th of ``p * v`` consecutive slices of the model. Stage s first runs its warm-up
forwards (Megatron-LM's ``num_warmup_microbatches``: p - s - 1 with one chunk, at most m), then alternates one
forward and one backward (steady 1F1B), then runs the backwards left (cool-down). Micro-batches go in groups of p,
chunk by chunk (the interleaved schedule); with v = 1 that is micro-batch 0, 1, ... in both directions.

Combined 1F1B (``overlap``; Megatron-Core's ``--overlap-moe-expert-parallel-comm``): each steady-state forward and
backward run as one op, an ``OverlappedPair``. Megatron schedules one forward more in the warm-up
(``get_pp_rank_microbatches``: "to ensure the forward and backward computations are independent in all 1f1b
steps"), so a pair never holds a micro-batch's forward and its own backward; with p = 1 that is
``combined_1f1b_schedule_for_no_pipelining``'s order (micro-batch 0's forward alone, then micro-batch i+1's
forward with i's backward, the last backward alone).

Sources: Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters using
Megatron-LM", §2.2; Megatron-LM at d98e8a64ddf34856e74b24714e3bedb2f5a39553: ``core/pipeline_parallel/schedules.py``
(``forward_backward_pipelining_without_interleaving`` and ``..._with_interleaving``: warm-up counts and chunk /
micro-batch order), ``combined_1f1b.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class OverlappedPair(NamedTuple):
    """One steady-state op of combined 1F1B: the forward of (``forward_chunk``, ``forward_micro_batch``) and the
    backward of (``backward_chunk``, ``backward_micro_batch``) run as one, layer by layer (module doc)."""

    forward_chunk: int
    forward_micro_batch: int
    backward_chunk: int
    backward_micro_batch: int


Op = tuple[str, int, int] | OverlappedPair  # an op of a stage's order: ("F" | "B", chunk, micro_batch) or a pair


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _warmup(p: int, m: int, v: int, s: int, overlap: bool = False) -> int:
    """Forwards stage s runs before its first backward (Megatron-LM's ``num_warmup_microbatches``); ``overlap``:
    combined 1F1B's, one more (module doc), after today's ``get_pp_rank_microbatches``, which has no all-warm-up
    case for m == p any longer (dropped in Megatron-LM 4295be1a6c, before combined 1F1B was written)."""
    extra = 1 if overlap else 0
    if v == 1:
        return min(p - s - 1 + extra, m)
    if m == p and not overlap:  # Megatron: as many micro-batches as stages, the whole step is warm-up ("all_warmup")
        return m * v
    return min((p - s - 1) * 2 + (v - 1) * p + extra, m * v)


def _op(kind: str, k: int, p: int, v: int) -> tuple[str, int, int]:
    """The k-th forward / backward op of a stage: micro-batches go in groups of p, chunk by chunk."""
    chunk = (k // p) % v
    micro = (k // (p * v)) * p + k % p
    return kind, (chunk if kind == "F" else v - 1 - chunk), micro


def schedule_order(p: int, m: int, v: int, s: int, overlap: bool = False) -> list[Op]:
    """Stage s's op order as ("F"|"B", chunk, micro_batch): warm-up forwards, 1F1B, remaining backwards; with
    ``overlap`` (combined 1F1B, module doc) one warm-up forward more and each steady-state forward and backward
    one ``OverlappedPair``."""
    p, m, v = _positive_int("p", p), _positive_int("m", m), _positive_int("v", v)
    if not 0 <= s < p:
        raise ValueError(f"s must be in [0, {p}), got {s!r}")
    if v > 1 and m % p:
        raise ValueError(f"interleaving (v={v}) needs micro_batches % stages == 0, got m={m}, p={p}")
    total, warm = m * v, _warmup(p, m, v, s, overlap)
    order: list[Op] = [_op("F", k, p, v) for k in range(warm)]
    for k in range(total - warm):  # steady state: one forward, then one backward
        fwd, bwd = _op("F", warm + k, p, v), _op("B", k, p, v)
        order += [OverlappedPair(fwd[1], fwd[2], bwd[1], bwd[2])] if overlap else [fwd, bwd]
    return order + [_op("B", k, p, v) for k in range(total - warm, total)]
