"""A lower bound of the fullest GPU's memory in a simulated step, in closed form (issue 27: what
``testbed plan`` prunes before it simulates a layout). Bytes throughout.

The simulator's peak (``peak_memory_bytes``: ``sim.step.step_report``'s timeline, a pipeline
rank's from ``sim.pipeline.stage_memory``) holds, at the end of the forward of the last
micro-batch a pipeline rank takes before its first backward, at least:

- what a GPU holds all step (``sim.backend.ClusterSim.memory_at_start``): its routed experts'
  weights (1/etp of each of its E / ep local experts in each MoE layer it holds; none counted
  under paging, whose slots may hold fewer), the other weights it holds (1/tp of attention and
  dense FFNs, the embedding with the first chunk and the head with the loss, the shared
  experts' share, the fp32 routers) and, with the whole transformer's Adam, the optimizer state
  of all of them (``transformer.optimizer_state_bytes`` a parameter), ZeRO-1's shard
  (``transformer.zero_stage`` >= 1): the dense ones over the stage's world / tp GPUs, an
  expert slice over its expert-DP group (stage world / (ep x etp)), as
  ``testbed.model.whole_model.zero_shards`` and the simulator count them;
- the activations of the micro-batches in flight (``in_flight``): rank r of p under 1F1B holds
  min(p - r, m) micro-batches of its layers; with v > 1 interleaved chunks at least
  (v - 1) min(p, m) + 1 chunk-micro-batches (the first micro-batch's forward through its last
  chunk comes after p of each other chunk; Megatron-Core's warm-up holds 2 (p - r - 1) more),
  each counted at its smallest chunk's bytes; under combined 1F1B one fewer (its overlapped pairs
  free a backward's before the forward's are taken), under DualPipe one only (its two
  directions' counts are ``sim.pipeline.dualpipe``'s, not restated here). A
  micro-batch keeps, per layer, ``whole_model.layer_activation_bytes`` (the dense part of a
  layer, with recompute, recompute modules and fp8 inputs as the simulator takes them), and in
  an MoE layer its input (T H in the model dtype) and its expert rows (``expert_row_bytes``,
  none under full recompute). The rows are counted at their fewest: a GPU's T tokens route
  T k slots, at most T to one expert, each expert keeping at most its capacity c
  (``testbed.policy.capacity``'s ``ceil(T k / E x cf)``), so a GPU keeps at least
  k min(T, c) of them (k experts taking T each), and the fullest GPU of an EP group computes
  at least the group's mean: etp k min(T, c) rows (each row computed on every member of its
  ETP group).

Left out, so the figure stays below the peak: gradients (made in the backward, after the
peak), communicators and communication buffers, fp8 weight copies, the logits, the shared
experts' activations, the MTP modules, the routed experts' biases.

A layout whose bound is over the device's memory cannot fit; its ``overflow`` names the part
that overflows: ``weights+optimizer`` where what is held all step does alone, else
``activations``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from testbed.model.fp8_casts import cached_input_bytes
from testbed.model.whole_model import (
    dense_weight_split,
    expert_row_bytes,
    is_ulysses,
    layer_activation_bytes,
    recompute_modules_of,
    recompute_savings,
    shape_of,
    shared_expert_params_per_gpu,
)

WEIGHTS = "weights+optimizer"
ACTIVATIONS = "activations"
#: bytes of a router parameter: the simulator keeps the routers in fp32 (``router_grad_bytes``)
ROUTER_BYTES = 4


@dataclass(frozen=True)
class Chunk:
    """One model chunk's layers (as ``testbed.policy.pipeline_stages.ChunkStage``): dense-first
    layers, MoE blocks, and whether it holds the embedding and the loss (output head)."""

    dense_first: int = 0
    moe: int = 0
    embedding: bool = False
    loss: bool = False


@dataclass(frozen=True)
class MemoryEstimate:
    """The bound on pipeline rank ``rank``'s GPUs (the highest of any rank), by part, bytes."""

    rank: int
    expert_weights: float
    other_weights: float
    optimizer_state: float
    activations: float
    in_flight: int  # chunk-micro-batches counted

    @property
    def held(self) -> float:
        """What a GPU holds all step: weights and optimizer state."""
        return self.expert_weights + self.other_weights + self.optimizer_state

    @property
    def total(self) -> float:
        return self.held + self.activations

    def overflow(self, limit_bytes: float) -> str | None:
        """The part that takes the bound over ``limit_bytes`` (module doc), None when it fits."""
        if self.held > limit_bytes:
            return WEIGHTS
        if self.total > limit_bytes:
            return ACTIVATIONS
        return None

    def to_dict(self) -> dict:
        return {"rank": self.rank, "expert_weights": self.expert_weights, "other_weights": self.other_weights,
                "optimizer_state": self.optimizer_state, "activations": self.activations,
                "in_flight": self.in_flight, "total": self.total}


