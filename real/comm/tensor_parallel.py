"""Tensor parallelism with sequence parallelism for the real backend's whole transformer
(``parallelism.tp_size`` t > 1; Shoeybi et al. 2019, "Megatron-LM", §3; Korthikanti et
al. 2022, §4.2.2 for sequence parallelism).

The t ranks of a tensor-parallel group (``Planner.tp_groups``: consecutive ranks of a
node) each keep their own tokens between sublayers, as the MoE layers see them. Around
every attention and dense FFN the group all-gathers its tokens, each rank computes its
1/t of the heads (or FFN columns) on all of them, and a reduce-scatter sums the partial
outputs and hands each rank its own rows back. The group's rows, gathered in member order,
are whole sequences: a rank's own may be part of one (a TP group shares its micro-batch,
``testbed.scenario.scenario``: half a sequence each with t = 2, rank 0 of the group the first
half), and attention cuts the gathered rows into sequences in that order. The vocabulary is
split too: each rank holds 1/t of the embedding's rows and of the output head's columns.

- Embedding: the group's token ids (and targets) are all-gathered, each rank looks up the
  ids in its rows (zeros for the others) and a reduce-scatter sums them into each rank's
  own rows.
- Output head and loss: the last hidden states are all-gathered, each rank computes the
  logits of its vocabulary shard, and the cross entropy is assembled from three
  all-reduces over the group (each token's largest logit, its sum of exponentials, its
  target's logit; ``VocabParallelCrossEntropy``). Each rank reports its own tokens' mean
  loss, and starts its backward from the sum of the group's per-rank means: the others'
  losses depend on its vocabulary shard too, and their backward reaches only theirs
  (``DenseModel.loss``). The cross entropy's backward needs no communication; the
  all-gather's backward is a reduce-scatter.

Without sequence parallelism (``parallelism.sequence_parallel = false``) the group's
rows are replicated on every member inside the blocks (Megatron's f and g: ``EnterShard``
before a sharded layer, ``SumPartials`` after it), gathered from the MoE layers' own
rows (``ToReplicated``) and handed back to them (``FromReplicated``).

``testbed.policy.tensor_parallel_ops`` plans these collectives; the simulator times them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split by vocabulary over a tensor-parallel group.

    ``logits`` [N, V/t] (this rank's columns, vocabulary ids ``lo .. lo + V/t - 1``),
    ``targets`` [N] (global ids); returns [N] losses in fp32, the same on every member."""

    @staticmethod
    def forward(ctx, logits, targets, lo: int, comm, members, group):
        x = logits.float()
        top = x.max(dim=1).values
        comm.all_reduce(top, members, group, reduce_op=dist.ReduceOp.MAX)
        exp = torch.exp(x - top[:, None])
        total = exp.sum(dim=1)
        mine = (targets >= lo) & (targets < lo + x.shape[1])
        local = torch.where(mine, targets - lo, torch.zeros_like(targets))
        target_logit = torch.where(mine, x.gather(1, local[:, None]).squeeze(1), torch.zeros_like(top))
        comm.all_reduce(total, members, group)
        comm.all_reduce(target_logit, members, group)
        ctx.save_for_backward(exp, total, mine, local)
        ctx.dtype = logits.dtype
        return torch.log(total) + top - target_logit

    @staticmethod
    def backward(ctx, grad):
        exp, total, mine, local = ctx.saved_tensors
        softmax = exp / total[:, None]
        rows = torch.arange(len(local), device=local.device)
        softmax[rows[mine], local[mine]] -= 1.0  # minus the one-hot of the target, where it is in this shard
        return (softmax * grad[:, None]).to(ctx.dtype), None, None, None, None, None


def shard(full: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` equal slices of ``full`` along ``dim``, as its own tensor."""
    size = full.shape[dim] // parts
    return full.narrow(dim, index * size, size).contiguous()


class ToReplicated(torch.autograd.Function):
    """Each member's own rows [T, ...] into the group's rows [t T, ...] on every member
    (an all-gather); backward: the replicated gradient is the true one, so each member
    keeps its own rows of it (no communication). Without sequence parallelism."""

    @staticmethod
    def forward(ctx, x, comm, members, group, index: int):
        ctx.rows, ctx.index = x.shape[0], index
        return comm.all_gather(x.contiguous(), members, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.index * ctx.rows:(ctx.index + 1) * ctx.rows].contiguous(), None, None, None, None


class FromReplicated(torch.autograd.Function):
    """This member's own rows of the group's replicated rows (no communication);
    backward: every member's gradient of its own rows, gathered into the replicated one."""

    @staticmethod
    def forward(ctx, x, comm, members, group, index: int):
        ctx.args = (comm, members, group)
        rows = x.shape[0] // len(members)
        return x[index * rows:(index + 1) * rows].contiguous()

    @staticmethod
    def backward(ctx, grad):
        comm, members, group = ctx.args
        return comm.all_gather(grad.contiguous(), members, group), None, None, None, None


class SumPartials(torch.autograd.Function):
    """Megatron's g: the members' partial outputs summed (an all-reduce); backward: the
    gradient as it is (every member holds all of it)."""

    @staticmethod
    def forward(ctx, x, comm, members, group):
        out = x.contiguous().clone()
        comm.all_reduce(out, members, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class EnterShard(torch.autograd.Function):
    """Megatron's f: replicated rows into this member's shard of a layer (no
    communication); backward: the members' partial input gradients summed (an all-reduce)."""

    @staticmethod
    def forward(ctx, x, comm, members, group):
        ctx.args = (comm, members, group)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        comm, members, group = ctx.args
        out = grad.contiguous().clone()
        comm.all_reduce(out, members, group)
        return out, None, None, None
