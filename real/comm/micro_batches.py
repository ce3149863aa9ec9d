"""Micro-batch pipelining of a layer's token exchange and experts (M22), real backend.

With ``overlap.micro_batches = n > 1`` and the flat all-to-all, the rows a rank sends
each EP member split into n consecutive chunks (``testbed.policy.micro_batches``, the split the
simulator times); micro-batch i is chunk i of every pair. The forward issues the
all-to-alls asynchronously in the order of the simulator's comm stream - dispatch 0,
dispatch 1, combine 0, dispatch 2, combine 1, ... - and runs micro-batch i's experts
once its dispatch has arrived, while the next dispatch and the previous combine are in
flight (gloo runs async collectives on its worker threads, NCCL on its own stream). The
backward mirrors it: while micro-batch i's experts run backward, the next combine
gradient and the previous dispatch gradient travel.

Each micro-batch's experts see their rows in the expert layout (expert, source, token,
slot) restricted to the micro-batch; an expert's FFN treats rows independently, so the
outputs are those of one batch, and the weight gradients the sum over micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from real.comm.exchange_plan import ranges
from testbed.policy.micro_batches import chunk_rows, chunk_start


@dataclass
class Chunk:
    """Micro-batch ``i`` of one rank's exchange (row units)."""

    send_splits: list[int]  # rows this rank sends each member
    recv_splits: list[int]  # rows it receives from each member
    send_rows: torch.Tensor  # positions in the full send-order buffer, in send order
    expert_rows: torch.Tensor  # positions in the micro-batch's receive buffer, in expert layout
    expert_counts: list[int]  # rows per local expert in that layout


def plan_chunks(send_splits, recv_splits, expert_rows: np.ndarray, expert_counts, n: int, device) -> list[Chunk]:
    """The n micro-batches of a flat exchange whose full plan is ``send_splits`` /
    ``recv_splits`` (rows per member) and ``expert_rows`` (positions of the full receive
    buffer in expert layout, ``expert_counts`` rows per local expert)."""
    send, recv = np.asarray(send_splits, dtype=np.int64), np.asarray(recv_splits, dtype=np.int64)
    send_at = np.concatenate([[0], np.cumsum(send)[:-1]])
    recv_at = np.concatenate([[0], np.cumsum(recv)[:-1]])
    total = int(recv.sum())
    chunk_of = np.empty(total, dtype=np.int64)  # full receive position -> micro-batch
    local = np.empty(total, dtype=np.int64)  # -> position in that micro-batch's receive buffer
    for i in range(n):
        rows, start = chunk_rows(recv, n, i), chunk_start(recv, n, i)
        at = ranges(recv_at + start, rows)
        chunk_of[at] = i
        local[at] = np.arange(len(at))
    expert_of = np.repeat(np.arange(len(expert_counts)), expert_counts)  # of each expert-layout row
    chunks = []
    for i in range(n):
        in_chunk = chunk_of[expert_rows] == i
        chunks.append(Chunk(
            send_splits=chunk_rows(send, n, i).tolist(),
            recv_splits=chunk_rows(recv, n, i).tolist(),
            send_rows=torch.as_tensor(ranges(send_at + chunk_start(send, n, i), chunk_rows(send, n, i)), device=device),
            expert_rows=torch.as_tensor(local[expert_rows[in_chunk]], device=device),
            expert_counts=np.bincount(expert_of[in_chunk], minlength=len(expert_counts)).tolist()))
    return chunks


@dataclass
class Exchange:
    """What the pipelined function needs of the rank: its collectives, clock, EP group,
    payload codec, the micro-batches, the experts (``experts(rows, counts)`` -> outputs,
    differentiable) and work to do at two points of the backward."""

    comm: object
    clock: object
    members: tuple[int, ...]
    group: object
    codec: object
    chunks: list[Chunk]
    experts: object
    hook: object = None  # () -> None, when the backward reaches the layer (before its first all-to-all)
    experts_done: object = None  # () -> None, once every micro-batch's experts ran their backward


def _send(ex: Exchange, x, send_splits, recv_splits, stage: str, scale: float):
    """Issue one async all-to-all of ``x`` (rows); returns a function that waits and
    gives the received rows."""
    payload = ex.codec.encode(x, scale) if ex.codec is not None else x
    out, work = ex.comm.all_to_all(payload, send_splits, recv_splits, ex.members, ex.group, async_op=True, stage=stage)

    def done():
        if work is not None:
            work.wait()
        return ex.codec.decode(out, x.dtype, scale) if ex.codec is not None else out
    return done


class PipelinedExchange(torch.autograd.Function):
    """Rows in send order -> the experts' outputs for them, in send order (module doc)."""

    @staticmethod
    def forward(ctx, send_buf, ex: Exchange):
        n, clock = len(ex.chunks), ex.clock
        out = send_buf.new_empty(send_buf.shape)
        saved, combines = [], []

        def dispatch(i):
            c = ex.chunks[i]
            return _send(ex, send_buf.index_select(0, c.send_rows), c.send_splits, c.recv_splits, "dispatch", 1.0)

        arriving = dispatch(0)
        for i, c in enumerate(ex.chunks):
            following = dispatch(i + 1) if i + 1 < n else None  # in flight during these experts
            clock.switch("dispatch")
            rows = arriving()
            clock.switch("experts")
            with torch.enable_grad():
                x = rows.detach().requires_grad_()
                y = ex.experts(x.index_select(0, c.expert_rows), c.expert_counts)
                y = y.new_zeros(x.shape).index_copy(0, c.expert_rows, y)  # back to arrival order
            saved.append((x, y))
            combines.append((c, _send(ex, y.detach(), c.recv_splits, c.send_splits, "combine", 1.0)))
            arriving = following
        clock.switch("combine")
        for c, back in combines:
            out.index_copy_(0, c.send_rows, back())
        ctx.ex, ctx.saved = ex, saved
        return out

    @staticmethod
    def backward(ctx, grad):
        ex, saved = ctx.ex, ctx.saved
        n, clock = len(ex.chunks), ex.clock
        if ex.hook is not None:
            ex.hook()
        scale = ex.codec.grad_scale if ex.codec is not None else 1.0
        grad = grad.contiguous()
        grad_in = grad.new_zeros(grad.shape)

        def combine_grad(i):
            c = ex.chunks[i]
            return _send(ex, grad.index_select(0, c.send_rows), c.send_splits, c.recv_splits, "combine_backward", scale)

        arriving, returns = combine_grad(0), []
        for i, c in enumerate(ex.chunks):
            following = combine_grad(i + 1) if i + 1 < n else None
            clock.switch("combine_backward")
            g = arriving()
            clock.switch("experts_backward")
            x, y = saved[i]
            if x.shape[0]:
                (gx,) = torch.autograd.grad(y, x, g)
            else:
                gx = torch.zeros_like(x)
            returns.append((c, _send(ex, gx, c.recv_splits, c.send_splits, "dispatch_backward", scale)))
            arriving = following
        if ex.experts_done is not None:
            ex.experts_done()
        clock.switch("dispatch_backward")
        for c, back in returns:
            grad_in.index_copy_(0, c.send_rows, back())
        ctx.saved = None
        return grad_in, None
