"""Max-plus timing of one DualPipe training step (DeepSeek-V3 report, arXiv 2412.19437 §3.2.1, Fig. 5).

``p`` stages (even) hold the model twice: the model is cut into p chunks, and stage s holds chunk s of the
**forward direction** (micro-batches fed in at stage 0, loss on stage p-1) and chunk p-1-s of the **reverse
direction** (fed in at stage p-1, loss on stage 0); ``m`` micro-batches (even, at least 2p), half in each
direction. A backward is either whole (B: input and weight gradients) or split as in ZeroBubble into its
input-gradient part (I, B - W seconds), whose result the previous stage waits for, and its weight-gradient part (W)
run later to fill a gap. An overlapped pair F&B runs one direction's forward with the other's backward in
``overlapped_s`` seconds: in the report each chunk's attention and MLP hide the other's all-to-all dispatch and
combine, so a pair takes less than F + B.

Each stage runs its ops one at a time in the order of DeepSeek's ``DualPipe.step`` (github.com/deepseek-ai/DualPipe
``dualpipe/dualpipe.py`` at 3da1bbea53606543d7f5f232338fc58096db30e3, file last changed in 092151c4), its eight steps
with half_rank h = min(s, p-1-s), phase 0 the stage's own direction (forward on the first half of the stages):
1. nF0: 2(p/2 - h - 1) forwards of phase 0;   2. nF0F1: h + 1 pairs of forwards, phase 0 then phase 1;
3. nB1W1F1: p/2 - h - 1 times I of phase 1, a W, F of phase 1;
4. nF0B1F1B0: m/2 - p + h + 1 times F&B (forward 0, backward 1) then F&B (forward 1, backward 0); the middle
   stages (h = p/2 - 1) run their first F&B as F then a whole B, not overlapped ("to further reduce bubble size");
5. nB1F1B0: p/2 - h - 1 times B of phase 1 then F&B (forward 1, backward 0);
6. nB1B0: h + 1 times B of phase 1 then of phase 0, the second half of them split (I, their W later);
7. nWB0: p/2 - h - 1 times W then I of phase 0;   8. nW: h + 1 W.
The W ops take the weight gradients left by the I ops in the order they ran (the repo's FIFO ``WeightGradStore``).

An op starts at max(the stage's previous op end, its inputs' arrival); an F&B waits for both. Sends: ``send_s[k]``
seconds move one micro-batch's activations or gradients across boundary k (stages k and k+1), either way; they are
asynchronous for the sender, and each (from, to) stage pair is a FIFO channel, both directions' traffic that way
sharing it. The repo instead batches an op's sends with the next op's receives and waits for them all
(``_commit_and_wait_comm``), which on NCCL also holds a sender until its peer posts the matching receive; that
coupling is left out here (a sender never waits for its receiver).

Against Table 2 (equal stages, sends free): the largest stage bubble (makespan - busy) is (p/2 - 1)(F&B + B - 3W)
when the input-gradient backward takes as long as a forward (B - W = F, Fig. 5's proportions), W <= F and
max(F, B) <= F&B <= F + B; tests/sim/pipeline/test_dualpipe.py checks it. The middle stages have it; a stage at
half_rank h runs p/2 - 2 - h fewer pairs (when positive), so it idles that many (F + B - F&B) less. The peak
activations, (p + 1) chunks' worth of one micro-batch, are on the two middle stages; the others hold p.

Left out, as in ``schedule.py``: contention between channels, the optimizer step, gradient sync, recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.pipeline.schedule import seconds_array

F, B, W = 0, 1, 2  # kind index into start / end: forward, backward (whole or its input-gradient part), weights
PARAMETER_COPIES = 2  # each stage holds two model chunks of the p: twice 1F1B's parameters (Table 2)


@dataclass(frozen=True)
class DualPipeOp:
    """One op of a stage's order. ``kind``: "F" forward, "B" whole backward, "I" input-gradient backward (its
    weight gradient runs later as a "W"), "W", or "F&B" (forward of ``direction``, ``micro_batch`` overlapped with
    the backward of ``backward_direction``, ``backward_micro_batch``). ``direction`` 0 is fed in at stage 0, 1 at
    stage p-1; ``micro_batch`` counts 0 .. m/2-1 within its direction; ``step`` is the repo's step (1-8)."""

    kind: str
    direction: int
    micro_batch: int
    step: int
    backward_direction: int = -1
    backward_micro_batch: int = -1


