"""Expert FFN compute on rows grouped by expert, and the per-rank math around it.

Tensor suffixes: T tokens, H hidden, F ffn, W the input matrix's columns (F, or 2 F
for SwiGLU), K top-k, R rows (kept slots), E experts, G experts of one grouped GEMM. An
expert's weights are a flat vector: w1 (H x W) then w2 (F x H); y = act(x w1) w2, the
activation gelu or SwiGLU (``model.ffn_activation``: ``real.kernels.ffn_activation``, whose
``swiglu`` flag every function here takes).

Two kernels compute the same thing (M22's grouped GEMM):
- *grouped*: one ``torch._grouped_mm`` per matrix for all experts, forward and backward
  (weight gradients as the 2-D x 2-D grouped form, offsets on the contracted rows).
  Groups are padded with zero rows to multiples of ``ALIGN_ROWS`` so every group starts
  16-byte aligned; zero rows add nothing to any gradient. Used on CUDA with bf16, on
  the GPUs where torch runs it as one kernel (``GROUPED_MM_MAJORS``: sm90, sm100).
- *loop*: one matmul pair per expert, everywhere else (and on CPU it is bit-identical to
  the single-process reference, which the equivalence tests rely on).

``source_slots`` and ``combine_slots`` are the token-side halves of an MoE layer: which
kept (token, slot) pairs leave a rank, in source order (expert, token, slot), and how
their outputs come back weighted by the router probability. The distributed layer and
the single-process reference both use them; only what happens in between differs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Protocol

import torch

from real.kernels.ffn_activation import activation, activation_backward, input_width, split_ffn
from real.kernels.page_pipeline import blocked_ffn, grouped_blocked
from real.kernels.stacked_weights import StackedWeights, grouped_members, staged

ALIGN_ROWS = 16
DROPPED_SHIFT = 2**40  # source_slots: above any expert index, so dropped slots sort behind every kept one


def split_flat(flat: torch.Tensor, hidden: int, ffn: int, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1_HW, w2_FH) views of an expert's flat weight vector."""
    return split_ffn(flat, hidden, ffn, swiglu)


def split_stacked(w_GX: torch.Tensor, hidden: int, ffn: int,
                  swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1_GHW, w2_GFH) views of G stacked flat weight vectors [G, (W + F) H]."""
    g, cut = w_GX.shape[0], hidden * input_width(ffn, swiglu)
    return w_GX[:, :cut].view(g, hidden, -1), w_GX[:, cut:].view(g, ffn, hidden)


#: GPU architectures (compute capability major) on which ``torch._grouped_mm`` runs its
#: grouped kernel for bf16: sm90 (Hopper; torch 2.8 refuses every other GPU with an error)
#: and sm100 (Blackwell, from torch 2.9). Elsewhere torch >= 2.9 falls back to a loop of
#: matmuls that reads the group offsets back to the host (pytorch/pytorch#161407): no
#: faster than the per-expert loop, which is used instead.
GROUPED_MM_MAJORS = (9, 10)


def grouped_supported(device: torch.device, dtype: torch.dtype, hidden: int, ffn: int) -> bool:
    """Whether the grouped kernel runs here: CUDA on a GPU of ``GROUPED_MM_MAJORS``, bf16,
    a torch with ``_grouped_mm`` and rows of H and F elements that are whole 16-byte units
    (the kernel's stride rule); elsewhere the per-expert loop (module doc)."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and hidden % 8 == 0 and ffn % 8 == 0
            and torch.cuda.get_device_capability(device)[0] in GROUPED_MM_MAJORS)


class ExpertTimer:
    """Seconds of expert kernels per expert instance (M18's measured compute heat).

    CPU: ``perf_counter`` around each expert's GEMMs, which run synchronously. CUDA:
    events around them, resolved in ``collect`` once the step has synchronised. A grouped
    GEMM is one kernel for all its experts: its time is shared in proportion to rows.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.seconds: dict[int, float] = defaultdict(float)
        self._pending: list = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, started, shares: list[tuple[int, float]]) -> None:
        """Charge the time since ``started`` to instances by ``shares`` (fractions summing to 1)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((started, end, shares))
            return
        dt = time.perf_counter() - started
        for inst, w in shares:
            self.seconds[inst] += dt * w

    def collect(self) -> dict[int, float]:
        """Seconds per instance since the last ``collect`` (the device must be synchronised)."""
        for start, end, shares in self._pending:
            dt = start.elapsed_time(end) * 1e-3
            for inst, w in shares:
                self.seconds[inst] += dt * w
        self._pending = []
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def _row_shares(instances, counts) -> list[tuple[int, float]]:
    total = sum(counts)
    return [(i, n / total) for i, n in zip(instances, counts)] if total else []


