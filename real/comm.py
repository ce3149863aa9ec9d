"""The real backend's collectives: torch.distributed calls that count their bytes.

Every call records the wire bytes this rank *sends* (the standard-algorithm bytes of
``testbed.collectives``, computed from the sizes of the tensors really passed) into a
``ByteLedger`` under the current stage, with each transfer's link level taken from the
scenario's rank -> node -> micro-cluster mapping. Summed over ranks, the ledgers give
``bytes_by_stage`` and ``bytes_by_level``.

The autograd functions make the token exchange differentiable: the backward of an
all-to-all is the all-to-all with the splits swapped, of an all-gather a
reduce-scatter, and of a reduce-scatter an all-gather.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from testbed.collectives import ByteLedger, transfers

# torch 2.13 renames the tensor-in/tensor-out collectives; older releases have only the old names
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    """Collectives of one rank, counted into ``ledger`` under ``stage_of()``."""

    def __init__(self, rank: int, ledger: ByteLedger, stage_of):
        self.rank = rank
        self.ledger = ledger
        self.stage_of = stage_of  # () -> name of the stage the clock is in

    def _count(self, kind: str, members: tuple[int, ...], size: int) -> None:
        src, dst, nbytes = transfers(kind, members, size)
        mine = src == self.rank
        self.ledger.add_transfers(self.stage_of(), src[mine], dst[mine], nbytes[mine])

    def _count_sends(self, members, send_bytes) -> None:
        dst = np.asarray(members, dtype=np.int64)
        nbytes = np.asarray(send_bytes, dtype=np.int64)
        keep = (dst != self.rank) & (nbytes > 0)
        self.ledger.add_transfers(self.stage_of(), np.full(keep.sum(), self.rank), dst[keep], nbytes[keep])

    # ---- raw collectives (no autograd) -------------------------------------------------------
    def all_to_all(self, x: torch.Tensor, send_splits, recv_splits, members, group) -> torch.Tensor:
        """Rows of ``x`` to each member by ``send_splits``; returns the received rows."""
        row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()
        self._count_sends(members, [s * row_bytes for s in send_splits])
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        if len(members) == 1:
            out.copy_(x)
            return out
        dist.all_to_all_single(out, x.contiguous(), list(recv_splits), list(send_splits), group=group)
        return out

    def all_gather(self, x: torch.Tensor, members, group, async_op=False):
        p = len(members)
        self._count("all_gather", tuple(members), x.numel() * x.element_size())
        out = x.new_empty((p * x.shape[0],) + tuple(x.shape[1:]))
        if p == 1:
            out.copy_(x)
            return (out, None) if async_op else out
        work = _all_gather_tensor(out, x.contiguous(), group=group, async_op=async_op)
        return (out, work) if async_op else out

    def reduce_scatter(self, x: torch.Tensor, members, group, async_op=False):
        p = len(members)
        self._count("reduce_scatter", tuple(members), x.numel() * x.element_size())
        out = x.new_empty((x.shape[0] // p,) + tuple(x.shape[1:]))
        if p == 1:
            out.copy_(x)
            return (out, None) if async_op else out
        work = _reduce_scatter_tensor(out, x.contiguous(), group=group, async_op=async_op)
        return (out, work) if async_op else out

    def all_reduce(self, x: torch.Tensor, members, group, async_op=False):
        self._count("all_reduce", tuple(members), x.numel() * x.element_size())
        if len(members) == 1:
            return None
        return dist.all_reduce(x, group=group, async_op=async_op)

    def p2p(self, ops: list[tuple[str, torch.Tensor, int]]) -> None:
        """Run sends and receives together: ops of ("send" | "recv", tensor, peer rank)."""
        p2p_ops = []
        for what, tensor, peer in ops:
            if what == "send":
                self._count("p2p", (self.rank, peer), tensor.numel() * tensor.element_size())
                p2p_ops.append(dist.P2POp(dist.isend, tensor, peer))
            else:
                p2p_ops.append(dist.P2POp(dist.irecv, tensor, peer))
        if p2p_ops:
            for work in dist.batch_isend_irecv(p2p_ops):
                work.wait()


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all of rows; backward sends gradients back with swapped splits."""

    @staticmethod
    def forward(ctx, x, comm: Comm, send_splits, recv_splits, members, group):
        ctx.args = (comm, send_splits, recv_splits, members, group)
        return comm.all_to_all(x, send_splits, recv_splits, members, group)

    @staticmethod
    def backward(ctx, grad):
        comm, send_splits, recv_splits, members, group = ctx.args
        return comm.all_to_all(grad.contiguous(), recv_splits, send_splits, members, group), None, None, None, None, None


class AllGather(torch.autograd.Function):
    """Differentiable all-gather along dim 0; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, comm: Comm, members, group):
        ctx.args = (comm, members, group)
        return comm.all_gather(x, members, group)

    @staticmethod
    def backward(ctx, grad):
        comm, members, group = ctx.args
        return comm.reduce_scatter(grad.contiguous(), members, group), None, None, None


class ReduceScatter(torch.autograd.Function):
    """Differentiable reduce-scatter (sum) along dim 0; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, comm: Comm, members, group):
        ctx.args = (comm, members, group)
        return comm.reduce_scatter(x, members, group)

    @staticmethod
    def backward(ctx, grad):
        comm, members, group = ctx.args
        return comm.all_gather(grad.contiguous(), members, group), None, None, None