def even_split(scenario) -> list[list[Chunk]]:
    """Each pipeline rank's chunks under the split without a layout (L / (p v) MoE blocks a
    chunk, the dense-first layers and embedding on the first, the loss on the last);
    ``testbed.policy.pipeline_stages.pipeline_ranks`` gives any other."""
    p, v = scenario.parallelism.pp_size, scenario.parallelism.pp_chunks
    per = scenario.model.num_layers // (p * v)
    ranks = [[Chunk(moe=per) for _ in range(v)] for _ in range(p)]
    ranks[0][0] = replace(ranks[0][0], dense_first=scenario.transformer.first_dense_layers, embedding=True)
    ranks[-1][-1] = replace(ranks[-1][-1], loss=True)
    return ranks


def in_flight(scenario, rank: int) -> int:
    """Chunk-micro-batches pipeline rank ``rank`` holds at least at its first backward (module doc)."""
    p, v = scenario.parallelism.pp_size, scenario.parallelism.pp_chunks
    m = scenario.transformer.micro_batches
    if scenario.parallelism.pipeline_schedule == "dualpipe":
        return 1
    n = min(p - rank, m) if v == 1 else min(m * v, (v - 1) * min(p, m) + 1)
    if scenario.overlap.moe_expert_parallel_comm:  # combined 1F1B: a pair frees before it takes
        n = max(n - 1, 1)
    return max(n, 1)


