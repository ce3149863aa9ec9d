"""Max-plus timing of one pipeline-parallel training step (1F1B and interleaved 1F1B).

``p`` stages (one GPU group each) run ``m`` micro-batches through ``v`` model chunks per stage. Model chunk
``g = c * p + s`` (chunk ``c`` of stage ``s``) is the g-th of ``p * v`` consecutive slices of the model: a
micro-batch's forward goes through g = 0 .. p*v-1, its backward back from p*v-1 to 0. Each stage runs its ops
one at a time in Megatron-LM's order (``schedule_order``); an op starts at max(the stage's previous op end, its
input's arrival). All times are seconds from the step's start; every op's start is a max of sums of durations
(a max-plus system), solved here by walking the stages' orders in dependency order.

Sends: ``send_s[s]`` seconds move one micro-batch's activations (forward) or gradients (backward) across the
boundary between stage s and (s + 1) % p. They are asynchronous for the sender (its next op starts at once),
but each (boundary, direction) is a FIFO channel: a send starts at max(data ready, previous send on it done).
With p = 1 the chunks hand over on the same stage at no cost.

Combined 1F1B (``pair_s``; Megatron-Core's ``--overlap-moe-expert-parallel-comm``): each steady-state forward and
backward run as one op, an ``OverlappedPair`` of ``pair_s[s, forward chunk, backward chunk]`` seconds, which
starts when both inputs are there and hands both outputs on at its end; warm-up and cool-down ops run alone.
Megatron schedules one forward more in the warm-up (``get_pp_rank_microbatches``: "to ensure the forward and
backward computations are independent in all 1f1b steps"), so a pair never holds a micro-batch's forward and its
own backward; with p = 1 that is ``combined_1f1b_schedule_for_no_pipelining``'s order (micro-batch 0's forward
alone, then micro-batch i+1's forward with i's backward, the last backward alone). Megatron-LM at
d98e8a64ddf34856e74b24714e3bedb2f5a39553: ``core/pipeline_parallel/schedules.py``, ``combined_1f1b.py``.
On equal stages with free sends each pair of the last stage, which runs the most (m v - (v-1) p - 1; m - 1 for
p = 1), shortens the step by F + B - pair (tests/sim/pipeline/test_a2a_overlap.py). With v = 1 and p > 1, which
Megatron refuses, a stage's pair k waits for the next stage's pair k-1, which waits for its own pair k-1: the
last stage runs a pair every 2 x pair seconds, never faster than 1F1B's F + B.

Sources: Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters using
Megatron-LM", §2.2 (1F1B, interleaved schedule, bubble (p-1)/(v m) of the ideal time); Megatron-LM's
``core/pipeline_parallel/schedules.py`` (``forward_backward_pipelining_without_interleaving`` and
``..._with_interleaving``: warm-up counts and chunk / micro-batch order).

Left out: contention between different boundaries or directions (only the FIFO per channel), overlap of a
stage's compute with itself (one op at a time), optimizer step, gradient all-reduce, recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from testbed.policy.pipeline_order import Op, OverlappedPair, schedule_order

F, B = 0, 1  # kind index into start / end


@dataclass(frozen=True)
class PipelineSchedule:
    """One step's timing. ``start`` / ``end`` [s, kind (0=F, 1=B), c, i] are seconds from the step's start;
    ``busy_s[s]`` the stage's compute seconds; ``bubble_fraction[s] = 1 - busy_s[s] / makespan_s``;
    ``in_flight[s]`` the most (chunk, micro-batch) forwards done whose backward has not started (activations
    held); ``sends`` (s_from, s_to, "F"|"B", micro_batch, start_s, end_s) in the order they were issued."""

    stages: int
    micro_batches: int
    chunks: int
    start: np.ndarray
    end: np.ndarray
    makespan_s: float
    busy_s: np.ndarray
    bubble_fraction: np.ndarray
    in_flight: np.ndarray
    sends: list[tuple[int, int, str, int, float, float]]
    orders: list[list[Op]]
    pairs: np.ndarray


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def seconds_array(name: str, value: object, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` as a float array of ``shape`` with finite, non-negative seconds."""
    arr = np.asarray(value, dtype=float)
    if arr.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(arr.shape)}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must hold finite non-negative seconds, got {arr.tolist()}")
    return arr


def _max_in_flight(order: list[Op]) -> int:
    """Most forwards done and backwards not started at once; ops are serial so a prefix count is exact (a pair
    frees its backward's micro-batch as it takes its forward's: the two walk the layers in opposite order)."""
    held = most = 0
    for op in order:
        if not isinstance(op, OverlappedPair):
            held += 1 if op[0] == "F" else -1
        most = max(most, held)
    return most


