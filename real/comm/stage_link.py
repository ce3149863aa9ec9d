"""Pipeline stages on the real backend (``parallelism.pp_size`` p > 1, one micro-batch a
step): a rank's link to the ranks at its place in the stages before and after it.

A step's forward runs stage after stage: stage k's output rows [T, H] (each rank its own
tokens' hidden states, in ``model.dtype``) go to the rank at the same place in stage
k + 1, which continues from them; the backward comes back the same way, each stage
sending the gradient of its input to the stage before. Sends and receives are blocking
point-to-point calls of the process group (gloo or NCCL): a rank waits for its
neighbour, which is the pipeline's bubble (with one micro-batch: every stage but one
idles at any time). The waits are in no stage of the stage clock; their bytes are
counted apart (``sent_bytes``), outside the stage ledger: the simulator's pipeline
reports its sends the same way (``sim.pipeline.run``).
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
        self._input: torch.Tensor | None = None

    def _peer(self, offset: int) -> int:
        return self.place.global_rank(self.place.local_rank, self.place.stage + offset)

    def receive_activations(self, tokens: int, hidden: int) -> torch.Tensor:
        """The previous stage's output rows for this rank's tokens, as this stage's input
        (a leaf that takes the gradient this stage sends back)."""
        clock = self.st.clock
        before = clock.current
        clock.switch(None)
        buf = torch.empty(tokens, hidden, dtype=self.st.dtype, device=self.st.device)
        dist.recv(buf, src=self._peer(-1))
        clock.switch(before)
        self._input = buf.requires_grad_()
        return self._input

    def send_activations(self, out: torch.Tensor) -> None:
        self._send(out.detach(), +1)

    def receive_gradient(self, out: torch.Tensor) -> torch.Tensor:
        """The next stage's gradient of this stage's output."""
        self.st.clock.switch(None)
        grad = torch.empty_like(out)
        dist.recv(grad, src=self._peer(+1))
        return grad

    def send_gradient(self) -> None:
        """This stage's input gradient, back to the stage before."""
        self._send(self._input.grad, -1)

    def _send(self, tensor: torch.Tensor, offset: int) -> None:
        clock = self.st.clock
        before = clock.current
        clock.switch(None)
        dist.send(tensor.contiguous(), dst=self._peer(offset))
        self.sent_bytes += tensor.numel() * tensor.element_size()
        clock.switch(before)
