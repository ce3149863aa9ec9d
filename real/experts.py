"""Expert FFN compute on rows grouped by expert, and the per-rank math around it.

Tensor suffixes: T tokens, H hidden, F ffn, K top-k, R rows (kept slots), E experts.
An expert's weights are a flat vector: w1 (H x F) then w2 (F x H); y = gelu(x w1) w2.

``source_slots`` and ``combine_slots`` are the token-side halves of an MoE layer: which
kept (token, slot) pairs leave a rank, in source order (expert, token, slot), and how
their outputs come back weighted by the router probability. The distributed layer and
the single-process reference both use them; only what happens in between differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_flat(flat: torch.Tensor, hidden: int, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1_HF, w2_FH) views of an expert's flat weight vector."""
    return flat[: hidden * ffn].view(hidden, ffn), flat[hidden * ffn:].view(ffn, hidden)


def expert_ffn(x_RH: torch.Tensor, counts: list[int], flats: list[torch.Tensor | None],
               hidden: int, ffn: int) -> torch.Tensor:
    """Rows ``x_RH`` grouped by expert (``counts`` rows each) through each expert's FFN.

    On CUDA with bf16 weights the experts run as one grouped GEMM (``torch._grouped_mm``)
    when the build has it; elsewhere a loop of per-expert matmuls (same result within
    the dtype's tolerance).
    """
    if sum(counts) == 0:
        return x_RH.new_zeros((0, hidden))
    used = [(n, f) for n, f in zip(counts, flats) if n > 0]
    if _grouped_ok(x_RH, used):
        return _grouped(x_RH, used, hidden, ffn)
    out, start = [], 0
    for n, flat in used:
        w1, w2 = split_flat(flat, hidden, ffn)
        out.append(F.gelu(x_RH[start:start + n] @ w1) @ w2)
        start += n
    return torch.cat(out)


class PagedExpertFFN(torch.autograd.Function):
    """Expert FFN whose weights are read from the paged store in the forward *and* again
    in the backward, so no weight copy lives between the two (the pages may even have
    left the device and come back). Weight gradients are added to ``grads[instance]``."""

    @staticmethod
    def forward(ctx, x_RH, read, instances, counts, hidden, ffn, grads):
        flats = [read(i) if n > 0 else None for i, n in zip(instances, counts)]
        out, start, pre = [], 0, []
        for n, flat in zip(counts, flats):
            if n == 0:
                continue
            w1, w2 = split_flat(flat, hidden, ffn)
            a = x_RH[start:start + n] @ w1
            pre.append(a)
            out.append(F.gelu(a) @ w2)
            start += n
        ctx.save_for_backward(x_RH, *pre)
        ctx.args = (read, instances, counts, hidden, ffn, grads)
        return torch.cat(out) if out else x_RH.new_zeros((0, hidden))

    @staticmethod
    def backward(ctx, dy_RH):
        x_RH, *pre = ctx.saved_tensors
        read, instances, counts, hidden, ffn, grads = ctx.args
        dx, start, k = [], 0, 0
        for inst, n in zip(instances, counts):
            if n == 0:
                continue
            w1, w2 = split_flat(read(inst), hidden, ffn)
            x, a, dy = x_RH[start:start + n], pre[k], dy_RH[start:start + n]
            h = F.gelu(a)
            da = torch.ops.aten.gelu_backward(dy @ w2.t(), a)
            g = torch.cat([(x.t() @ da).reshape(-1), (h.t() @ dy).reshape(-1)])
            grads[inst] = grads[inst] + g if inst in grads else g
            dx.append(da @ w1.t())
            start += n
            k += 1
        return (torch.cat(dx) if dx else torch.zeros_like(x_RH)), None, None, None, None, None, None


def _grouped_ok(x_RH, used) -> bool:
    return (x_RH.is_cuda and x_RH.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and all(n % 16 == 0 for n, _ in used[:-1]))


def _grouped(x_RH, used, hidden, ffn):
    w1 = torch.stack([split_flat(f, hidden, ffn)[0] for _, f in used])
    w2 = torch.stack([split_flat(f, hidden, ffn)[1] for _, f in used])
    offs = torch.cumsum(torch.tensor([n for n, _ in used], device=x_RH.device), 0).to(torch.int32)
    h = F.gelu(torch._grouped_mm(x_RH, w1, offs=offs))
    return torch._grouped_mm(h, w2, offs=offs)


def source_slots(experts_TK: torch.Tensor, keep_TK: torch.Tensor) -> torch.Tensor:
    """Flat (token * K + slot) indices of kept slots in source order: (expert, token, slot)."""
    flat_e = experts_TK.reshape(-1)
    idx = torch.nonzero(keep_TK.reshape(-1)).squeeze(1)
    return idx[torch.argsort(flat_e[idx], stable=True)]


def combine_slots(y_RH: torch.Tensor, slot_idx: torch.Tensor, probs_TK: torch.Tensor, tokens: int) -> torch.Tensor:
    """Sum of each token's expert outputs weighted by their router probability -> [T, H].
    Dropped slots add nothing (the residual carries the token)."""
    k = probs_TK.shape[1]
    w_R = probs_TK.reshape(-1)[slot_idx].to(y_RH.dtype)
    out = y_RH.new_zeros((tokens, y_RH.shape[1]))
    return out.index_add(0, slot_idx // k, y_RH * w_R[:, None])
