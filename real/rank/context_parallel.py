"""Ring attention on the real backend's CPU ranks (``parallelism.cp_size`` CP > 1): the
attention sublayers of ``real.rank.attention`` with their core run as Transformer Engine's
``AttnFuncWithCPAndKVP2P`` runs it (``testbed.policy.context_parallel``: the chunk split,
the ring's steps and what each sends; TE commit d0067d0da6cb01811b8072a7d304f0e00344ce2b).

The rank's rows are b local sequences of L = seq_len / CP rows each (its CP rank's: with
tensor parallelism its TP group's, gathered), each holding chunk r and chunk 2 CP - 1 - r
of a sequence (c = L / 2 rows each), r the rank's CP index, so local order is position
order.

**Forward.** Step i (0 .. CP - 1) attends the rank's queries to the keys and values of CP
index r - i while the block travels on (``real.comm.context_parallel.Ring.exchange``: sent
to r + 1, the next received from r - 1): step 0 its own block, causally (the diagonal);
a block of a lower CP index, all queries to its first chunk (the second lies after every
query of the rank); of a higher one, the second chunk's queries to all of it (the first
chunk's queries lie before it). The partial results are merged by the online softmax
(running max, sum and weighted values in fp32; Milakov and Gimelshein 2018, as flash
attention does), giving the output and each query's log-sum-exp.

**Backward.** The forward keeps its queries, own keys and values, output, log-sum-exp and
the last block it received (CP index r + 1). Step i holds the block of CP index r + i + 1
(the last step its own), computes its queries' share of dQ and of that block's dK, dV from
the kept log-sum-exp (P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d)), and adds the partial dK, dV received for the
block, sending to r - 1 and receiving from r + 1: step 0 the block, steps 1 .. CP - 2 the
block and the partial gradients as one message, step CP - 1 the gradients alone. After the
last step the rank holds its own block's dK, dV summed over the group.

Grouped-query attention exchanges the rank's ``kv_heads`` heads, each serving its n / k
query heads; MLA exchanges the up-projected K (its shared RoPE key expanded over the heads)
and V (``testbed.policy.context_parallel``: what Megatron-Core's MLA hands TE), its RoPE
rotated by each row's position in its sequence (``rope_at``). The core runs in fp32; what
travels is in the model dtype.
"""

from __future__ import annotations

import math

import torch

from real.comm.context_parallel import Ring
from real.rank.attention import ROPE_THETA, Attention
from testbed.policy.context_parallel import cp_group_of, local_positions
from testbed.scenario.scenario import Scenario


def context_ring(scenario: Scenario, rank: int, comm) -> Ring | None:
    """``rank``'s ring with context parallelism on the whole transformer, else None."""
    if scenario.parallelism.cp_size == 1 or not scenario.transformer.enabled:
        return None
    members = cp_group_of(scenario, rank)
    return Ring(members, members.index(rank), comm)


