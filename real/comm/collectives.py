"""The real backend's collectives: torch.distributed calls that count their bytes.

Every call records the payload bytes this rank *sends*, computed with
``testbed.policy.collectives``' formulas from the sizes of the tensors really passed and the
algorithm the library runs for the call: gloo's reduce-scatter is an all-reduce of the
whole input (counted as one), the FP8 reduce-scatter an all-to-all of shards (counted as
one). They go into a ``ByteLedger`` under the current stage, each transfer's link level
taken from the scenario's rank -> node -> micro-cluster mapping. Summed over ranks, the
ledgers give ``bytes_by_stage`` and ``bytes_by_level``. These are counted, not measured:
only an emulated cluster's kernel counters measure bytes on a wire
(``wire_bytes_by_level``, ``real.netem``; ``docs/bytes.md``).

The autograd functions make the token exchange differentiable: the backward of an
all-to-all is the all-to-all with the splits swapped, of an all-gather a
reduce-scatter, and of a reduce-scatter an all-gather. Given a ``PayloadCodec`` (FP8
payloads, M22) they compress what they send in both directions: token rows forward,
their gradients backward.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from testbed.policy.collectives import ByteLedger, transfers

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# torch 2.13 renames the tensor-in/tensor-out collectives; older releases have only the old names
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PayloadCodec:
    """Token payloads as float8 e4m3 on the wire (``comm.payload_dtype = "fp8"``, M22).

    Rows are cast to ``torch.float8_e4m3fn`` and sent as uint8 (gloo has no float8), one
    byte per element: exactly the ``hidden_size`` bytes per slot the planner counts, so
    no scale travels with them. Hidden states are O(1) and go as they are, saturated at
    +-448. Gradients are tiny (the loss is a mean over tokens x hidden x ranks), so the
    backward multiplies them by a fixed power of two ``grad_scale`` before the cast and
    divides it out after (static loss scaling; exact, as it is a power of two). Both
    directions are compressed; the receiver decodes into the model dtype, and a
    compressed reduce-scatter sums the decoded shards in fp32.
    """

    def __init__(self, grad_scale: float):
        if not hasattr(torch, "float8_e4m3fn"):
            raise RuntimeError("comm.payload_dtype = fp8 needs a torch with float8_e4m3fn (>= 2.1)")
        self.grad_scale = float(grad_scale)

    def encode(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """uint8 bytes of ``x * scale`` in float8 e4m3 (same shape)."""
        y = x.float() * scale if scale != 1.0 else x.float()
        return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, b: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        y = b.view(torch.float8_e4m3fn).float()
        return (y / scale if scale != 1.0 else y).to(dtype)


class Comm:
    """Collectives of one rank, counted into ``ledger`` under ``stage_of()``.

    ``p2p_all_to_all``: run the all-to-all as sends and receives posted at once
    (``all_to_all_p2p``) instead of the library's call (see ``all_to_all``)."""

    def __init__(self, rank: int, ledger: ByteLedger, stage_of, p2p_all_to_all: bool = False, global_rank=None):
        self.rank = rank
        #: local rank -> the process group world's rank (pipeline stages number their ranks from 0)
        self.global_rank = global_rank or (lambda r: r)
        self.ledger = ledger
        self.stage_of = stage_of  # () -> name of the stage the clock is in
        self.p2p_all_to_all = p2p_all_to_all
        #: the largest send + receive buffers of one collective so far (bytes; memory breakdown)
        self.largest_buffers = 0

    def _buffers(self, *tensors: torch.Tensor) -> None:
        self.largest_buffers = max(self.largest_buffers, sum(t.numel() * t.element_size() for t in tensors))

    def _count(self, kind: str, members: tuple[int, ...], size: int, stage: str | None = None,
               group=None) -> None:
        src, dst, nbytes = transfers(kind, members, size,
                                     reduce_scatter_as_all_reduce=kind == "reduce_scatter" and _is_gloo(group))
        mine = src == self.rank
        self.ledger.add_transfers(stage or self.stage_of(), src[mine], dst[mine], nbytes[mine])

    def _count_sends(self, members, send_bytes, stage: str | None = None) -> None:
        dst = np.asarray(members, dtype=np.int64)
        nbytes = np.asarray(send_bytes, dtype=np.int64)
        keep = (dst != self.rank) & (nbytes > 0)
        self.ledger.add_transfers(stage or self.stage_of(), np.full(keep.sum(), self.rank), dst[keep], nbytes[keep])

    # ---- raw collectives (no autograd) -------------------------------------------------------
    def all_to_all(self, x: torch.Tensor, send_splits, recv_splits, members, group, async_op: bool = False,
                   stage: str | None = None):
        """Rows of ``x`` to each member by ``send_splits``; returns the received rows
        (``async_op``: and a work to wait for before reading them, None if there is
        nothing to wait for). ``stage``: the stage its bytes count in (default: the
        clock's).

        One ``all_to_all_single`` (NCCL runs it as grouped sends and receives; gloo on a
        loopback as its own rendezvous per pair), or with ``p2p_all_to_all`` (gloo on an
        emulated cluster) the same exchange as sends and receives to every member at once
        with every receive posted first (``all_to_all_p2p``): gloo's own all-to-all posts
        each receive after a send, and over rate-limited TCP links a receive's notice can
        then queue behind data already leaving on the same connection, so pairs take turns
        (measured by ``testbed net probe``: 1.5x slower than all pairs at once). On a
        loopback, where no link limits the rate, gloo's call is the faster of the two."""
        row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()
        self._count_sends(members, [s * row_bytes for s in send_splits], stage)
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        self._buffers(x, out)
        work = None
        if len(members) == 1:
            out.copy_(x)
        elif self.p2p_all_to_all:
            work = all_to_all_p2p(out, x.contiguous(), list(recv_splits), list(send_splits), members, self.rank, group,
                                  async_op=async_op)
        else:
            work = dist.all_to_all_single(out, x.contiguous(), list(recv_splits), list(send_splits), group=group,
                                          async_op=async_op)
        return (out, work) if async_op else out

    def all_gather(self, x: torch.Tensor, members, group, async_op=False, stage: str | None = None):
        p = len(members)
        self._count("all_gather", tuple(members), x.numel() * x.element_size(), stage)
        out = x.new_empty((p * x.shape[0],) + tuple(x.shape[1:]))
        self._buffers(x, out)
        if p == 1:
            out.copy_(x)
            return (out, None) if async_op else out
        work = _all_gather_tensor(out, x.contiguous(), group=group, async_op=async_op)
        return (out, work) if async_op else out

    def reduce_scatter(self, x: torch.Tensor, members, group, async_op=False, stage: str | None = None):
        p = len(members)
        # gloo all-reduces the whole input and keeps the shard: counted as that all-reduce
        self._count("reduce_scatter", tuple(members), x.numel() * x.element_size(), stage, group)
        out = x.new_empty((x.shape[0] // p,) + tuple(x.shape[1:]))
        self._buffers(x, out)
        if p == 1:
            out.copy_(x)
            return (out, None) if async_op else out
        work = _reduce_scatter_tensor(out, x.contiguous(), group=group, async_op=async_op)
        return (out, work) if async_op else out

    def reduce_scatter_coded(self, x: torch.Tensor, members, group, codec: PayloadCodec, scale: float) -> torch.Tensor:
        """Reduce-scatter (sum) with a compressed payload: every member sends each peer
        that peer's shard in FP8 and sums what it receives in fp32. Counted as what it
        runs, an all-to-all of shards: (p-1) shards of 1/p of the compressed tensor to
        the p-1 peers (the planner's op for it is that all-to-all, with either library)."""
        p = len(members)
        coded = codec.encode(x, scale)
        self._count_sends(members, [coded.numel() // p] * p)
        if p == 1:
            return codec.decode(coded, x.dtype, scale)
        shards = torch.empty_like(coded)
        rows = [x.shape[0] // p] * p
        dist.all_to_all_single(shards, coded.contiguous(), rows, rows, group=group)
        parts = codec.decode(shards, torch.float32, scale).view((p, x.shape[0] // p) + tuple(x.shape[1:]))
        total = parts[0].clone()
        for part in parts[1:]:  # fixed order: the same sum on every run
            total += part
        return total.to(x.dtype)

    def all_reduce(self, x: torch.Tensor, members, group, async_op=False, stage: str | None = None,
                   reduce_op=dist.ReduceOp.SUM):
        self._count("all_reduce", tuple(members), x.numel() * x.element_size(), stage)
        self._buffers(x)  # in place
        if len(members) == 1:
            return None
        return dist.all_reduce(x, op=reduce_op, group=group, async_op=async_op)

    def p2p(self, ops: list[tuple[str, torch.Tensor, int]]) -> None:
        """Run sends and receives together: ops of ("send" | "recv", tensor, peer rank)."""
        p2p_ops = []
        for what, tensor, peer in ops:
            if what == "send":
                self._count("p2p", (self.rank, peer), tensor.numel() * tensor.element_size())
                p2p_ops.append(dist.P2POp(dist.isend, tensor, self.global_rank(peer)))
            else:
                p2p_ops.append(dist.P2POp(dist.irecv, tensor, self.global_rank(peer)))
        if p2p_ops:
            for work in dist.batch_isend_irecv(p2p_ops):
                work.wait()


def _is_gloo(group) -> bool:
    """Whether ``group``'s collectives run on gloo (False without a process group: tests)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "gloo"


class Works:
    """Several works waited for as one."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def all_to_all_p2p(out: torch.Tensor, x: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                   members, rank: int, group, async_op: bool = False) -> Works | None:
    """All-to-all of rows as point-to-point messages: every non-empty receive is posted,
    then every non-empty send, and all are waited for together (``async_op``: returned
    to wait for); this rank's own rows are copied. ``members`` are global ranks in group
    order; splits are rows per member."""
    recv_at = np.concatenate([[0], np.cumsum(recv_splits)]).tolist()
    send_at = np.concatenate([[0], np.cumsum(send_splits)]).tolist()
    me = members.index(rank)
    out[recv_at[me]:recv_at[me + 1]].copy_(x[send_at[me]:send_at[me + 1]])
    ops = [dist.P2POp(dist.irecv, out[recv_at[j]:recv_at[j + 1]], peer, group)
           for j, peer in enumerate(members) if j != me and recv_splits[j] > 0]
    ops += [dist.P2POp(dist.isend, x[send_at[j]:send_at[j + 1]], peer, group)
            for j, peer in enumerate(members) if j != me and send_splits[j] > 0]
    works = Works(dist.batch_isend_irecv(ops) if ops else [])
    if async_op:
        return works
    works.wait()
    return None


def coded_all_to_all(comm: Comm, x, send_splits, recv_splits, members, group, codec, scale):
    """``comm.all_to_all`` of ``x``'s rows, compressed by ``codec`` (or None) on the wire at ``scale``."""
    if codec is None:
        return comm.all_to_all(x, send_splits, recv_splits, members, group)
    out = comm.all_to_all(codec.encode(x, scale), send_splits, recv_splits, members, group)
    return codec.decode(out, x.dtype, scale)


def _coded_all_gather(comm: Comm, x, members, group, codec, scale):
    if codec is None:
        return comm.all_gather(x, members, group)
    return codec.decode(comm.all_gather(codec.encode(x, scale), members, group), x.dtype, scale)


def _coded_reduce_scatter(comm: Comm, x, members, group, codec, scale):
    if codec is None:
        return comm.reduce_scatter(x, members, group)
    return comm.reduce_scatter_coded(x, members, group, codec, scale)


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all of rows; backward sends gradients back with swapped splits.
    ``codec`` (or None) compresses rows forward and gradients backward (M22)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, send_splits, recv_splits, members, group, codec=None):
        ctx.args = (comm, send_splits, recv_splits, members, group, codec)
        return coded_all_to_all(comm, x, send_splits, recv_splits, members, group, codec, 1.0)

    @staticmethod
    def backward(ctx, grad):
        comm, send_splits, recv_splits, members, group, codec = ctx.args
        scale = codec.grad_scale if codec else 1.0
        back = coded_all_to_all(comm, grad.contiguous(), recv_splits, send_splits, members, group, codec, scale)
        return back, None, None, None, None, None, None


class AllGather(torch.autograd.Function):
    """Differentiable all-gather along dim 0; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, comm: Comm, members, group, codec=None):
        ctx.args = (comm, members, group, codec)
        return _coded_all_gather(comm, x, members, group, codec, 1.0)

    @staticmethod
    def backward(ctx, grad):
        comm, members, group, codec = ctx.args
        scale = codec.grad_scale if codec else 1.0
        return _coded_reduce_scatter(comm, grad.contiguous(), members, group, codec, scale), None, None, None, None


class ReduceScatter(torch.autograd.Function):
    """Differentiable reduce-scatter (sum) along dim 0; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, comm: Comm, members, group, codec=None):
        ctx.args = (comm, members, group, codec)
        return _coded_reduce_scatter(comm, x, members, group, codec, 1.0)

    @staticmethod
    def backward(ctx, grad):
        comm, members, group, codec = ctx.args
        scale = codec.grad_scale if codec else 1.0
        return _coded_all_gather(comm, grad.contiguous(), members, group, codec, scale), None, None, None, None