def _start(timer):
    return timer.start() if timer is not None else None


def _stop(timer, started, shares) -> None:
    if timer is not None:
        timer.stop(started, shares)


# ---- the grouped kernel ----------------------------------------------------------------------
class GroupLayout:
    """Rows of G groups padded to multiples of ``ALIGN_ROWS``: ``dest[r]`` is the padded
    row of input row r (None when no padding is needed), ``offs`` the int32 group ends."""

    def __init__(self, counts: list[int], device: torch.device):
        padded = [-(-n // ALIGN_ROWS) * ALIGN_ROWS for n in counts]
        self.rows = sum(counts)
        if padded == list(counts):
            self.dest = None
            ends = counts
        else:
            starts = [sum(padded[:k]) for k in range(len(padded))]
            self.dest = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)]).to(device)
            ends = padded
        self.padded_rows = sum(ends)
        self.offs = torch.tensor(ends, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)

    def pad(self, x_RX: torch.Tensor) -> torch.Tensor:
        if self.dest is None:
            return x_RX.contiguous()
        return x_RX.new_zeros((self.padded_rows, x_RX.shape[1])).index_copy_(0, self.dest, x_RX)

    def unpad(self, x_PX: torch.Tensor) -> torch.Tensor:
        return x_PX if self.dest is None else x_PX.index_select(0, self.dest)


def grouped_forward(x_RH, w_GX, layout: GroupLayout, hidden: int, ffn: int, swiglu: bool = False):
    """(y_RH, xp_PH, a_PW): the output and what the backward needs (padded rows)."""
    w1, w2 = split_stacked(w_GX, hidden, ffn, swiglu)
    xp = layout.pad(x_RH)
    a = torch._grouped_mm(xp, w1, offs=layout.offs)
    y = torch._grouped_mm(activation(a, swiglu), w2, offs=layout.offs)
    return layout.unpad(y), xp, a


def grouped_backward(dy_RH, xp_PH, a_PW, w_GX, layout: GroupLayout, hidden: int, ffn: int, swiglu: bool = False):
    """(dx_RH, dw_GX): the input gradient and each group's flat weight gradient."""
    w1, w2 = split_stacked(w_GX, hidden, ffn, swiglu)
    dyp = layout.pad(dy_RH)
    h = activation(a_PW, swiglu)
    da = activation_backward(torch._grouped_mm(dyp, w2.transpose(-2, -1), offs=layout.offs), a_PW, swiglu)
    dx = torch._grouped_mm(da, w1.transpose(-2, -1), offs=layout.offs)
    dw1 = torch._grouped_mm(xp_PH.t(), da, offs=layout.offs)  # [G, H, W]
    dw2 = torch._grouped_mm(h.t(), dyp, offs=layout.offs)  # [G, F, H]
    g = w_GX.shape[0]
    return layout.unpad(dx), torch.cat([dw1.reshape(g, -1), dw2.reshape(g, -1)], dim=1)


def grouped_forward_weights(x_RH, sw: StackedWeights, layout: GroupLayout, hidden: int, ffn: int, page_elems: int,
                            swiglu: bool = False):
    """``grouped_forward`` on stacked weights ``sw``, block by block as their pages
    arrive where ``sw.pipelined`` (M14, ``real.kernels.page_pipeline.grouped_blocked``)."""
    if not sw.pipelined:
        return grouped_forward(x_RH, sw.w_GX, layout, hidden, ffn, swiglu)
    w1, w2 = split_stacked(sw.w_GX, hidden, ffn, swiglu)
    xp = layout.pad(x_RH)
    y, a = grouped_blocked(xp, w1, w2, layout.offs, page_elems, sw.ready, swiglu)
    return layout.unpad(y), xp, a


