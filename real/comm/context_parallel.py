"""The ring of a context-parallel group on the real backend (``parallelism.cp_size`` > 1,
``testbed.policy.context_parallel``): this rank's neighbours and the counted exchange of
one tensor with them, started at once and waited for later, so that the attention of the
block a rank holds runs while the next block travels (Transformer Engine's
``flash_attn_p2p_communicate``: an isend to one neighbour and an irecv from the other,
``torch.distributed.batch_isend_irecv``).

Each exchange counts the bytes this rank sends into its ledger under the clock's stage
(``dense`` in the forward, ``dense_backward`` in the backward), one p2p transfer to the
neighbour, as the planner's ``ContextParallelOps`` plans them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


class Pending:
    """An exchange under way: ``wait()`` returns the received tensor."""

    def __init__(self, works, received: torch.Tensor):
        self.works, self.received = works, received

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


@dataclass
class Ring:
    """This rank in its context-parallel group: ``members`` (the scenario's ranks, member j
    of CP index j), this rank at ``index``, and its counted collectives ``comm``
    (``real.comm.collectives.Comm``: the ledger, the clock's stage, the process group's
    numbering)."""

    members: tuple[int, ...]
    index: int
    comm: object

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        return self.members[self.index]

    def neighbour(self, shift: int) -> int:
        """The member ``shift`` places on around the ring (+1 the next, -1 the previous)."""
        return self.members[(self.index + shift) % self.size]

    def exchange(self, send: torch.Tensor, forward: bool) -> Pending:
        """Start sending ``send`` to the next member (``forward``; the backward: to the
        previous) and receiving a tensor of its shape and dtype from the other one; its
        bytes are counted now."""
        send = send.contiguous()
        dst, src = (self.neighbour(1), self.neighbour(-1)) if forward else (self.neighbour(-1), self.neighbour(1))
        comm = self.comm
        nbytes = send.numel() * send.element_size()
        comm.ledger.add_transfers(comm.stage_of(), np.array([self.rank]), np.array([dst]), np.array([nbytes]))
        comm.largest_buffers = max(comm.largest_buffers, 2 * nbytes)
        received = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, comm.global_rank(dst)),
               dist.P2POp(dist.irecv, received, comm.global_rank(src))]
        return Pending(dist.batch_isend_irecv(ops), received)
