"""What one rank of the real backend holds in memory, measured from its tensors (issue
13): the categories of the simulator's breakdown (``sim.step.memory_breakdown``), so the two
line up, and the activations autograd saves for the backward.

On CPU ranks this is the memory accounting itself (there is no device allocator to ask);
on CUDA the step's peak comes from the allocator and the breakdown from these counts.
The CUDA peak (``torch.cuda.max_memory_allocated``) holds torch's tensors only: the
buffers NCCL allocates for its communicators are outside it, while the simulator's peak
counts comm buffers and communicators (``CUDA_PEAK_LEAVES_OUT``, beside every
comparison of the two peaks).
"""

from __future__ import annotations

import torch

#: what a CUDA run's ``peak_memory_bytes`` does not hold, said beside its comparison with the simulator's
CUDA_PEAK_LEAVES_OUT = ("the CUDA peak is torch's allocator's: it leaves out the buffers NCCL allocates for its "
                        "communicators, which the simulator's peak counts (comm buffers and communicators)")
#: the same for a CPU run, whose peak is the sum of the categories the rank tracks
CPU_PEAK_LEAVES_OUT = ("the CPU peak sums the rank's expert pages, activations and gradients (and the whole model's "
                       "parameters and optimizer state): it leaves out collective buffers and communicators, which "
                       "the simulator's peak counts")


def gradient_bytes(state) -> int:
    """Bytes of every gradient the backward made on rank ``state`` (a ``RankState``): the
    experts', routers' and dense weights'."""
    return (sum(g.numel() * g.element_size() for g in state.grads.values())
            + sum(p.grad.numel() * p.grad.element_size() for p in state.dense_params() if p.grad is not None))


def memory_breakdown(state, resident: int, activation_bytes: int, grads: int, communicator_bytes: float) -> dict:
    """Bytes the rank held over the step by category: the expert weights on the device at
    the forward's end (``resident``), the other weights, every gradient of the backward
    (``grads``), the optimizer's state, what autograd saved for the backward
    (``activation_bytes``), the largest send + receive buffers of one collective, and the
    communicators (the groups the rank is in, ``communicator_bytes`` each: gloo and NCCL
    do not report theirs)."""
    st = state
    groups = sum(1 for members in st.groups.held() if st.rank in members)
    return {"expert_pages": float(resident),
            "parameters": float(sum(p.numel() * p.element_size() for p in st.dense_params())),
            "gradients": float(grads), "optimizer_state": float(st.adam.nbytes if st.adam is not None else 0),
            "activations": float(activation_bytes), "comm_buffers": float(st.comm.largest_buffers),
            "communicators": float(groups * communicator_bytes)}


class ActivationMeter:
    """Bytes of tensors autograd saves for the backward during the forward (CPU memory
    accounting: the activations a GPU would hold at the end of the forward)."""

    def __init__(self, exclude: list[torch.Tensor] = ()):
        self.peak_bytes = 0
        # weights that a matmul saves are parameters, not activations
        self._seen: set[int] = {t.untyped_storage().data_ptr() for t in exclude}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            self.peak_bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
