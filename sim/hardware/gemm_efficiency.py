"""GEMM efficiency by shape (m, n, k) on a GPU of tiled tensor-core kernels (M22, issue 26).

A GEMM C[m, n] = A[m, k] B[k, n] runs as output tiles of ``tile_m x tile_n`` (Hopper's
cuBLAS and CUTLASS warp-specialized kernels: 128 x 256 or 128 x 128 thread-block tiles;
DeepGEMM's BLOCK_M = 128 with BLOCK_N up to 256), one tile per SM at a time, in waves of
``sm_count`` tiles. Two terms of a shape reduce the fraction of the machine's throughput a
kernel reaches:

- tile and wave quantisation, at the profile's tile, or where its tiles do not fill one wave
  at the best of it and its halvings (128 x 128, 64 x 128: a library's heuristics pick a
  smaller tile for a small GEMM; NVIDIA's "Matrix Multiplication Background User's Guide",
  sections "Tile quantization" and "Wave quantization"; DeepGEMM's README: M = 256,
  N = 7168 in 128 x 128 blocks fills 112 of 132 SMs): ``tiles = groups x ceil(m / tile_m) x
  ceil(n / tile_n)`` run in ``waves = ceil(tiles / sms)``, so the useful share is
  ``groups x m x n / (waves x sms x tile_m x tile_n)``. A grouped GEMM (one persistent launch
  for every expert: CUTLASS's grouped kernel, ``torch._grouped_mm``, DeepGEMM's contiguous
  layout) quantises over all its groups' tiles; a loop of GEMMs, each alone;
- K depth: each tile pays a fixed time (its pipeline's fill, its epilogue writing C)
  besides its main loop over k, worth ``k_fixed`` elements of k at the kernel's rate:
  ``k / (k + k_fixed)``. The fixed time is the same in fp8 and bf16 while the main loop runs
  twice as fast in fp8, so fp8's ``k_fixed`` is about twice bf16's.

``shape_factor`` is their product. The simulator does not take it as an efficiency by
itself: the profile's measured curves (``compute.efficiency``) stay the efficiency at the
shapes they were measured at, and a GEMM of another shape runs at the curve's value times
``shape_factor(its shape) / shape_factor(the measured shape)`` (``ShapeModel.correction``).
Its roofline is the larger of that compute time and the bytes of A, B and C at the memory
bandwidth (``gemm_bytes``).

All shapes in elements; no randomness.
"""

from __future__ import annotations

import numpy as np

from testbed.scenario.profile import MachineProfile


def tile_utilisation(m, n, tile_m: int, tile_n: int, sms: int, groups=1):
    """Share of ``sms`` SMs' tile slots that ``groups`` GEMMs of ``m x n`` outputs fill in
    tiles of ``tile_m x tile_n`` run in waves of ``sms`` (tile and wave quantisation; 1 for
    shapes that fill whole tiles in whole waves)."""
    m, n, g = (np.asarray(v, dtype=np.float64) for v in (m, n, groups))
    tiles = g * np.ceil(m / tile_m) * np.ceil(n / tile_n)
    waves = np.maximum(np.ceil(tiles / sms), 1.0)
    return g * m * n / (waves * sms * tile_m * tile_n)


def k_depth(k, k_fixed: float):
    """Share of a tile's time in its main loop over ``k``: ``k / (k + k_fixed)``."""
    k = np.asarray(k, dtype=np.float64)
    return k / (k + k_fixed)


def gemm_bytes(m, n, k, in_bytes: float, out_bytes: float):
    """Bytes a GEMM moves at least once: A (m x k) and B (k x n) at ``in_bytes`` an element,
    C (m x n) at ``out_bytes``."""
    m, n, k = (np.asarray(v, dtype=np.float64) for v in (m, n, k))
    return (m * k + k * n) * in_bytes + m * n * out_bytes


