"""Expert tensor parallelism on the real ranks (``parallelism.etp_size`` > 1, issue 25 item 3):
the ETP group's all-gather of the rows its members received in the EP all-to-all, and the
reduce-scatter of the partial outputs back, each differentiable (the backward of one is the
other), as ``testbed.policy.expert_tensor_parallel`` plans them (Megatron-Core's
``MoEAlltoAllTokenDispatcher``: ``dispatch_postprocess``' ``gather_from_sequence_parallel_region``
and ``combine_preprocess``' ``reduce_scatter_to_sequence_parallel_region``, NVIDIA/Megatron-LM
d98e8a64dd, ``megatron/core/transformer/moe/token_dispatcher.py``).

Both run as the planner's op, an ``all_to_all_v`` over the ETP group (members in ascending
rank, the process group's order): the all-gather sends a member's N rows to each of the
others (its own are copied), the reduce-scatter sends member b the partial sums of b's N_b
rows, and each member adds the ETP partial sums of its rows it holds then (its own and the
ones received, in member order: the same sum on every run). The all-gather's rows go as the
token exchange's payload (``codec``: FP8, M22; gradients scaled by its ``grad_scale``), the
partial sums in the model's dtype, as the planner counts them (``etp_token_ops``).

Rows: a member's rows enter in its *expert layout* (its shard's experts in order, each the
rows of its EP group); the gathered rows are in the ETP group's expert layout, by (expert,
member in group order), so that each local expert's rows are contiguous for the grouped GEMM.
"""

from __future__ import annotations

import numpy as np
import torch

from real.comm.collectives import Comm, PayloadCodec, coded_all_to_all
from real.comm.exchange_plan import ranges


class ExpertTensorGroup:
    """One MoE layer's ETP exchange of one rank (module doc).

    ``members``: the ETP group's ranks, ascending; ``counts_ME[m, e]`` the rows member m
    received for local expert e in its EP all-to-all (every member holds the same shard)."""

    def __init__(self, comm: Comm, members: tuple[int, ...], group, me: int, counts_ME: np.ndarray,
                 codec: PayloadCodec | None):
        self.comm, self.members, self.group, self.codec = comm, tuple(members), group, codec
        counts = np.asarray(counts_ME, dtype=np.int64)
        self.rows_M = counts.sum(axis=1)  # rows each member received
        self.me = self.members.index(me)
        #: rows per local expert in the gathered expert layout (every member's)
        self.counts_E = counts.sum(axis=0)
        # member-major (member, expert) blocks -> expert-major (expert, member)
        starts = np.concatenate([[0], np.cumsum(counts.reshape(-1))[:-1]]).reshape(counts.shape)
        order = ranges(starts.T.reshape(-1), counts.T.reshape(-1))
        self.to_experts = torch.as_tensor(order, dtype=torch.long)
        self.to_members = torch.as_tensor(np.argsort(order, kind="stable"), dtype=torch.long)

    def _on(self, index: torch.Tensor, device) -> torch.Tensor:
        return index if index.device == device else index.to(device)

    def gather(self, x_NH: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Every member's rows, this rank's ``x_NH`` among them, in the gathered expert layout."""
        p = len(self.members)
        send = [int(x_NH.shape[0])] * p
        recv = self.rows_M.tolist()
        got = coded_all_to_all(self.comm, x_NH.repeat(p, 1), send, recv, self.members, self.group, self.codec, scale)
        return got.index_select(0, self._on(self.to_experts, got.device))

    def scatter(self, y_RH: torch.Tensor) -> torch.Tensor:
        """This rank's rows' sums over the members of the partial rows ``y_RH`` (gathered
        expert layout), in the model's dtype on the wire, summed in fp32 in member order."""
        p, mine = len(self.members), int(self.rows_M[self.me])
        by_member = y_RH.index_select(0, self._on(self.to_members, y_RH.device))
        got = self.comm.all_to_all(by_member, self.rows_M.tolist(), [mine] * p, self.members, self.group)
        parts = got.view(p, mine, *got.shape[1:]).float()
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.to(y_RH.dtype)


class GatherRows(torch.autograd.Function):
    """The ETP all-gather (stage dispatch); backward: the reduce-scatter of the row
    gradients (stage dispatch_backward)."""

    @staticmethod
    def forward(ctx, x_NH, etp: ExpertTensorGroup):
        ctx.etp = etp
        return etp.gather(x_NH)

    @staticmethod
    def backward(ctx, grad):
        return ctx.etp.scatter(grad.contiguous()), None


class ScatterPartials(torch.autograd.Function):
    """The ETP reduce-scatter of partial outputs (stage combine); backward: the all-gather
    of the output gradients (stage combine_backward), as payload (FP8 scaled by the
    codec's ``grad_scale``)."""

    @staticmethod
    def forward(ctx, y_RH, etp: ExpertTensorGroup):
        ctx.etp = etp
        return etp.scatter(y_RH)

    @staticmethod
    def backward(ctx, grad):
        etp = ctx.etp
        return etp.gather(grad.contiguous(), etp.codec.grad_scale if etp.codec else 1.0), None