class ExpertWeights(Protocol):
    """Where an expert FFN reads its weights (``real.rank.rank_state.RankState``; ``FlatWeights``)."""

    page_elems: int  # elements of a page (M14's block granularity)

    def compute_weights(self, instance: int) -> torch.Tensor:
        """An expert's flat weights, for reading."""

    def read_blocks(self, instance: int):
        """(start element, piece) of the weights to compute on as they arrive, or None (M14)."""

    def stacked_weights(self, instances: list[int], counts: list[int], may_pipeline: bool) -> StackedWeights:
        """The weights of one grouped GEMM (``real.kernels.stacked_weights``)."""


class FlatWeights:
    """``ExpertWeights`` over flat tensors by instance (tests, benchmarks): read in
    place, stacked by a copy, never pipelined."""

    def __init__(self, flats: dict[int, torch.Tensor]):
        self.flats = flats
        self.page_elems = max(f.numel() for f in flats.values())

    def compute_weights(self, instance: int) -> torch.Tensor:
        return self.flats[instance]

    def read_blocks(self, instance: int):
        return None

    def stacked_weights(self, instances, counts, may_pipeline):
        _, used = grouped_members(instances, counts)
        like = self.flats[used[0][0]]
        return staged(used, like.numel(), lambda i, out: out.copy_(self.flats[i]), like.dtype, like.device)


# ---- the autograd function ---------------------------------------------------------------------
class PagedExpertFFN(torch.autograd.Function):
    """Expert FFN whose weights are read from the paged store in the forward *and* again
    in the backward, so no weight copy lives between the two (the pages may even have
    left the device and come back). Weight gradients are added to ``grads[instance]``.

    ``weights`` (``ExpertWeights``) gives the weights; on CUDA reading them makes compute
    wait for those experts' pending page copies only. ``grouped`` picks the grouped
    kernel: its weights are stacked in place where the pages lie so, else copied
    (``real.kernels.stacked_weights``), and with M14 page pipelining it contracts block by block
    as the pages arrive. On the per-expert loop an expert whose pages are arriving
    (``weights.read_blocks``) is computed page by page (``real.kernels.page_pipeline``).
    ``timer`` (or None) times each expert (M18). ``swiglu``: the experts' activation
    (``real.kernels.ffn_activation``).

    What it keeps for the backward: its rows' input and the first GEMM's output ``a`` (the
    activation's input), never the activation's output, which the backward computes again
    from ``a`` on both kernels. That is what Megatron-Core's ``moe_act`` recompute does
    (``transformer.recompute_modules``; experts.py:269-276, the activation checkpointed
    without its output), so these experts always run as with ``moe_act`` and naming it frees
    nothing more here (``real.rank.recompute``).
    """

    @staticmethod
    def forward(ctx, x_RH, weights, instances, counts, hidden, ffn, grads, timer=None, grouped=False, swiglu=False):
        used = [(i, n) for i, n in zip(instances, counts) if n > 0]
        ctx.args = (weights, instances, counts, used, hidden, ffn, grads, timer, grouped, swiglu)
        if not used:
            ctx.save_for_backward(x_RH)
            return x_RH.new_zeros((0, hidden))
        if grouped:
            sw = weights.stacked_weights(instances, counts, may_pipeline=True)
            layout = GroupLayout(sw.counts, x_RH.device)
            t = _start(timer)
            y, xp, a = grouped_forward_weights(x_RH, sw, layout, hidden, ffn, weights.page_elems, swiglu)
            _stop(timer, t, _row_shares(*zip(*sw.members)))
            ctx.layout = (sw.counts, layout)
            ctx.save_for_backward(xp, a)
            return y
        out, start, pre = [], 0, []
        for inst, n in used:
            blocks = weights.read_blocks(inst)
            t = _start(timer)
            if blocks is not None:  # M14: page by page as its pages arrive
                y, a = blocked_ffn(x_RH[start:start + n], blocks, hidden, ffn, swiglu)
            else:
                w1, w2 = split_flat(weights.compute_weights(inst), hidden, ffn, swiglu)
                a = x_RH[start:start + n] @ w1
                y = activation(a, swiglu) @ w2
            pre.append(a)
            out.append(y)
            _stop(timer, t, [(inst, 1.0)])
            start += n
        ctx.save_for_backward(x_RH, *pre)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, dy_RH):
        weights, instances, counts, used, hidden, ffn, grads, timer, grouped, swiglu = ctx.args
        none = (None,) * 9
        if not used:
            (x_RH,) = ctx.saved_tensors
            return (torch.zeros_like(x_RH),) + none
        if grouped:
            xp, a = ctx.saved_tensors
            sw = weights.stacked_weights(instances, counts, may_pipeline=False)
            # members with no rows pad to no rows: any member set gives the forward's padded rows
            fwd_counts, layout = ctx.layout
            layout = layout if sw.counts == fwd_counts else GroupLayout(sw.counts, xp.device)
            t = _start(timer)
            dx, dw = grouped_backward(dy_RH.contiguous(), xp, a, sw.w_GX, layout, hidden, ffn, swiglu)
            _stop(timer, t, _row_shares(*zip(*sw.members)))
            for k, (inst, n) in enumerate(sw.members):
                if n:
                    grads[inst] = grads[inst] + dw[k] if inst in grads else dw[k]
            return (dx,) + none
        x_RH, *pre = ctx.saved_tensors
        dx, start = [], 0
        for k, (inst, n) in enumerate(used):
            w1, w2 = split_flat(weights.compute_weights(inst), hidden, ffn, swiglu)
            t = _start(timer)
            x, a, dy = x_RH[start:start + n], pre[k], dy_RH[start:start + n]
            h = activation(a, swiglu)
            da = activation_backward(dy @ w2.t(), a, swiglu)
            g = torch.cat([(x.t() @ da).reshape(-1), (h.t() @ dy).reshape(-1)])
            dx.append(da @ w1.t())
            _stop(timer, t, [(inst, 1.0)])
            grads[inst] = grads[inst] + g if inst in grads else g
            start += n
        return (torch.cat(dx),) + none