@dataclass(frozen=True)
class DualPipeSchedule:
    """One step's timing, as ``schedule.PipelineSchedule``'s. ``start`` / ``end`` [s, kind (0=F, 1=B or I, 2=W),
    direction, i] are seconds from the step's start (an F&B's forward and backward both its span; W NaN where the
    backward ran whole); ``busy_s[s]`` the stage's compute seconds (an F&B once); ``bubble_s[s] = makespan_s -
    busy_s[s]``, ``bubble_fraction[s]`` its share of the makespan; ``in_flight[s]`` the most (direction, micro-batch)
    forwards done on the stage whose backward has not started (activations held, in one chunk's for one
    micro-batch); ``sends`` (s_from, s_to, "F"|"B", direction, micro_batch, start_s, end_s) in issue order."""

    stages: int
    micro_batches: int
    start: np.ndarray
    end: np.ndarray
    makespan_s: float
    busy_s: np.ndarray
    bubble_s: np.ndarray
    bubble_fraction: np.ndarray
    in_flight: np.ndarray
    sends: list[tuple[int, int, str, int, int, float, float]]
    orders: list[list[DualPipeOp]]
    chunks: int = 2  # model chunks per stage, one per direction


def held_chunks(p: int, s: int) -> tuple[int, int]:
    """Model chunks (of p) stage s holds: for the forward direction, then the reverse."""
    return s, p - 1 - s


def stage_seconds(per_chunk, p: int) -> np.ndarray:
    """[p, 2] seconds by (stage, direction) from [p] seconds by model chunk (chunk g: the g-th of p slices)."""
    arr = np.asarray(per_chunk, dtype=float)
    if arr.shape != (p,):
        raise ValueError(f"per-chunk seconds must have shape [{p}], got {list(arr.shape)}")
    return np.stack([arr, arr[::-1]], axis=1)


