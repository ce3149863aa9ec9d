"""The FFN's activation between its two GEMMs (``model.ffn_activation``), forward and backward,
and where its matrices lie in an FFN's flat weights.

An FFN of inner dimension F is two GEMMs around an activation: x [R, H] times the *input
matrix* w1 [H, W] gives a [R, W]; the activation turns a into h [R, F]; h times w2 [F, H]
is the output.

- ``gelu``: W = F, h = gelu(a) (two matrices, H x F and F x H).
- ``swiglu``: W = 2 F, the gate and up matrices side by side (columns [0, F) the gate's,
  [F, 2 F) the up's: Megatron-LM's fused ``linear_fc1`` and its ``glu``, which chunks its
  output in two, ``megatron/core/transformer/mlp.py``), h = silu(a_gate) * a_up
  (Shazeer 2020, "GLU Variants Improve Transformer", FFN_SwiGLU). Three matrices of H x F
  in all, as ``testbed.model.transformer_shape`` counts them; one GEMM for gate and up.

An FFN's flat weights (an expert's, in its pages) are w1 (H x W, row-major) then w2
(F x H): ``input_width(ffn, swiglu) * hidden + ffn * hidden`` elements, the scenario's
``model.expert_params``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def input_width(ffn: int, swiglu: bool) -> int:
    """W: columns of the FFN's input matrix (gate and up side by side for SwiGLU)."""
    return 2 * ffn if swiglu else ffn


def activation(a: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """h [R, F] from the input GEMM's output a [R, W] (module doc)."""
    if not swiglu:
        return F.gelu(a)
    gate, up = a.chunk(2, dim=-1)
    return F.silu(gate) * up


def activation_backward(dh: torch.Tensor, a: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """da [R, W] from dh [R, F] and a [R, W]: gelu's derivative, or for SwiGLU
    d gate = dh up silu'(gate), d up = dh silu(gate)."""
    if not swiglu:
        return torch.ops.aten.gelu_backward(dh, a)
    gate, up = a.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(dh * up, gate), dh * F.silu(gate)], dim=-1)


def split_ffn(flat: torch.Tensor, hidden: int, ffn: int, swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [H, W], w2 [F, H]) views of one FFN's flat weights."""
    cut = hidden * input_width(ffn, swiglu)
    return flat[:cut].view(hidden, -1), flat[cut:].view(ffn, hidden)


def ffn_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """The FFN on rows x, through autograd."""
    return activation(x @ w1, swiglu) @ w2