def run_pipeline(forward_s, backward_s, send_s, micro_batches: int, chunks: int = 1,
                 pair_s=None) -> PipelineSchedule:
    """Time one step: ``forward_s`` / ``backward_s`` [p, chunks] seconds per micro-batch and chunk,
    ``send_s`` [p] seconds per micro-batch across boundary s -> (s + 1) % p; p from ``forward_s``.
    ``pair_s`` [p, chunks, chunks]: combined 1F1B (module doc), seconds of an ``OverlappedPair`` on stage s
    by (forward chunk, backward chunk); None: plain (interleaved) 1F1B."""
    m, v = _positive_int("micro_batches", micro_batches), _positive_int("chunks", chunks)
    shape = np.shape(forward_s)
    if len(shape) != 2 or shape[0] < 1:
        raise ValueError(f"forward_s must have shape [stages, chunks={v}], got {list(shape)}")
    p = shape[0]
    dur = np.stack([seconds_array("forward_s", forward_s, (p, v)), seconds_array("backward_s", backward_s, (p, v))], axis=1)
    send = seconds_array("send_s", send_s, (p,))
    pair = None if pair_s is None else seconds_array("pair_s", pair_s, (p, v, v))
    if v > 1 and m % p:
        raise ValueError(f"interleaving (chunks={v}) needs micro_batches % stages == 0, got "
                         f"micro_batches={m}, stages={p}")
    orders = [schedule_order(p, m, v, s, overlap=pair is not None) for s in range(p)]
    start, end = np.full((p, 2, v, m), np.nan), np.full((p, 2, v, m), np.nan)
    arrive = np.full((2, p * v, m), np.nan)  # when op (kind, g, i)'s output is at its consumer's stage
    channel_free: dict[tuple[int, int], float] = {}  # (boundary, kind) -> when its last send ends
    sends: list[tuple[int, int, str, int, float, float]] = []
    saved = np.zeros(p)  # seconds each stage's pairs take less than their two ops one after the other
    ptr, free = [0] * p, [0.0] * p
    while any(ptr[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                op = orders[s][ptr[s]]
                if isinstance(op, OverlappedPair):
                    halves = ((F, op.forward_chunk, op.forward_micro_batch),
                              (B, op.backward_chunk, op.backward_micro_batch))
                    seconds = pair[s, op.forward_chunk, op.backward_chunk]
                else:
                    halves = (((F if op[0] == "F" else B), op[1], op[2]),)
                    seconds = dur[s, halves[0][0], halves[0][1]]
                inputs = [_input_ready(arrive, kind, c * p + s, i, p * v) for kind, c, i in halves]
                if any(np.isnan(x) for x in inputs):
                    break  # input not produced yet: let the other stages catch up
                t0 = max(free[s], *inputs)
                free[s] = t1 = t0 + seconds
                if len(halves) == 2:
                    saved[s] += dur[s, F, op.forward_chunk] + dur[s, B, op.backward_chunk] - seconds
                for kind, c, i in halves:  # a pair hands on its forward's output, then its backward's
                    start[s, kind, c, i], end[s, kind, c, i] = t0, t1
                    _deliver(arrive, channel_free, sends, send, kind, c * p + s, i, s, p, v, t1)
                ptr[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks at ops {[o[q] for o, q in zip(orders, ptr) if q < len(o)]}")
    return _result(p, m, v, start, end, dur, sends, orders, saved)


def _input_ready(arrive: np.ndarray, kind: int, g: int, i: int, n: int) -> float:
    """When op (kind, g, i)'s input is on its stage (NaN: not produced yet)."""
    if kind == F:
        return 0.0 if g == 0 else arrive[F, g - 1, i]
    return arrive[F, g, i] if g == n - 1 else arrive[B, g + 1, i]  # last chunk's backward follows the loss


def _deliver(arrive, channel_free, sends, send, kind, g, i, s, p, v, t_done) -> None:
    """Record when op (kind, g, i), done at ``t_done`` on stage s, has its output at the consumer."""
    if (kind == F and g == p * v - 1) or p == 1:
        if not (kind == B and g == 0):
            arrive[kind, g, i] = t_done  # same stage: the loss, or the next chunk with p = 1
        return
    if kind == B and g == 0:
        return  # the model's first slice: its input gradient goes nowhere
    boundary, dest = (s, (s + 1) % p) if kind == F else ((s - 1) % p, (s - 1) % p)
    t0 = max(t_done, channel_free.get((boundary, kind), 0.0))  # FIFO: wait for the channel's previous send
    t1 = t0 + send[boundary]
    channel_free[(boundary, kind)] = t1
    arrive[kind, g, i] = t1
    sends.append((s, dest, "FB"[kind], i, t0, t1))


def _result(p, m, v, start, end, dur, sends, orders, saved) -> PipelineSchedule:
    makespan = float(np.max(end))
    busy = m * dur.sum(axis=(1, 2)) - saved  # every (kind, chunk) op runs once per micro-batch, a pair's in less
    # busy and the makespan are sums of the same seconds in other orders: a stage never busy for longer,
    # and a share below 1e-12 is that rounding (a lone stage's), not a bubble
    bubble = np.maximum(1.0 - busy / makespan, 0.0) if makespan > 0 else np.zeros(p)
    bubble = np.where(bubble < 1e-12, 0.0, bubble)
    in_flight = np.array([_max_in_flight(o) for o in orders])
    pairs = np.array([sum(isinstance(op, OverlappedPair) for op in o) for o in orders])
    for arr in (start, end, busy, bubble, in_flight, pairs):
        arr.flags.writeable = False
    return PipelineSchedule(p, m, v, start, end, makespan, busy, bubble, in_flight, sends, orders, pairs)
