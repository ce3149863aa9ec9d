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
    orders: list[list[tuple[str, int, int]]]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _seconds(name: str, value: object, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` as a float array of ``shape`` with finite, non-negative seconds."""
    arr = np.asarray(value, dtype=float)
    if arr.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(arr.shape)}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must hold finite non-negative seconds, got {arr.tolist()}")
    return arr


def _warmup(p: int, m: int, v: int, s: int) -> int:
    """Forwards stage s runs before its first backward (Megatron-LM's ``num_warmup_microbatches``)."""
    if v == 1:
        return min(p - s - 1, m)
    if m == p:  # Megatron: with as many micro-batches as stages the whole step is warm-up ("all_warmup")
        return m * v
    return min((p - s - 1) * 2 + (v - 1) * p, m * v)


def _op(kind: str, k: int, p: int, v: int) -> tuple[str, int, int]:
    """The k-th forward / backward op of a stage: micro-batches go in groups of p, chunk by chunk."""
    chunk = (k // p) % v
    micro = (k // (p * v)) * p + k % p
    return kind, (chunk if kind == "F" else v - 1 - chunk), micro


def schedule_order(p: int, m: int, v: int, s: int) -> list[tuple[str, int, int]]:
    """Stage s's op order as ("F"|"B", chunk, micro_batch): warm-up forwards, 1F1B, remaining backwards."""
    p, m, v = _positive_int("p", p), _positive_int("m", m), _positive_int("v", v)
    if not 0 <= s < p:
        raise ValueError(f"s must be in [0, {p}), got {s!r}")
    if v > 1 and m % p:
        raise ValueError(f"interleaving (v={v}) needs micro_batches % stages == 0, got m={m}, p={p}")
    total, warm = m * v, _warmup(p, m, v, s)
    order = [_op("F", k, p, v) for k in range(warm)]
    for k in range(total - warm):  # steady state: one forward, then one backward
        order += [_op("F", warm + k, p, v), _op("B", k, p, v)]
    return order + [_op("B", k, p, v) for k in range(total - warm, total)]


def _max_in_flight(order: list[tuple[str, int, int]]) -> int:
    """Most forwards done and backwards not started at once; ops are serial so a prefix count is exact."""
    held = most = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def run_pipeline(forward_s, backward_s, send_s, micro_batches: int, chunks: int = 1) -> PipelineSchedule:
    """Time one step: ``forward_s`` / ``backward_s`` [p, chunks] seconds per micro-batch and chunk,
    ``send_s`` [p] seconds per micro-batch across boundary s -> (s + 1) % p; p from ``forward_s``."""
    m, v = _positive_int("micro_batches", micro_batches), _positive_int("chunks", chunks)
    shape = np.shape(forward_s)
    if len(shape) != 2 or shape[0] < 1:
        raise ValueError(f"forward_s must have shape [stages, chunks={v}], got {list(shape)}")
    p = shape[0]
    dur = np.stack([_seconds("forward_s", forward_s, (p, v)), _seconds("backward_s", backward_s, (p, v))], axis=1)
    send = _seconds("send_s", send_s, (p,))
    if v > 1 and m % p:
        raise ValueError(f"interleaving (chunks={v}) needs micro_batches % stages == 0, got "
                         f"micro_batches={m}, stages={p}")
    orders = [schedule_order(p, m, v, s) for s in range(p)]
    start, end = np.full((p, 2, v, m), np.nan), np.full((p, 2, v, m), np.nan)
    arrive = np.full((2, p * v, m), np.nan)  # when op (kind, g, i)'s output is at its consumer's stage
    channel_free: dict[tuple[int, int], float] = {}  # (boundary, kind) -> when its last send ends
    sends: list[tuple[int, int, str, int, float, float]] = []
    ptr, free = [0] * p, [0.0] * p
    while any(ptr[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                kind_s, c, i = orders[s][ptr[s]]
                kind, g = (F if kind_s == "F" else B), c * p + s
                ready = _input_ready(arrive, kind, g, i, p * v)
                if np.isnan(ready):
                    break  # input not produced yet: let the other stages catch up
                t0 = max(free[s], ready)
                free[s] = t1 = t0 + dur[s, kind, c]
                start[s, kind, c, i], end[s, kind, c, i] = t0, t1
                _deliver(arrive, channel_free, sends, send, kind, g, i, s, p, v, t1)
                ptr[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlocks at ops {[o[q] for o, q in zip(orders, ptr) if q < len(o)]}")
    return _result(p, m, v, start, end, dur, sends, orders)


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


def _result(p, m, v, start, end, dur, sends, orders) -> PipelineSchedule:
    makespan = float(np.max(end))
    busy = m * dur.sum(axis=(1, 2))  # every (kind, chunk) op runs once per micro-batch
    bubble = 1.0 - busy / makespan if makespan > 0 else np.zeros(p)
    in_flight = np.array([_max_in_flight(o) for o in orders])
    for arr in (start, end, busy, bubble, in_flight):
        arr.flags.writeable = False
    return PipelineSchedule(p, m, v, start, end, makespan, busy, bubble, in_flight, sends, orders)