def _check_sizes(p: object, m: object) -> tuple[int, int]:
    for name, v in (("stages", p), ("micro_batches", m)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    p, m = int(p), int(m)
    if p % 2:
        raise ValueError(f"DualPipe needs an even number of stages, got {p}")
    if m % 2 or m < 2 * p:  # DualPipe.step: num_chunks % 2 == 0 and num_chunks >= num_ranks * 2
        raise ValueError(f"DualPipe needs an even number of micro-batches, at least 2 x stages = {2 * p}, got {m}")
    return p, m


def dualpipe_order(p: int, m: int, s: int) -> list[DualPipeOp]:
    """Stage s's ops in ``DualPipe.step``'s order (module docstring), micro-batches numbered per direction."""
    p, m = _check_sizes(p, m)
    if not 0 <= s < p:
        raise ValueError(f"s must be in [0, {p}), got {s!r}")
    half, h, second = p // 2, min(s, p - 1 - s), int(s >= p // 2)
    middle = h == half - 1
    fwd, bwd = [0, 0], [0, 0]  # next micro-batch per direction
    order: list[DualPipeOp] = []

    def direction(phase: int) -> int:
        return phase ^ second  # phase 0 is the direction whose first half of stages this one is in

    def forward(phase: int, step: int) -> None:
        d = direction(phase)
        order.append(DualPipeOp("F", d, fwd[d], step))
        fwd[d] += 1

    def backward(phase: int, step: int, split: bool = False) -> None:
        d = direction(phase)
        order.append(DualPipeOp("I" if split else "B", d, bwd[d], step))
        bwd[d] += 1

    def weight(step: int) -> None:
        pending = [op for op in order if op.kind == "I"]
        done = sum(op.kind == "W" for op in order)
        order.append(DualPipeOp("W", pending[done].direction, pending[done].micro_batch, step))  # FIFO

    def pair(phase_f: int, phase_b: int, step: int) -> None:
        df, db = direction(phase_f), direction(phase_b)
        order.append(DualPipeOp("F&B", df, fwd[df], step, db, bwd[db]))
        fwd[df] += 1
        bwd[db] += 1

    for _ in range(2 * (half - h - 1)):  # step 1: nF0
        forward(0, 1)
    for _ in range(h + 1):  # step 2: nF0F1
        forward(0, 2)
        forward(1, 2)
    for _ in range(half - h - 1):  # step 3: nB1W1F1
        backward(1, 3, split=True)
        weight(3)
        forward(1, 3)
    for i in range(m // 2 - p + h + 1):  # step 4: nF0B1F1B0
        if i == 0 and middle:  # the repo: "We don't overlap these two chunks to further reduce bubble size."
            forward(0, 4)
            backward(1, 4)
        else:
            pair(0, 1, 4)
        pair(1, 0, 4)
    for _ in range(half - h - 1):  # step 5: nB1F1B0
        backward(1, 5)
        pair(1, 0, 5)
    split = False
    for i in range(h + 1):  # step 6: nB1B0, from its middle on split
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        backward(1, 6, split)
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        backward(0, 6, split)
    for _ in range(half - h - 1):  # step 7: nWB0
        weight(7)
        backward(0, 7, split=True)
    for _ in range(h + 1):  # step 8: nW
        weight(8)
    return order


def _max_in_flight(order: list[DualPipeOp]) -> int:
    """Most forwards done whose backward has not started; an F&B's backward frees before its forward adds."""
    held = most = 0
    for op in order:
        held += {"F": 1, "B": -1, "I": -1, "W": 0, "F&B": 0}[op.kind]
        most = max(most, held)
    return most


class _Solver:
    """Walks the stages' orders in dependency order; every op's start is a max of sums of durations."""

    def __init__(self, p, m, dur, send):
        self.p, self.m, self.dur, self.send = p, m, dur, send
        shape = (p, 3, 2, m // 2)
        self.start, self.end = np.full(shape, np.nan), np.full(shape, np.nan)
        self.arrive = np.full((2, 2, p, m // 2), np.nan)  # [kind F/B, direction, stage it is at, i]
        self.channel_free: dict[tuple[int, int], float] = {}
        self.sends: list[tuple[int, int, str, int, int, float, float]] = []

    def _first(self, d: int) -> int:
        return 0 if d == 0 else self.p - 1

    def _last(self, d: int) -> int:
        return self.p - 1 - self._first(d)

    def _ready(self, kind: int, d: int, i: int, s: int) -> float:
        """When (kind, d, i)'s input is on stage s (NaN: not yet produced)."""
        if kind == F:
            return 0.0 if s == self._first(d) else self.arrive[F, d, s, i]
        return self.end[s, F, d, i] if s == self._last(d) else self.arrive[B, d, s, i]  # the loss is local

    def _deliver(self, kind: int, d: int, i: int, s: int, t_done: float) -> None:
        """Send (kind, d, i)'s output from stage s, done at ``t_done``, to the stage that needs it."""
        if (kind == F and s == self._last(d)) or (kind == B and s == self._first(d)):
            return
        step = 1 if d == 0 else -1
        dest = s + step if kind == F else s - step
        t0 = max(t_done, self.channel_free.get((s, dest), 0.0))
        t1 = t0 + self.send[min(s, dest)]
        self.channel_free[(s, dest)] = t1
        self.arrive[kind, d, dest, i] = t1
        self.sends.append((s, dest, "FB"[kind], d, i, t0, t1))

    def try_run(self, s: int, op: DualPipeOp, free: float) -> float | None:
        """Run op on stage s if its inputs are there: the op's end, else None."""
        d, i = op.direction, op.micro_batch
        if op.kind == "F&B":
            inputs = (self._ready(F, d, i, s), self._ready(B, op.backward_direction, op.backward_micro_batch, s))
            ready = np.nan if np.isnan(inputs).any() else max(inputs)  # both: Python's max passes a NaN over
            seconds = self.dur["F&B"][s, d]
        elif op.kind == "W":
            ready, seconds = 0.0, self.dur["W"][s, d]  # its I ran earlier on this stage
        else:
            kind = F if op.kind == "F" else B
            ready, seconds = self._ready(kind, d, i, s), self.dur[op.kind][s, d]
        if np.isnan(ready):
            return None
        t0 = max(free, ready)
        t1 = t0 + seconds
        if op.kind == "F&B":
            db, ib = op.backward_direction, op.backward_micro_batch
            self.start[s, F, d, i], self.end[s, F, d, i] = t0, t1
            self.start[s, B, db, ib], self.end[s, B, db, ib] = t0, t1
            self._deliver(F, d, i, s, t1)  # the repo sends the forward's output, then the backward's
            self._deliver(B, db, ib, s, t1)
        else:
            kind = {"F": F, "B": B, "I": B, "W": W}[op.kind]
            self.start[s, kind, d, i], self.end[s, kind, d, i] = t0, t1
            if kind != W:
                self._deliver(kind, d, i, s, t1)
        return t1


def run_dualpipe(forward_s, backward_s, weight_s, overlapped_s, send_s, micro_batches: int) -> DualPipeSchedule:
    """Time one DualPipe step. [p, 2] seconds per micro-batch by (stage, direction) (``stage_seconds`` turns
    per-chunk seconds into these): ``forward_s``; ``backward_s`` the whole backward, ``weight_s`` its
    weight-gradient part (the input-gradient part takes the difference); ``overlapped_s[s, d]`` an F&B on stage s
    whose forward is direction d's. ``send_s`` [p - 1]: seconds per micro-batch across boundary k (stages k, k+1),
    either way. p from ``forward_s``; ``micro_batches`` counts both directions."""
    shape = np.shape(forward_s)
    if len(shape) != 2 or shape[1] != 2:
        raise ValueError(f"forward_s must have shape [stages, 2 directions], got {list(shape)}")
    p, m = _check_sizes(shape[0], micro_batches)
    fwd, whole = seconds_array("forward_s", forward_s, (p, 2)), seconds_array("backward_s", backward_s, (p, 2))
    wgt, pair = seconds_array("weight_s", weight_s, (p, 2)), seconds_array("overlapped_s", overlapped_s, (p, 2))
    send = seconds_array("send_s", send_s, (p - 1,))
    if np.any(wgt > whole):
        raise ValueError(f"weight_s is part of backward_s and cannot exceed it: {wgt.tolist()} > {whole.tolist()}")
    dur = {"F": fwd, "B": whole, "I": whole - wgt, "W": wgt, "F&B": pair}
    orders = [dualpipe_order(p, m, s) for s in range(p)]
    solver, ptr, free = _Solver(p, m, dur, send), [0] * p, [0.0] * p
    busy = np.zeros(p)
    while any(ptr[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                t1 = solver.try_run(s, orders[s][ptr[s]], free[s])
                if t1 is None:
                    break  # input not produced yet: let the other stages catch up
                op = orders[s][ptr[s]]
                busy[s] += dur[op.kind][s, op.direction]
                free[s], ptr[s], progressed = t1, ptr[s] + 1, True
        if not progressed:
            raise RuntimeError(f"DualPipe deadlocks at ops {[o[q] for o, q in zip(orders, ptr) if q < len(o)]}")
    makespan = float(np.nanmax(solver.end))
    bubble = makespan - busy
    fraction = bubble / makespan if makespan > 0 else np.zeros(p)
    in_flight = np.array([_max_in_flight(o) for o in orders])
    for arr in (solver.start, solver.end, busy, bubble, fraction, in_flight):
        arr.flags.writeable = False
    return DualPipeSchedule(p, m, solver.start, solver.end, makespan, busy, bubble, fraction, in_flight,
                            solver.sends, orders)
