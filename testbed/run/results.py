"""One results schema for both backends: per-step records and the run summary.

Units: seconds (``*_s``), bytes (``*_bytes`` and ``bytes_by_*``). ``bytes_by_stage`` and
``bytes_by_level`` count the payload bytes of every collective as the standard
algorithm sends them (``testbed.policy.collectives``: each rank-to-rank transfer once, at the
level it crosses) and every host<->device page copy, summed over all ranks.
``wire_bytes_by_level`` is what the fabric's links carried: bytes summed over every
directed link of a level (a transfer between two nodes of a leaf crosses two NIC links),
by the algorithm the library really runs, protocol headers and acknowledgements
included; the real backend reads it from the kernel's counters of an emulated cluster,
the simulator from its network model (None where neither applies). ``dropped_token_fraction`` is
the fraction of routed (token, expert) slots dropped by capacity (M2).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from testbed.core.stages import STAGES
from testbed.model.megatron_flops import megatron_flops, padded_vocab_size
from testbed.model.published_conversion import tflops_per_gpu_from_flops
from testbed.model.whole_model import mfu, moe_stack_step_flops, shape_of
from testbed.scenario.topology import LEVELS


@dataclass
class StepRecord:
    """What one training step did (all ranks together)."""

    step: int
    step_time_s: float
    stage_time_s: dict[str, float]  # mean over ranks of the time each rank spent in the stage
    bytes_by_stage: dict[str, int]
    bytes_by_level: dict[str, int]
    peak_memory_bytes: int  # largest over ranks
    routed_slots: int
    dropped_slots: int
    page_moves: int  # rows of page moves that carried bytes or freed a slot
    page_bytes: int  # bytes of page copies host<->device
    page_stall_s: float  # mean over ranks of compute time spent waiting for pages
    cache_hits: int
    cache_lookups: int
    loss: float | None = None
    aux_loss: float | None = None
    expert_states: dict[str, int] | None = None  # hot / warm / cold counts after a heat update
    moves_by_reason: dict[str, int] | None = None  # page-move rows per reason (testbed.policy.page_moves.REASONS), all ranks
    frozen_fraction: float | None = None  # after a heat update: share of all ranks' local experts frozen (M13, M19)
    wire_bytes_by_level: dict[str, int] | None = None  # nvlink, leaf, spine (see module doc)
    fitted_share: float | None = None  # simulator: fraction of the step's time from fitted constants
    # M10: seconds of the step's active-group discovery (the all-gather of every rank's kept-expert
    # bit masks): the simulated op's time, or on real ranks the slowest rank's time issuing and
    # waiting for it; None where no discovery runs (one replica)
    discovery_s: float | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StepRecord":
        return cls(**data)


def summarize(records: list[StepRecord], warmup_steps: int, **fields) -> dict:
    """The run summary: medians of times and means of bytes over the measured steps.

    ``fields`` (backend, run_dir, ...) are copied in first. Steps before
    ``warmup_steps`` are left out, except for the memory peak (the peak of the run).
    """
    measured = [r for r in records if r.step >= warmup_steps] or records
    n = len(measured)
    routed = sum(r.routed_slots for r in measured)
    lookups = sum(r.cache_lookups for r in measured)
    losses = [r.loss for r in records if r.loss is not None]
    out = dict(fields)
    out.update({
        "steps": len(records),
        "measured_steps": n,
        "step_time_s": statistics.median(r.step_time_s for r in measured) if n else None,
        "stage_time_s": {s: statistics.median(r.stage_time_s.get(s, 0.0) for r in measured) for s in STAGES} if n else {},
        "bytes_by_stage": {s: sum(r.bytes_by_stage.get(s, 0) for r in measured) / n for s in STAGES} if n else {},
        "bytes_by_level": {lv: sum(r.bytes_by_level.get(lv, 0) for r in measured) / n for lv in LEVELS} if n else {},
        "peak_memory_bytes": max((r.peak_memory_bytes for r in records), default=0),
        "dropped_token_fraction": (sum(r.dropped_slots for r in measured) / routed) if routed else 0.0,
        "page_moves_per_step": sum(r.page_moves for r in measured) / n if n else 0.0,
        "page_stall_s": statistics.median(r.page_stall_s for r in measured) if n else 0.0,
        # whole run, warm-up included: the events a heat or paging sweep must see fire
        "moves_by_reason": sum_counts([r.moves_by_reason for r in records]),
        "heat_updates": sum(1 for r in records if r.expert_states is not None),
        "max_frozen_fraction": max((r.frozen_fraction for r in records if r.frozen_fraction is not None),
                                   default=0.0),
        "group_cache_hit_rate": (sum(r.cache_hits for r in measured) / lookups) if lookups else None,
        "wire_bytes_by_level": _mean_levels([r.wire_bytes_by_level for r in measured]),
        "fitted_share": statistics.median(f) if (f := [r.fitted_share for r in measured if r.fitted_share is not None]) else None,
        "discovery_s": statistics.median(d) if (d := [r.discovery_s for r in measured if r.discovery_s is not None]) else None,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
    })
    return out


def throughput(scenario, records: list[StepRecord], step_time_s: float | None, peak_flops: float | None) -> dict:
    """Tokens per second per GPU and MFU of a run (``testbed.model.whole_model``): the model
    FLOPs of a step - the whole transformer's (``transformer.enabled``), else a mean
    measured step of the MoE stack's kept slots - over its median step time x GPUs x
    ``peak_flops`` (one GPU's, for the model's dtype; None: no MFU).

    With the whole transformer, also Megatron-LM's figures in the unit papers publish
    (issue 26, item 3): ``megatron_flops_per_step``, ``testbed.model.megatron_flops`` of
    the step's tokens in sequences of ``transformer.seq_len``, the vocabulary padded to
    128 x ``tp_size`` as Megatron pads it, and ``megatron_tflops_per_gpu``, those FLOPs /
    (step time x 1e12 x GPUs) (``testbed.model.published_conversion``). The two counts
    differ: both take 3 x the forward without recompute and half of a causal sequence's
    scores, but Megatron leaves out the routers' (2 H E a token and MoE layer) and the
    shared-expert gates' GEMMs, counts a sliding-window layer as attending the whole
    sequence (the testbed its band), pads the vocabulary and adds 3 H for each MTP
    module's norms. ``mfu`` stays against the profile's ``compute.peak_tflops``, the
    *measured* matmul ceiling (771.18 TFLOP/s on the h100, h800 and h200 profiles), not
    the spec peak (989.5) published MFU divides by: no MFU in Megatron's count is given
    here, as no profile holds a spec peak; a caller states its denominator
    (``published_conversion.mfu_from_tflops``). The MoE stack alone has no Megatron count."""
    s, m = scenario, scenario.model
    measured = [r for r in records if r.step >= s.run.warmup_steps] or records
    if not measured or not step_time_s:
        return {"tokens_per_s_per_gpu": None, "model_flops_per_step": None, "flops_of": None, "mfu": None,
                "megatron_flops_per_step": None, "megatron_tflops_per_gpu": None}
    # tokens of a step: every GPU of a pipeline stage brings its own (all of them without pipelining)
    tokens = s.world_size // s.parallelism.pp_size * s.workload.tokens_per_rank
    megatron = None
    if s.transformer.enabled:  # the whole model's FLOPs, every token through its top-k experts (no recompute)
        shape, seq_len = shape_of(s), s.transformer.seq_len
        flops = shape.step_flops(tokens, seq_len)
        vocab = padded_vocab_size(shape.vocab, s.parallelism.tp_size)
        megatron = megatron_flops(shape, tokens / seq_len, seq_len, vocab)  # tokens / seq_len sequences
    else:
        kept = sum(r.routed_slots - r.dropped_slots for r in measured) / len(measured)
        flops = moe_stack_step_flops(m.hidden_size, m.ffn_hidden_size, m.num_experts, m.num_layers, tokens, kept)
    return {"tokens_per_s_per_gpu": tokens / s.world_size / step_time_s,
            "model_flops_per_step": flops, "flops_of": "whole model" if s.transformer.enabled else "MoE stack",
            "mfu": mfu(flops, step_time_s, s.world_size, peak_flops) if peak_flops else None,
            "megatron_flops_per_step": megatron,
            "megatron_tflops_per_gpu": (tflops_per_gpu_from_flops(megatron, step_time_s, s.world_size)
                                        if megatron is not None else None)}


def frozen_fraction(frozen: dict[int, int] | None, local_experts: int) -> float | None:
    """Frozen local experts summed over ranks (``StepEnd.frozen``) over all ranks' local
    experts (``local_experts``), or None without a heat update."""
    return None if frozen is None else sum(frozen.values()) / max(1, local_experts)


def sum_counts(rows: list[dict | None]) -> dict[str, int] | None:
    """Counts summed over steps, or None when no step has them."""
    rows = [r for r in rows if r is not None]
    if not rows:
        return None
    out: dict[str, int] = {}
    for r in rows:
        for k, v in r.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def _mean_levels(rows: list[dict | None]) -> dict[str, float] | None:
    """Mean per level over steps, or None when no step has the figure."""
    rows = [r for r in rows if r is not None]
    if not rows:
        return None
    return {lv: sum(r.get(lv, 0) for r in rows) / len(rows) for lv in rows[0]}
