"""DeepEP's normal dispatch and combine on real ranks (``comm.token_strategy = "deepep"``, M7).

What moves, and the bytes of every message, is ``testbed.policy.deepep``'s: a token goes
once to each destination node, to this rank's rail peer there (the *hop*, along the
rank's grid column), which forwards it to each member of its node holding one of the
token's experts (the *forward*, along the grid row); each row carries the token, its K
expert indices and K probabilities masked to the receiver's experts. The expert member
applies its experts, weights their outputs by the probabilities and sums them per
token row; the combine sends those sums back the way they came, the forwarder adding
its node's before the hop back, the source adding its nodes'.

Both hops are gloo (or NCCL) point-to-point messages (``all_to_all_p2p``: every receive
posted, then every send), one send/receive phase after the other: the forwarder needs
the hop's rows before it forwards them (DeepEP pipelines chunks of them on a GPU; the
planner's ops say so, and the simulator times them overlapped). Split sizes come from
the fanout every member shares first (``fanout_row``, all-gathered: DeepEP's notify).
Every send is counted into the rank's ledger as it leaves, from the tensors passed.

Autograd: the exchanges of tokens and probabilities are differentiable, their backward
the same messages the other way (the dispatch_backward's token and probability
gradients, the combine_backward's output gradients). With FP8 payloads (M22) the
dispatch's tokens and the combine_backward's output gradients travel as float8 e4m3
(``PayloadCodec``), the combine's sums and the dispatch_backward's gradients at the
model dtype: DeepEP's fp8 dispatch and bf16 combine. The experts see their rows in the
*expert layout* (expert, source member, token), as every token strategy's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from real.comm.collectives import Comm, PayloadCodec, all_to_all_p2p
from testbed.policy.deepep import fanout_of_tokens, grid_positions, node_of_member
from testbed.scenario.topology import Layout


def send_rows(comm: Comm, x: torch.Tensor, send_splits, recv_splits, members, group) -> torch.Tensor:
    """Rows of ``x`` to each member of ``members`` (global ranks, group order) by
    ``send_splits``, as point-to-point messages; returns the rows received, by
    ``recv_splits``, in group order. Counts the rows sent to others into the ledger."""
    row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()
    dst = np.asarray(members, dtype=np.int64)
    nbytes = np.asarray(send_splits, dtype=np.int64) * row_bytes
    keep = (dst != comm.rank) & (nbytes > 0)
    comm.ledger.add_transfers(comm.stage_of(), np.full(int(keep.sum()), comm.rank), dst[keep], nbytes[keep])
    out = x.new_empty((int(sum(recv_splits)),) + tuple(x.shape[1:]))
    comm.largest_buffers = max(comm.largest_buffers, x.numel() * x.element_size() + out.numel() * out.element_size())
    peers = [comm.global_rank(m) for m in members]
    all_to_all_p2p(out, x.contiguous(), list(recv_splits), list(send_splits), peers, comm.global_rank(comm.rank), group)
    return out


def _coded(comm, x, send_splits, recv_splits, members, group, codec: PayloadCodec | None, scale: float):
    if codec is None:
        return send_rows(comm, x, send_splits, recv_splits, members, group)
    return codec.decode(send_rows(comm, codec.encode(x, scale), send_splits, recv_splits, members, group), x.dtype,
                        scale)


class SendRows(torch.autograd.Function):
    """Differentiable ``send_rows``: the backward sends the gradients back with the splits
    swapped. ``forward_codec`` compresses the rows, ``backward_codec`` their gradients
    (scaled by its ``grad_scale``); None: at their dtype."""

    @staticmethod
    def forward(ctx, x, comm: Comm, send_splits, recv_splits, members, group, forward_codec=None,
                backward_codec=None):
        ctx.args = (comm, send_splits, recv_splits, members, group, backward_codec)
        return _coded(comm, x, send_splits, recv_splits, members, group, forward_codec, 1.0)

    @staticmethod
    def backward(ctx, grad):
        comm, send_splits, recv_splits, members, group, codec = ctx.args
        scale = codec.grad_scale if codec is not None else 1.0
        back = _coded(comm, grad.contiguous(), recv_splits, send_splits, members, group, codec, scale)
        return back, None, None, None, None, None, None, None


def fanout_row(layout: Layout, grid: np.ndarray, experts_TK: torch.Tensor, keep_TK: torch.Tensor) -> np.ndarray:
    """This rank's fanout [P + A] (``testbed.policy.deepep.fanout_of_tokens``)."""
    return fanout_of_tokens(experts_TK.cpu().numpy(), keep_TK.cpu().numpy(), layout.experts_per_rank,
                            node_of_member(layout, grid))


@dataclass
class Hop:
    """One send/receive phase of the exchange as this rank sees it."""

    members: tuple[int, ...]  # global ranks, group order
    rows: torch.Tensor  # indices into the phase's input rows, in send order
    send: list[int]  # rows sent to each member
    recv: list[int]  # rows received from each member


