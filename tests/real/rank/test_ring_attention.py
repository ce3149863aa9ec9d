"""Ring attention (``real.rank.context_parallel``, issue 25 item 2) computes what causal
attention over the whole sequence does, and sends what Transformer Engine's p2p ring
sends (``testbed.policy.context_parallel``).

In one process: each of the CP ranks runs in a thread, and the ring's exchanges go through
mailboxes (one per receiver, sender and direction) instead of gloo; the whole real backend
runs it over gloo in tests/test_context_parallel_cross_backend.py. Each rank holds chunks r
and 2 CP - 1 - r of every sequence; its outputs and its q, k, v gradients are compared
with ``torch.nn.functional.scaled_dot_product_attention`` on the whole sequences and
autograd, at the float bound of tests/conftest.py (n: a row's softmax over the sequence's
keys and the head dimension, s x d)."""

import queue
import threading

import pytest
import torch
import torch.nn.functional as F

from real.comm.context_parallel import Ring
from real.rank.attention import rope
from real.rank.context_parallel import RingAttention, rope_at
from testbed.policy.context_parallel import backward_send_blocks, local_positions


class MailboxRing(Ring):
    """A ring whose exchanges go through ``boxes`` (threads for ranks); ``sent`` records
    (direction, elements) of every send."""

    def __init__(self, cp: int, index: int, boxes: dict):
        super().__init__(tuple(range(cp)), index, comm=None)
        self.boxes, self.sent = boxes, []

    def exchange(self, send, forward: bool):
        dst, src = (self.neighbour(1), self.neighbour(-1)) if forward else (self.neighbour(-1), self.neighbour(1))
        self.sent.append(("forward" if forward else "backward", send.numel()))
        self.boxes[(dst, self.rank, forward)].put(send.clone())
        box = self.boxes[(self.rank, src, forward)]

        class Pending:
            def wait(self):
                return box.get(timeout=60)

        return Pending()


def ring_run(q, k, v, grad, cp):
    """Every CP rank's (output, dq, dk, dv) on its rows, and each rank's sends."""
    s = q.shape[2]
    boxes = {(a, b, f): queue.Queue() for a in range(cp) for b in range(cp) for f in (True, False)}
    rings = [MailboxRing(cp, r, boxes) for r in range(cp)]
    results, errors = [None] * cp, []

    def rank(r):
        try:
            pos = torch.from_numpy(local_positions(r, cp, s))
            mine = [x[:, :, pos].detach().clone().requires_grad_() for x in (q, k, v)]
            out = RingAttention.apply(*mine, rings[r])
            out.backward(grad[:, :, pos])
            results[r] = (out.detach(), *(x.grad for x in mine), pos)
        except Exception as err:  # surfaced in the main thread
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results, [ring.sent for ring in rings]


@pytest.mark.parametrize("cp, heads, kv_heads, dq, dv", [(2, 4, 2, 8, 8), (3, 4, 1, 8, 8), (4, 4, 4, 12, 8)])
def test_the_ring_computes_causal_attention_over_the_whole_sequence(float_bound, cp, heads, kv_heads, dq, dv):
    """Grouped-query (kv_heads < heads) and MLA-shaped (keys wider than values) heads, CP
    2, 3 and 4 (4: every step kind of the backward, the block alone, the block with its
    partial gradients, the gradients alone)."""
    g = torch.Generator().manual_seed(cp)
    b, s = 2, 2 * cp * 3
    q = torch.randn(b, heads, s, dq, generator=g, requires_grad=True)
    k = torch.randn(b, kv_heads, s, dq, generator=g, requires_grad=True)
    v = torch.randn(b, kv_heads, s, dv, generator=g, requires_grad=True)
    grad = torch.randn(b, heads, s, dv, generator=g)
    group = heads // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          is_causal=True)
    want.backward(grad)
    results, sent = ring_run(q, k, v, grad, cp)
    n = s * dq
    for r, (out, dq_r, dk_r, dv_r, pos) in enumerate(results):
        float_bound.assert_close(out, want.detach()[:, :, pos], n, msg=f"rank {r} output")
        float_bound.assert_close(dq_r, q.grad[:, :, pos], n, msg=f"rank {r} dq")
        float_bound.assert_close(dk_r, k.grad[:, :, pos], n, msg=f"rank {r} dk")
        float_bound.assert_close(dv_r, v.grad[:, :, pos], n, msg=f"rank {r} dv")
    block = b * kv_heads * (s // cp) * (dq + dv)  # K and V of a rank's rows, elements
    for r in range(cp):
        assert sent[r] == [("forward", block)] * (cp - 1) + [("backward", k * block) for k in backward_send_blocks(cp)]


def test_rope_at_positions_is_the_rope_of_the_whole_sequence():
    """MLA under CP rotates each row by its position in its sequence: a rank's rows of
    rope(whole) are rope_at(its rows, their positions)."""
    x = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(0))
    pos = torch.from_numpy(local_positions(1, 4, 16))
    torch.testing.assert_close(rope_at(x[:, :, pos], pos), rope(x)[:, :, pos], rtol=0, atol=0)
