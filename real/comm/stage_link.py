"""Pipeline stages on the real backend (``parallelism.pp_size`` p > 1, ``transformer.micro_batches``
m a step): a rank's link to the ranks at its place in the stages before and after it.

A micro-batch's forward runs stage after stage: stage k's output rows [T/m, H] (each rank
its own tokens' hidden states, in ``model.dtype``) go to the rank at the same place in
stage k + 1, which continues from them; its backward comes back the same way, each stage
sending the gradient of its input to the stage before. Each stage runs its micro-batches in
1F1B order (``testbed.policy.pipeline_order``, ``real.rank.worker``).

Sends pair with receives as Megatron-LM's p2p communication pairs them
(``send_forward_recv_backward``, ``send_backward_recv_forward``): a send is held until the
stage's next communication, and goes out in one batch with it when that is a receive from
the same peer - in the steady 1F1B state an activation goes forward as the gradient comes
back, and two blocking sends each way would wait for each other (NCCL runs a pair's ops in
one stream) - else on its own first (warm-up and cool-down). A rank waits for each batch,
and so for its neighbour: the pipeline's bubble. The waits are in no stage of the stage
clock; the bytes sent are counted apart (``sent_bytes``), outside the stage ledger: the
simulator's pipeline reports its sends the same way (``sim.pipeline.run``). Each message is
tagged with its micro-batch (gloo matches by tag; each direction between two ranks carries
the micro-batches in order anyway).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from testbed.policy.pipeline_stages import StagePlace


class StageLink:
    def __init__(self, place: StagePlace, state):
        self.place, self.st = place, state
        self.first, self.last = place.first_stage, place.last_stage
        self.sent_bytes = 0  # bytes this rank sent this step (the step loop resets it)
        self._inputs: dict[int, torch.Tensor] = {}  # micro-batch -> the input leaf received for it
        self._held: tuple[torch.Tensor, int, int] | None = None  # (tensor, peer, tag) of the send not yet issued

    def _peer(self, offset: int) -> int:
        return self.place.global_rank(self.place.local_rank, self.place.stage + offset)

    def receive_activations(self, tokens: int, hidden: int, micro_batch: int = 0) -> torch.Tensor:
        """The previous stage's output rows of micro-batch ``micro_batch`` for this rank's
        tokens, as this stage's input (a leaf that takes the gradient this stage sends back)."""
        buf = torch.empty(tokens, hidden, dtype=self.st.dtype, device=self.st.device)
        self._communicate(dist.P2POp(dist.irecv, buf, self._peer(-1), tag=micro_batch))
        self._inputs[micro_batch] = buf.requires_grad_()
        return buf

    def send_activations(self, out: torch.Tensor, micro_batch: int = 0) -> None:
        self._hold(out.detach(), +1, micro_batch)

    def receive_gradient(self, out: torch.Tensor, micro_batch: int = 0) -> torch.Tensor:
        """The next stage's gradient of this stage's output of micro-batch ``micro_batch``."""
        grad = torch.empty_like(out)
        self._communicate(dist.P2POp(dist.irecv, grad, self._peer(+1), tag=micro_batch))
        return grad

    def send_gradient(self, micro_batch: int = 0) -> None:
        """This stage's input gradient of micro-batch ``micro_batch``, back to the stage before."""
        self._hold(self._inputs.pop(micro_batch).grad, -1, micro_batch)

    def finish(self) -> None:
        """The step's end: the send still held goes out."""
        self._communicate(None)

    def _hold(self, tensor: torch.Tensor, offset: int, micro_batch: int) -> None:
        if self._held is not None:  # two sends in a row: the first goes alone
            self._communicate(None)
        tensor = tensor.contiguous()
        self._held = (tensor, self._peer(offset), micro_batch)
        self.sent_bytes += tensor.numel() * tensor.element_size()

    def _communicate(self, receive: dist.P2POp | None) -> None:
        """The held send and ``receive``: one batch if they go to the same peer, else the send
        alone first; waited for, outside every stage of the clock."""
        clock = self.st.clock
        before = clock.current
        clock.switch(None)
        batches = [[receive]] if receive is not None else []
        if self._held is not None:
            tensor, peer, tag = self._held
            send = dist.P2POp(dist.isend, tensor, peer, tag=tag)
            self._held = None
            batches = [[send, receive]] if batches and peer == receive.peer else [[send]] + batches
        for batch in batches:
            for work in dist.batch_isend_irecv(batch):
                work.wait()
        clock.switch(before)