class ShapeModel:
    """The shape terms of one GPU profile's ``compute.gemm`` (``enabled`` False when the
    profile has none: CPU ranks, or a GPU whose curves stand alone)."""

    def __init__(self, profile: MachineProfile):
        g = profile.compute.gemm
        self.enabled = g.tile_m > 0 and g.tile_n > 0 and profile.compute.sm_count > 0
        self.tile_m, self.tile_n, self.sms = g.tile_m, g.tile_n, profile.compute.sm_count
        self.k_fixed = {False: g.k_fixed, True: g.k_fixed_fp8}
        self.dense_reference = g.dense_reference
        self.expert_reference = tuple(sorted(g.expert_reference, key=lambda r: r["tokens"]))

    @property
    def tiles(self) -> tuple[tuple[int, int], ...]:
        """The tiles a GEMM may run in: the profile's and its halvings (128 x 256, 128 x 128,
        64 x 128 on Hopper), as a library's heuristics pick among its kernels' tiles."""
        return (self.tile_m, self.tile_n), (self.tile_m, self.tile_n // 2), (self.tile_m // 2, self.tile_n // 2)

    def utilisation(self, m, n, groups=1):
        """Tile and wave utilisation: at the profile's tile where its tiles fill at least one
        wave, else at the best of ``tiles`` (a smaller tile runs slower per SM, so a library
        takes one only for GEMMs too small to fill the SMs: assumed, as the rule of thumb)."""
        m, n, g = (np.asarray(v, dtype=np.float64) for v in (m, n, groups))
        full = tile_utilisation(m, n, self.tile_m, self.tile_n, self.sms, g)
        best = np.max([tile_utilisation(m, n, tm, tn, self.sms, g) for tm, tn in self.tiles], axis=0)
        few = g * np.ceil(m / self.tile_m) * np.ceil(n / self.tile_n) < self.sms
        return np.where(few, best, full)

    def shape_factor(self, m, n, k, fp8: bool = False, groups=1):
        """Tile and wave utilisation times the K depth of ``groups`` GEMMs of (m, n, k)
        in one launch (module doc)."""
        return self.utilisation(m, n, groups) * k_depth(k, self.k_fixed[fp8])

    def grouped_factor(self, m, n, k, fp8: bool = False):
        """[ranks] ``shape_factor`` of one grouped launch per row of ``m``, ``n``, ``k``
        ([ranks, experts], an expert of m = 0 having no tiles): its tiles over all experts in
        waves of the SMs, and the K depth of its experts weighted by their FLOPs (their main
        loops' time over the tiles' whole time)."""
        m, n, k = (np.asarray(v, dtype=np.float64) for v in (m, n, k))
        fills, counts = [], []
        for tm, tn in self.tiles:
            tiles = (np.ceil(m / tm) * np.ceil(n / tn)).sum(axis=-1)
            waves = np.maximum(np.ceil(tiles / self.sms), 1.0)
            fills.append((m * n).sum(axis=-1) / (waves * self.sms * tm * tn))
            counts.append(tiles)
        fill = np.where(counts[0] < self.sms, np.max(fills, axis=0), fills[0])  # as ``utilisation``
        flops = m * n * k
        with np.errstate(divide="ignore", invalid="ignore"):
            slow = np.where(flops > 0, flops / k_depth(np.where(k > 0, k, 1.0), self.k_fixed[fp8]), 0.0)
            depth = np.where(slow.sum(axis=-1) > 0, flops.sum(axis=-1) / slow.sum(axis=-1), 1.0)
        return fill * depth

    def dense_reference_factor(self, fp8: bool = False) -> float:
        """``shape_factor`` of the dense curve's measured shape (m = n = k = ``dense_reference``)."""
        r = self.dense_reference
        return float(self.shape_factor(r, r, r, fp8))

    def expert_reference_factor(self, tokens, fp8: bool = False, grouped: bool = True):
        """``shape_factor`` of the expert curves' measured shapes at ``tokens`` per expert:
        each measured point's two forward GEMMs (T x H times H x F, T x F times F x H, equal
        FLOPs: their harmonic mean), over its E experts in one launch (grouped) or one each
        (loop); interpolated in log(tokens) between the points, clamped at the ends (as the
        curves are)."""
        xs, ys = [], []
        for r in self.expert_reference:
            groups = r["experts"] if grouped else 1
            t, h, f = r["tokens"], r["hidden"], r["ffn"]
            a = self.shape_factor(t, f, h, fp8, groups)
            b = self.shape_factor(t, h, f, fp8, groups)
            xs.append(np.log(t))
            ys.append(float(2.0 / (1.0 / a + 1.0 / b)))
        out = np.interp(np.log(np.maximum(np.asarray(tokens, dtype=np.float64), 1e-300)), xs, ys)
        return float(out) if np.ndim(out) == 0 else out