def kept_rows_lower_bound(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """Fewest expert rows a GPU's ``tokens`` tokens keep (module doc): top_k min(T, capacity)."""
    if capacity_factor == 0:  # dropless
        return tokens * top_k
    # testbed.policy.capacity rounds up (and may pad to the EP size): rounded down here, a bound still
    capacity = max(1, math.floor(tokens * top_k / experts * capacity_factor))
    return top_k * min(tokens, capacity)


def _activation_args(s, tokens: int) -> dict:
    """``layer_activation_bytes``' arguments as ``sim.hardware.dense_layers.DenseLayers`` passes them."""
    p, t, m = s.parallelism, s.transformer, s.model
    local_seq = t.seq_len // p.cp_size
    return {"seq_len": local_seq, "micro_batch": p.tp_size * tokens // local_seq, "tp": p.tp_size,
            "sequence_parallel": p.sequence_parallel or is_ulysses(s), "recompute": t.recompute == "full",
            "flash": True, "recompute_modules": recompute_modules_of(s), "dtype_bytes": m.dtype_bytes,
            "fp8_input_bytes": cached_input_bytes(m.fp8_scaling) if m.gemm_dtype == "fp8" else 0.0}


def _row_bytes(s) -> float:
    """Bytes an expert row keeps on its GPU (1/etp of the expert's inner dimension), as the phase
    builder counts them; none under full recompute."""
    m, t, etp = s.model, s.transformer, s.parallelism.etp_size
    if t.enabled and t.recompute == "full":
        return 0.0
    modules = recompute_modules_of(s)
    fp8 = cached_input_bytes(m.fp8_scaling) if m.gemm_dtype == "fp8" else 0.0
    saved = 0.0
    if modules or fp8:
        shape = shape_of(s)
        if etp > 1:  # a GPU's slice of each routed expert (testbed.policy.expert_tensor_parallel)
            shape = replace(shape, expert_ffn=shape.expert_ffn // etp, shared_ffn=shape.shared_ffn_width)
        saved = recompute_savings(shape, True, modules, t.seq_len, m.dtype_bytes, fp8_input_bytes=fp8).row
    return expert_row_bytes(m.hidden_size, m.ffn_hidden_size // etp, m.ffn_matrices, m.dtype_bytes, saved)


def memory_lower_bound(scenario, ranks=None) -> MemoryEstimate:
    """The bound (module doc) on the fullest GPU of ``scenario``, a resolved scenario (its
    ``workload.tokens_per_rank`` and ``transformer.micro_batches`` derived). ``ranks``: each
    pipeline rank's chunks (objects with ``dense_first``, ``moe``, ``embedding`` and ``loss``,
    as ``testbed.policy.pipeline_stages.pipeline_ranks``' ``RankStages.chunks``, or lists of
    them); default ``even_split``."""
    s, m, t, p = scenario, scenario.model, scenario.transformer, scenario.parallelism
    ranks = [list(getattr(r, "chunks", r)) for r in (ranks if ranks is not None else even_split(s))]
    split = dense_weight_split(s)
    stage_world = s.world_size // p.pp_size
    zero = t.zero_stage >= 1
    dense_shard = stage_world // split if zero else 1
    expert_shard = stage_world // (p.ep_size * p.etp_size) if zero else 1
    state = t.optimizer_state_bytes if t.enabled and t.optimizer == "adam" else 0.0
    tokens = s.workload.tokens_per_rank // t.micro_batches  # a GPU's tokens of one micro-batch
    local = m.num_experts // p.ep_size
    expert_slice = m.expert_params // p.etp_size  # parameters of one GPU's slice of one routed expert
    rows = p.etp_size * kept_rows_lower_bound(tokens, m.top_k, m.num_experts, s.router.capacity_factor)
    moe_layer = tokens * m.hidden_size * m.dtype_bytes + rows * _row_bytes(s)
    shape = shape_of(s) if t.enabled else None
    if shape is not None:
        args = _activation_args(s, tokens)
        dense_layer = layer_activation_bytes(shape, moe=False, **args)
        moe_layer += layer_activation_bytes(shape, moe=True, **args)
        block_params = t.moe_every * shape.attention_params + (t.moe_every - 1) * shape.dense_ffn_params
        first_params = shape.attention_params + shape.dense_ffn_params
        shared = shared_expert_params_per_gpu(s)
    best = None
    for r, chunks in enumerate(ranks):
        moe = sum(c.moe for c in chunks)
        experts = 0.0 if s.pager.enabled else moe * local * expert_slice * m.dtype_bytes
        routers = moe * (m.hidden_size * m.num_experts + m.num_experts)
        other = routers * ROUTER_BYTES
        dense_params = 0.0
        if shape is not None:
            dense_params = sum(c.moe * block_params + c.dense_first * first_params for c in chunks)
            if shape.tied_embeddings:
                dense_params += shape.head_params if any(c.embedding or c.loss for c in chunks) else 0
            else:
                dense_params += sum(shape.input_embedding_params * c.embedding + shape.head_params * c.loss
                                    for c in chunks)
            dense_params /= split  # at least: MLA's down projections are whole on every GPU
            other += (dense_params + moe * shared) * m.dtype_bytes
        optimizer = state * ((dense_params + routers + moe * (shared if shape is not None else 0)) / dense_shard
                             + moe * local * expert_slice / expert_shard) if state else 0.0
        per_chunk = []
        for c in chunks:
            act = c.moe * moe_layer
            if shape is not None:
                act += (c.moe * (t.moe_every - 1) + c.dense_first) * dense_layer
            per_chunk.append(act)
        n = in_flight(s, r)
        acts = n * min(per_chunk) if len(per_chunk) > 1 else n * per_chunk[0]
        est = MemoryEstimate(r, experts, other, optimizer, acts, n)
        if best is None or est.total > best.total:
            best = est
    return best
