"""The bytes fp8 GEMMs add (``model.gemm_dtype = "fp8"``): the casts of their inputs and
weights to fp8 and the scales that go with them, and the fp8 copies of the weights a GPU
keeps while a step runs. Both backends and the reports take them from here.

Which GEMMs run in fp8 follows DeepSeek-V3 (arXiv 2412.19437, §3.3.1): the linear layers
(experts, shared experts, attention projections, dense FFNs, the MTP projection) do;
the embedding, the output head, the router's gate, the norms and attention's core keep
the model dtype.

A GEMM of ``rows`` tokens, ``k`` inputs and ``n`` outputs (weight k x n) casts, each
cast reading its tensor once at the model dtype and writing it once in fp8 (1 byte an
element) with its scales (fp32, 4 bytes each):

- forward: its input (rows x k) and its weight (k x n);
- backward: the output's gradient (rows x n) for the input gradient, and for the weight
  gradient, which contracts over the tokens, the input and the output's gradient again
  (rows x k and rows x n, tiled along the tokens: DeepSeek-V3's 128 x 1 backward tiles,
  Transformer Engine's transposed copies); the weight's forward copy serves the
  backward (a 128 x 128 block is the same block transposed; one tensor scale is one).

Scales (``model.fp8_scaling``): ``blockwise`` (DeepSeek-V3 §3.3.2, Fig. 7a): one per
1 x 128 tile of an activation along the contraction, one per 128 x 128 block of a
weight; ``tensor``: one per tensor (Transformer Engine's delayed scaling, whose amax is
taken in the cast itself: no extra pass).

The casts are memory-bound kernels: the simulator times their bytes at the device's
memory bandwidth. Of the activations kept for the backward, the linears' inputs are kept
quantized, as Transformer Engine keeps them for the weight gradient
(``testbed.model.recompute_modules.FP8_CACHED_INPUTS``), at ``cached_input_bytes`` an
element; the rest stay at the model dtype (DeepSeek-V3 §3.3.3 also caches its SwiGLU
inputs in fp8: not modelled).
"""

from __future__ import annotations

import numpy as np

FP8_BYTES = 1
SCALE_BYTES = 4  # fp32
TILE = 128  # blockwise: an activation tile is 1 x 128, a weight block 128 x 128
SCALINGS = ("blockwise", "tensor")


def _check(scaling: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"fp8 scaling {scaling!r}: one of {', '.join(SCALINGS)}")


def activation_scales(rows, cols: int, scaling: str, along_rows: bool = False):
    """Scales of an fp8 activation of ``rows`` x ``cols`` (rows may be an array): one per
    1 x 128 tile along ``cols`` (``along_rows``: along the rows, a backward copy), or one
    (a tensor scale; none for an empty tensor)."""
    _check(scaling)
    rows = np.asarray(rows, dtype=np.float64)
    if scaling == "tensor":
        return np.where(rows > 0, 1.0, 0.0)
    if along_rows:
        return cols * np.ceil(rows / TILE)
    return rows * -(-cols // TILE)


def cached_input_bytes(scaling: str) -> float:
    """Bytes an element of a linear's input kept quantized for the backward: one, and its
    share of the scales (a 1 x 128 tile's fp32 scale; a tensor scale is none to speak of)."""
    _check(scaling)
    return FP8_BYTES + (SCALE_BYTES / TILE if scaling == "blockwise" else 0.0)


def weight_scales(k: int, n: int, scaling: str) -> int:
    """Scales of an fp8 weight of ``k`` x ``n``: one per 128 x 128 block, or one."""
    _check(scaling)
    return 1 if scaling == "tensor" else -(-k // TILE) * -(-n // TILE)


def weight_copy_bytes(k: int, n: int, scaling: str) -> int:
    """Bytes of the fp8 copy of a weight of ``k`` x ``n`` and its scales."""
    return k * n * FP8_BYTES + weight_scales(k, n, scaling) * SCALE_BYTES


def linears_copy_bytes(linears: list[tuple[int, int]], scaling: str) -> int:
    """Bytes of the fp8 copies of every weight of ``linears`` ((k, n) each)."""
    return sum(weight_copy_bytes(k, n, scaling) for k, n in linears)


def _cast(elements, scales, dtype_bytes: int):
    """A cast's bytes: ``elements`` read at ``dtype_bytes`` and written in fp8, and its scales written."""
    return elements * (dtype_bytes + FP8_BYTES) + scales * SCALE_BYTES


def gemm_cast_bytes(rows, k: int, n: int, dtype_bytes: int, scaling: str, backward: bool = False,
                    weight: bool = True):
    """Bytes the casts of one fp8 GEMM of ``rows`` tokens (an array: one GEMM each), ``k``
    inputs and ``n`` outputs move (module doc): forward its input and, with ``weight``,
    its weight (a weight cast once for several GEMMs is counted once: pass False for the
    others); backward the output's gradient and the weight gradient's copies of the input
    and the output's gradient. No tokens, no casts."""
    rows = np.asarray(rows, dtype=np.float64)
    if backward:
        out = (_cast(rows * n, activation_scales(rows, n, scaling), dtype_bytes)
               + _cast(rows * k, activation_scales(rows, k, scaling, along_rows=True), dtype_bytes)
               + _cast(rows * n, activation_scales(rows, n, scaling, along_rows=True), dtype_bytes))
    else:
        out = _cast(rows * k, activation_scales(rows, k, scaling), dtype_bytes)
        if weight:
            out = out + np.where(rows > 0, _cast(k * n, weight_scales(k, n, scaling), dtype_bytes), 0.0)
    return np.where(rows > 0, out, 0.0)


def linears_cast_bytes(rows, linears: list[tuple[int, int]], dtype_bytes: int, scaling: str,
                       backward: bool = False):
    """Bytes of the casts of every GEMM of ``linears`` ((k, n) each) on ``rows`` tokens."""
    rows = np.asarray(rows, dtype=np.float64)
    return sum((gemm_cast_bytes(rows, k, n, dtype_bytes, scaling, backward) for k, n in linears),
               np.zeros(rows.shape))