class DeepEPExchange:
    """One rank's deepep dispatch of one layer, and the combine that undoes it.

    ``fanout`` [P, P + A]: every member's fanout, EP-index order; ``grid``: the EP
    group's (nodes x members per node) ranks; ``groups(members)``: the process group of
    a member set; ``codec``: FP8 payloads, or None."""

    def __init__(self, comm: Comm, layout: Layout, grid: np.ndarray, fanout: np.ndarray, groups, codec):
        self.comm, self.layout, self.grid, self.groups, self.codec = comm, layout, grid, groups, codec
        self.fanout = np.asarray(fanout, dtype=np.int64)
        self.pos = grid_positions(layout, grid)  # [A, B] EP indices
        a, b = np.argwhere(grid == comm.rank)[0]
        self.a, self.b = int(a), int(b)
        self.me = int(self.pos[self.a, self.b])
        p = layout.ep_size
        self.node_of = node_of_member(layout, grid)  # [P] grid row of each EP index
        self.col_of = np.empty(p, dtype=np.int64)  # [P] grid column of each EP index
        self.col_of[self.pos.reshape(-1)] = np.tile(np.arange(grid.shape[1]), grid.shape[0])

    def _exchange(self, hop: Hop, x, forward_codec=None, backward_codec=None):
        if len(hop.members) < 2:
            return x
        return SendRows.apply(x, self.comm, hop.send, hop.recv, hop.members, self.groups(hop.members),
                              forward_codec, backward_codec)

    def _indices(self, hop: Hop, idx):
        if len(hop.members) < 2:
            return idx
        return send_rows(self.comm, idx, hop.send, hop.recv, hop.members, self.groups(hop.members))

    @staticmethod
    def _hop(members, dest_of_row: torch.Tensor, parts: int, recv: list[int]) -> Hop:
        """Rows whose mask ``dest_of_row`` [R, parts] is set go to each part in turn."""
        rows = [torch.nonzero(dest_of_row[:, d]).squeeze(1) for d in range(parts)]
        return Hop(members, torch.cat(rows) if rows else dest_of_row.new_zeros(0, dtype=torch.long),
                   [len(r) for r in rows], recv)

    def dispatch(self, x_TH: torch.Tensor, experts_TK: torch.Tensor, keep_TK: torch.Tensor, probs_TK: torch.Tensor):
        """(expert_in [S, H] in expert layout, rows per local expert, combine: y [S, H] ->
        this rank's MoE output [T, H])."""
        lay, grid, pos, fan = self.layout, self.grid, self.pos, self.fanout
        a_nodes, b_cols = grid.shape
        p, n, dev = lay.ep_size, lay.experts_per_rank, x_TH.device
        node_of = torch.as_tensor(self.node_of, device=dev)
        col_of = torch.as_tensor(self.col_of, device=dev)
        none = torch.full_like(experts_TK, -1)
        # the hop: each token to every node holding one of its kept slots, to my column's member there
        node_TK = torch.where(keep_TK, node_of[experts_TK // n], none)
        column = tuple(int(r) for r in grid[:, self.b])
        hop = self._hop(column, torch.stack([(node_TK == a).any(1) for a in range(a_nodes)], 1), a_nodes,
                        [int(fan[pos[a, self.b], p + self.a]) for a in range(a_nodes)])
        dest = torch.repeat_interleave(torch.arange(a_nodes, device=dev), torch.as_tensor(hop.send, device=dev))
        mask = node_TK.index_select(0, hop.rows) == dest[:, None]
        idx1 = self._indices(hop, torch.where(mask, experts_TK.index_select(0, hop.rows), none[:1]).to(torch.int32))
        w1 = self._exchange(hop, probs_TK.index_select(0, hop.rows) * mask)
        x1 = self._exchange(hop, x_TH.index_select(0, hop.rows), forward_codec=self.codec)
        # the forward: each row to every member of my node holding one of its slots
        idx1 = idx1.long()
        col1 = torch.where(idx1 >= 0, col_of[idx1.clamp(min=0) // n], torch.full_like(idx1, -1))
        node = tuple(int(r) for r in grid[self.a])
        fwd = self._hop(node, torch.stack([(col1 == c).any(1) for c in range(b_cols)], 1), b_cols,
                        [int(fan[pos[:, c], self.me].sum()) for c in range(b_cols)])
        dest = torch.repeat_interleave(torch.arange(b_cols, device=dev), torch.as_tensor(fwd.send, device=dev))
        mask = col1.index_select(0, fwd.rows) == dest[:, None]
        idx2 = self._indices(fwd, torch.where(mask, idx1.index_select(0, fwd.rows), -1).to(torch.int32)).long()
        w2 = self._exchange(fwd, w1.index_select(0, fwd.rows) * mask)
        x2 = self._exchange(fwd, x1.index_select(0, fwd.rows), forward_codec=self.codec)
        # my slots in expert layout: (expert, source member, token); a forwarder's rows come by
        # source node, each source's in token order
        sources = pos.T.reshape(-1)  # (forwarder column, source node) order
        sizes = fan[sources, self.me]
        src_of_row = torch.repeat_interleave(torch.as_tensor(sources, device=dev), torch.as_tensor(sizes, device=dev))
        q, k = torch.nonzero(idx2 >= 0, as_tuple=True)
        local = idx2[q, k] - self.me * n
        rows = len(idx2)
        order = torch.argsort((local * p + src_of_row[q]) * max(rows, 1) + q)
        slot_q, slot_k, local = q[order], k[order], local[order]
        counts = torch.bincount(local, minlength=n).tolist()
        expert_in = x2.index_select(0, slot_q)
        w_slot = w2.reshape(-1).index_select(0, slot_q * w2.shape[1] + slot_k)
        tokens = x_TH.shape[0]

        def combine(y_RH: torch.Tensor) -> torch.Tensor:
            h = y_RH.shape[1]
            part2 = y_RH.new_zeros((rows, h)).index_add(0, slot_q, y_RH * w_slot[:, None].to(y_RH.dtype))
            back = self._exchange(_reversed(fwd), part2, backward_codec=self.codec)
            part1 = y_RH.new_zeros((len(x1), h)).index_add(0, fwd.rows, back)
            back = self._exchange(_reversed(hop), part1, backward_codec=self.codec)
            return y_RH.new_zeros((tokens, h)).index_add(0, hop.rows, back)

        return expert_in, counts, combine


def _reversed(hop: Hop) -> Hop:
    return Hop(hop.members, hop.rows, hop.recv, hop.send)