def expert_ffn(x_RH: torch.Tensor, counts: list[int], flats: list[torch.Tensor | None],
               hidden: int, ffn: int, grouped: bool | None = None, swiglu: bool = False) -> torch.Tensor:
    """Rows ``x_RH`` grouped by expert (``counts`` rows each) through each expert's FFN,
    without autograd bookkeeping (benchmarks). ``grouped`` None: where supported."""
    used = [(n, f) for n, f in zip(counts, flats) if n > 0]
    if not used:
        return x_RH.new_zeros((0, hidden))
    if grouped is None:
        grouped = grouped_supported(x_RH.device, x_RH.dtype, hidden, ffn)
    if grouped:
        w = torch.stack([f for _, f in used])
        y, _, _ = grouped_forward(x_RH, w, GroupLayout([n for n, _ in used], x_RH.device), hidden, ffn, swiglu)
        return y
    out, start = [], 0
    for n, flat in used:
        w1, w2 = split_flat(flat, hidden, ffn, swiglu)
        out.append(activation(x_RH[start:start + n] @ w1, swiglu) @ w2)
        start += n
    return torch.cat(out)


def source_slots(experts_TK: torch.Tensor, keep_TK: torch.Tensor, kept: int | None = None) -> torch.Tensor:
    """Flat (token * K + slot) indices of kept slots in source order: (expert, token, slot).
    ``kept``: how many slots are kept, when the caller knows (the hot path: then nothing
    is read back from the device, where ``nonzero`` would wait for the data)."""
    flat_e = experts_TK.reshape(-1)
    if kept is None:
        idx = torch.nonzero(keep_TK.reshape(-1)).squeeze(1)
        return idx[torch.argsort(flat_e[idx], stable=True)]
    dropped = ~keep_TK.reshape(-1)  # after every kept slot, in the same (expert, token, slot) order
    order = torch.argsort(flat_e + dropped.to(flat_e.dtype) * DROPPED_SHIFT, stable=True)
    return order[:kept]


def combine_slots(y_RH: torch.Tensor, slot_idx: torch.Tensor, probs_TK: torch.Tensor, tokens: int) -> torch.Tensor:
    """Sum of each token's expert outputs weighted by their router probability -> [T, H].
    Dropped slots add nothing (the residual carries the token)."""
    k = probs_TK.shape[1]
    w_R = probs_TK.reshape(-1)[slot_idx].to(y_RH.dtype)
    out = y_RH.new_zeros((tokens, y_RH.shape[1]))
    return out.index_add(0, slot_idx // k, y_RH * w_R[:, None])