def rope_at(x: torch.Tensor, positions: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """x [..., s, d] rotated at ``positions`` [s] (``real.rank.attention.rope``'s rotate-half
    form, at each row's position in its sequence rather than its index)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angle = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(x.dtype), torch.cat([angle.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _section(own: int, other: int, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the rank of CP index ``own`` against the block of
    CP index ``other`` (module doc)."""
    if other == own:
        return slice(None), slice(None), True
    if other < own:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _expand(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _reduce(x: torch.Tensor, group: int) -> torch.Tensor:
    """A gradient of expanded heads summed back over each key/value head's query heads."""
    if group == 1:
        return x
    b, n, s, d = x.shape
    return x.view(b, n // group, group, s, d).sum(2)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    """softmax(Q K^T / sqrt(d_qk)) V under the causal mask over the ring (module doc).
    q [b, n, L, d_qk], k [b, k, L, d_qk], v [b, k, L, d_v] this rank's (k divides n)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        cp, r = ring.size, ring.index
        b, n, L, dq = q.shape
        group, c, scale = n // k.shape[1], L // 2, 1.0 / math.sqrt(dq)
        qf = q.float()
        top = torch.full((b, n, L), float("-inf"), device=q.device)  # running max of each query's scores
        total = torch.zeros(b, n, L, device=q.device)  # running sum of their exponentials
        acc = torch.zeros(b, n, L, v.shape[-1], device=q.device)  # running weighted values
        split = k.numel()
        block = torch.cat([k.reshape(-1), v.reshape(-1)])
        for i in range(cp):
            pending = ring.exchange(block, forward=True) if i < cp - 1 else None
            kk = block[:split].view(k.shape).float()
            vv = block[split:].view(v.shape).float()
            rows, keys, causal = _section(r, (r - i) % cp, c)
            s = _scores(qf[:, :, rows], _expand(kk[:, :, keys], group), causal, scale)
            old = top[:, :, rows]
            new = torch.maximum(old, s.amax(-1))  # step 0, the diagonal, gives every query a key
            alpha, p = torch.exp(old - new), torch.exp(s - new[..., None])
            total[:, :, rows] = total[:, :, rows] * alpha + p.sum(-1)
            acc[:, :, rows] = acc[:, :, rows] * alpha[..., None] + p @ _expand(vv[:, :, keys], group)
            top[:, :, rows] = new
            if pending is not None:
                block = pending.wait()
        out = acc / total[..., None]
        ctx.save_for_backward(q, out, top + torch.log(total), block)  # block: the last received, CP index r + 1
        ctx.ring, ctx.shapes = ring, (k.shape, v.shape)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, last = ctx.saved_tensors
        ring = ctx.ring
        k_shape, v_shape = ctx.shapes
        cp, r = ring.size, ring.index
        n, L, dq_dim = q.shape[1:]
        group, c, scale = n // k_shape[1], L // 2, 1.0 / math.sqrt(dq_dim)
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1)  # rowsum(dO O)
        dq = torch.zeros_like(qf)
        split, size = math.prod(k_shape), last.numel()
        block, partial = last, None  # the block held, and the partial dK dV for it after this step
        for i in range(cp):
            if i == 0:
                pending = ring.exchange(block, forward=False)
            elif i < cp - 1:
                pending = ring.exchange(torch.cat([block, partial]), forward=False)
            else:
                pending = ring.exchange(partial, forward=False)
            kk = block[:split].view(k_shape).float()
            vv = block[split:].view(v_shape).float()
            rows, keys, causal = _section(r, (r + i + 1) % cp, c)
            k_e, v_e = _expand(kk[:, :, keys], group), _expand(vv[:, :, keys], group)
            p = torch.exp(_scores(qf[:, :, rows], k_e, causal, scale) - lse[:, :, rows, None])
            ds = p * (do[:, :, rows] @ v_e.transpose(-1, -2) - delta[:, :, rows, None])
            dq[:, :, rows] += (ds @ k_e) * scale
            dk, dv = torch.zeros(k_shape, device=q.device), torch.zeros(v_shape, device=q.device)
            dk[:, :, keys] = _reduce((ds.transpose(-1, -2) @ qf[:, :, rows]) * scale, group)
            dv[:, :, keys] = _reduce(p.transpose(-1, -2) @ do[:, :, rows], group)
            mine = torch.cat([dk.reshape(-1), dv.reshape(-1)])
            received = pending.wait()
            if i == 0:
                block, partial = received, mine.to(last.dtype)
            elif i < cp - 1:
                block = received[:size]
                partial = (received[size:].float() + mine).to(last.dtype)
            else:
                partial = (received.float() + mine).to(last.dtype)
        dk = partial[:split].view(k_shape)
        dv = partial[split:].view(v_shape)
        return dq.to(q.dtype), dk, dv, None


class ContextParallelAttention(Attention):
    """``real.rank.attention.Attention`` with its core as the ring (module doc): the same
    weights and projections; ``ring`` this rank's context-parallel ring."""

    def __init__(self, t, hidden: int, heads: int, kv_heads: int, seq_len: int, ring: Ring):
        super().__init__(t, hidden, heads, kv_heads, seq_len)
        self.ring = ring
        self.local_len = seq_len // ring.size  # rows of a sequence on this CP rank
        self.positions = torch.from_numpy(local_positions(ring.index, ring.size, seq_len))

    def _gqa(self, x_TH, w):
        T, n, d = x_TH.shape[0], self.heads, self.head_dim
        q, kk, v = self._gqa_qkv(x_TH, w, self.local_len)  # the ring sends the k key-value heads
        out = RingAttention.apply(q, kk, v, self.ring)
        return out.transpose(1, 2).reshape(T, n * d) @ w["wo"]

    def _mla(self, x_TH, w):
        T, n, dv = x_TH.shape[0], self.heads, self.t.v_head_dim
        pos = self.positions.to(x_TH.device)  # RoPE at each row's position in its sequence
        q, key, v = self._mla_qkv(x_TH, w, self.local_len, lambda y: rope_at(y, pos))
        out = RingAttention.apply(q, key, v.contiguous(), self.ring)  # K expanded over the heads: what travels
        return out.transpose(1, 2).reshape(T, n * dv) @ w["wo"]
