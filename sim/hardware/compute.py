"""Compute and copy times from the machine profile's roofline (M22).

Expert FFN (two matrices H x F and F x H, M6): ``4 * tokens * H * F`` FLOPs forward per
expert, twice that backward (input and weight gradients). Time is the larger of the
compute time ``flops / (peak * efficiency(tokens per expert))`` and the memory time of
reading the expert's weights (forward) or reading weights and writing their gradients
(backward) at ``memory_GBps`` — the memory bound is what limits experts with few tokens,
below the profile's measured efficiency points. Kernels are launched asynchronously, so
launch cost is a floor, not an addition: a kernel shorter than ``launch_us`` takes
``launch_us`` (the measured efficiencies already include launches of longer kernels;
adding them would count them twice).

- ``loop``: one GEMM per matrix per expert with tokens (2 forward, 4 backward each);
  experts with no tokens are skipped; each expert takes max(compute, memory, launches);
- ``grouped``: one grouped GEMM per matrix for all experts, at the efficiency of the
  mean tokens per expert over all experts passed; max(compute, memory, launches);
- ``multistream``: Transformer Engine's ``GroupedLinear`` as Megatron-Core's TEGroupedMLP
  runs it (``--moe-grouped-gemm`` on the Transformer Engine spec), a loop of cuBLAS GEMMs,
  one per expert, over four streams (``nvte_multi_stream_cublas_gemm``, ``num_streams = 4``:
  NVIDIA/TransformerEngine release v2.2, ``transformer_engine/common/gemm/cublaslt_gemm.cu``
  and ``include/transformer_engine/gemm.h``; its CUTLASS grouped kernel came in v2.8 behind
  ``NVTE_USE_CUTLASS_GROUPED_GEMM``, off by default). Each expert's GEMM runs in its own
  waves (its tiles alone, as ``loop``), at the per-tile rate of the ``grouped`` curve, and
  each call (one per matrix forward, two backward) costs ``compute.gemm.multistream_call_us``
  besides. Needs the profile's shape model (``compute.gemm``).

Every GEMM names the profile's curve it is timed at (``compute.efficiency``): expert
GEMMs ``grouped`` or ``loop`` (by tokens per expert, ``scenario.expert_kernel``); the
router's gate and every dense GEMM of the whole transformer ``dense`` (by rows);
flash attention's core ``attention`` (by sequence length).

SwiGLU (``model.ffn_activation``): an expert has three matrices (gate and up H x F, down
F x H), so 2 x 3 x tokens x H x F FLOPs forward and 1.5 x gelu's weight bytes at equal F;
its gate and up run as one GEMM (Megatron-Core's linear_fc1 of 2 F), so the launches stay
2 forward and 4 backward.

GEMM efficiency by shape (``compute.gemm``, ``sim.hardware.gemm_efficiency``; the h100, h800
and h200 profiles): every GEMM is timed at its own (m, n, k), at the curve's efficiency times
its shape's correction (tiles and waves over the SMs, K depth) against the shape the curve was
measured at, the larger of that and its A, B and C bytes at ``memory_GBps``, at least one
launch. An expert's GEMMs (``expert_gemm_shapes``): fc1 T x H x (matrices - 1) F, fc2
T x F x H forward; backward their input gradients (n and k swapped) and weight gradients
(depth T); grouped, all experts' tiles in one launch. A dense linear's (``linear_shape``): the
tensor-parallel group's rows against its column- or row-parallel slice. Without
``compute.gemm`` (CPU profiles, the a100 seed) the curves alone, as above.

FP8 GEMMs (``model.gemm_dtype = "fp8"``, ``testbed.model.fp8_casts``): the linear
layers' GEMMs (experts, shared experts, attention projections, dense FFNs) run at the
profile's ``compute.peak_tflops.fp8`` times the same efficiency curves and read their
weights in fp8 (1 byte); their casts (inputs, weights, and in the backward the output
gradients and the weight gradient's copies, with their scales) move their bytes at
``memory_GBps`` besides. The output head, the router's gate and attention's core stay at
the model dtype. A profile without an fp8 ceiling refuses them.

All times in seconds; sizes in bytes; no randomness.
"""

from __future__ import annotations

import numpy as np

from sim.hardware.gemm_efficiency import ShapeModel, gemm_bytes
from sim.hardware.software_latency import fit_at
from testbed.core.errors import ScenarioError
from testbed.model.fp8_casts import FP8_BYTES, gemm_cast_bytes
from testbed.scenario.profile import MachineProfile
from testbed.scenario.sections import DTYPE_BYTES

GEMMS_FORWARD = 2  # x @ w1, h @ w2
GEMMS_BACKWARD = 4  # input and weight gradient of each matrix


class ComputeModel:
    """Roofline times of one GPU (or CPU rank) of ``profile`` in ``dtype``."""

    def __init__(self, profile: MachineProfile, dtype: str, world: int = 1, shared_cores: bool = False,
                 gemm_dtype: str = "model", fp8_scaling: str = "blockwise"):
        """``shared_cores``: the caller shares CPU cores between ranks itself
        (``sim.hardware.cores.CorePool``), so times are for one rank alone on its core;
        ``gemm_dtype``, ``fp8_scaling``: the scenario's ``model.gemm_dtype`` (fp8: the
        linear layers' GEMMs in fp8, module doc) and ``model.fp8_scaling``."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPE_BYTES)})")
        self.profile = profile
        self.dtype = dtype
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.peak = profile.compute.peak(dtype)  # FLOP/s
        self.fp8 = gemm_dtype == "fp8"
        self.fp8_scaling = fp8_scaling
        if self.fp8 and profile.compute.peak("fp8") <= 0:
            raise ScenarioError("model.gemm_dtype", gemm_dtype, f"the profile {profile.name} has no fp8 matmul "
                                "ceiling (compute.peak_tflops.fp8 is 0)")
        #: FLOP/s and weight bytes per element of the linear layers' GEMMs
        self.gemm_peak = profile.compute.peak("fp8") if self.fp8 else self.peak
        self.gemm_weight_bytes = FP8_BYTES if self.fp8 else self.dtype_bytes
        self.memory_bw = profile.compute.memory_GBps * 1e9  # bytes/s
        self.launch = profile.compute.launch_us * 1e-6  # s
        self.scale = 1.0 if shared_cores else contention_factor(profile, world)
        #: GEMM efficiency by shape (``compute.gemm``; off: the curves alone, as on CPU profiles)
        self.shapes = ShapeModel(profile)

    def expert_time(self, tokens_per_expert, hidden: int, ffn: int, kernel: str = "grouped",
                    backward: bool = False, matrices: int = 2) -> float:
        """Seconds to run the experts of one rank on ``tokens_per_expert`` (one count each)."""
        t = np.asarray(tokens_per_expert, dtype=np.float64).reshape(1, -1)
        return float(self.expert_times(t, hidden, ffn, kernel, backward, matrices)[0])

    def expert_times(self, tokens, hidden: int, ffn: int, kernel: str = "grouped",
                     backward: bool = False, matrices: int = 2) -> np.ndarray:
        """[ranks] seconds for ``tokens`` [ranks, experts per rank], one rank per row, of
        experts of ``matrices`` matrices (2: gelu, 3: SwiGLU); with fp8 GEMMs their casts
        besides (``expert_cast_bytes``)."""
        t = np.asarray(tokens, dtype=np.float64)
        if self.shapes.enabled:
            return self._shaped_expert_times(t, hidden, ffn, kernel, backward, matrices)
        if kernel == "multistream":
            raise ScenarioError("sim.expert_kernel", kernel, f"the profile {self.profile.name} has no GEMM shape "
                                "model (compute.gemm.tile_m is 0), which multistream's per-expert waves need")
        mult = 2 if backward else 1
        gemms = GEMMS_BACKWARD if backward else GEMMS_FORWARD
        flops = (2.0 * matrices) * t * hidden * ffn * mult  # per expert
        weight_bytes = float(matrices) * hidden * ffn * self.gemm_weight_bytes * mult  # per active expert
        eff = self.profile.compute.efficiency_at
        idle = t.sum(axis=1) <= 0
        if kernel == "loop":
            active = t > 0
            with np.errstate(divide="ignore", invalid="ignore"):
                compute = np.where(active, flops / (self.gemm_peak * eff("loop", np.where(active, t, 1.0))), 0.0)
            floor = max(weight_bytes / self.memory_bw, gemms * self.launch)
            seconds = np.where(active, np.maximum(compute, floor), 0.0).sum(axis=1)
        elif kernel == "grouped":
            mean = np.maximum(t.mean(axis=1), 1e-12)
            compute = flops.sum(axis=1) / (self.gemm_peak * eff("grouped", mean))
            memory = weight_bytes * np.count_nonzero(t, axis=1) / self.memory_bw
            seconds = np.maximum(np.maximum(compute, memory), gemms * self.launch)
        else:
            raise ValueError(f"unknown expert kernel {kernel!r} (grouped or loop)")
        if self.fp8:
            seconds = seconds + self.expert_cast_bytes(t, hidden, ffn, matrices, backward).sum(axis=1) / self.memory_bw
        return np.where(idle, 0.0, seconds * self.scale)

    def _shaped_expert_times(self, t: np.ndarray, hidden: int, ffn: int, kernel: str, backward: bool,
                             matrices: int) -> np.ndarray:
        """``expert_times`` with GEMM efficiency by shape (``compute.gemm``, module doc): each
        of an expert's GEMMs (``expert_gemm_shapes``) at its curve's efficiency times its shape's
        correction, the larger of that and its A, B and C bytes at ``memory_GBps``; ``grouped``:
        every expert's tiles in one launch per GEMM (its waves over all of them), the curve at
        the mean tokens per expert; ``loop``: each expert's GEMMs alone, at least their launches."""
        if kernel not in ("grouped", "loop", "multistream"):
            raise ValueError(f"unknown expert kernel {kernel!r} (grouped, loop or multistream)")
        eff, sm = self.profile.compute.efficiency_at, self.shapes
        in_bytes, out_bytes = (FP8_BYTES if self.fp8 else self.dtype_bytes), self.dtype_bytes
        gemms = GEMMS_BACKWARD if backward else GEMMS_FORWARD
        active = t > 0
        idle = ~active.any(axis=1)
        if kernel in ("grouped", "multistream"):  # one call per GEMM for all experts
            call = self.grouped_call_seconds if kernel == "grouped" else self.multistream_call_seconds
            mean = np.maximum(t.mean(axis=1), 1e-12)
            seconds = np.zeros(t.shape[0])
            for m, n, k in expert_gemm_shapes(t, hidden, ffn, matrices, backward):
                m, n, k = (np.where(active, np.broadcast_to(v, t.shape), 0.0) for v in (m, n, k))
                seconds = seconds + call(m, n, k, mean)
            seconds = np.maximum(seconds, gemms * self.launch)
        else:
            x = np.where(active, t, 1.0)
            base = self.gemm_peak * eff("loop", x) / sm.expert_reference_factor(x, self.fp8, grouped=False)
            per_expert = np.zeros(t.shape)
            for m, n, k in expert_gemm_shapes(x, hidden, ffn, matrices, backward):  # idle experts: dropped below
                m, n, k = (np.broadcast_to(v, t.shape) for v in (m, n, k))
                compute = 2.0 * m * n * k / (base * sm.shape_factor(m, n, k, self.fp8))
                memory = gemm_bytes(m, n, k, in_bytes, out_bytes) / self.memory_bw
                per_expert = per_expert + np.maximum(compute, memory)
            seconds = np.where(active, np.maximum(per_expert, gemms * self.launch), 0.0).sum(axis=1)
        if self.fp8:
            seconds = seconds + self.expert_cast_bytes(t, hidden, ffn, matrices, backward).sum(axis=1) / self.memory_bw
        return np.where(idle, 0.0, seconds * self.scale)

    def grouped_call_seconds(self, m, n, k, tokens) -> np.ndarray:
        """[ranks] seconds of one grouped launch (module doc, ``grouped``) of a GEMM of ``m``,
        ``n``, ``k`` per expert ([ranks, experts]; m = 0: an expert without rows): every expert's
        tiles in one launch's waves at the ``grouped`` curve's efficiency at ``tokens`` ([ranks],
        tokens per expert) times the launch's shape correction, or its A, B and C bytes at
        ``memory_GBps``, whichever is slower. Needs the shape model."""
        m, n, k = (np.broadcast_to(np.asarray(v, dtype=np.float64), np.shape(m)) for v in (m, n, k))
        idle = ~(m > 0).any(axis=-1)
        factor = np.where(idle, 1.0, self.shapes.grouped_factor(m, n, k, self.fp8))
        compute = (2.0 * m * n * k).sum(axis=-1) / (self._grouped_tile_rate(tokens) * factor)
        memory = gemm_bytes(m, n, k, self._gemm_in_bytes, self.dtype_bytes).sum(axis=-1) / self.memory_bw
        return np.maximum(compute, memory)

    def multistream_call_seconds(self, m, n, k, tokens) -> np.ndarray:
        """[ranks] seconds of one call of Transformer Engine's multi-stream grouped GEMM (module
        doc, ``multistream``) on a GEMM of ``m``, ``n``, ``k`` per expert ([ranks, experts]; m = 0:
        an expert without rows): each GEMM alone in its own tiles and waves at the ``grouped``
        curve's per-tile rate at ``tokens`` ([ranks], the curve's x: tokens per expert), the
        larger of that and its A, B and C bytes at ``memory_GBps``, plus the call's fixed time
        (``compute.gemm.multistream_call_us``). Needs the shape model."""
        m, n, k = (np.asarray(v, dtype=np.float64) for v in (m, n, k))
        active = m > 0
        x = np.where(active, m, 1.0)
        rate = np.expand_dims(self._grouped_tile_rate(tokens), -1) * self.shapes.shape_factor(x, n, k, self.fp8)
        per_gemm = np.maximum(2.0 * x * n * k / rate, gemm_bytes(x, n, k, self._gemm_in_bytes, self.dtype_bytes)
                              / self.memory_bw)
        call = self.profile.compute.gemm.multistream_call_us * 1e-6
        return np.where(active, per_gemm, 0.0).sum(axis=-1) + call

    @property
    def _gemm_in_bytes(self) -> int:
        """Bytes an element of an expert GEMM's inputs: fp8's under fp8 GEMMs, else the model dtype's."""
        return FP8_BYTES if self.fp8 else self.dtype_bytes

    def _grouped_tile_rate(self, tokens) -> np.ndarray:
        """FLOP/s of the ``grouped`` curve at ``tokens`` per expert, divided by the shape factor
        of the launches it was measured at: the rate a shape of factor 1 would reach."""
        tokens = np.asarray(tokens, dtype=np.float64)
        return self.gemm_peak * self.profile.compute.efficiency_at("grouped", tokens) \
            / self.shapes.expert_reference_factor(tokens, self.fp8, grouped=True)

    def expert_cast_bytes(self, tokens, hidden: int, ffn: int, matrices: int = 2, backward: bool = False):
        """[..., experts] bytes of the fp8 casts of each expert's two GEMMs on ``tokens``
        rows (``testbed.model.fp8_casts.gemm_cast_bytes``): H x (matrices - 1) F, then F x H."""
        t = np.asarray(tokens, dtype=np.float64)
        return sum(gemm_cast_bytes(t, k, n, self.dtype_bytes, self.fp8_scaling, backward)
                   for k, n in ((hidden, (matrices - 1) * ffn), (ffn, hidden)))

    def linears_time(self, rows: int, linears: list[tuple[int, int]], backward: bool = False,
                     recompute: bool = False, splits=None, tp: int = 1) -> float:
        """Seconds of the linear layers ``linears`` ((inputs, outputs) each) on ``rows``
        tokens as dense GEMMs (the ``dense`` curve by rows, at the GEMMs' ceiling), forward
        or backward (twice the FLOPs; with ``recompute`` the forward first), with fp8's casts.
        With GEMM efficiency by shape, each linear is one GEMM of the shape ``linear_shape``
        gives it (``splits``, ``tp``), its backward the input and weight gradients' GEMMs."""
        casts = self.linears_cast_seconds(rows, linears) if self.fp8 else 0.0
        seconds = self.linears_gemm_seconds(rows, linears, splits=splits, tp=tp)
        if not backward:
            return seconds + casts
        out = self.linears_gemm_seconds(rows, linears, True, splits, tp) \
            + (self.linears_cast_seconds(rows, linears, backward=True) if self.fp8 else 0.0)
        return out + (seconds + casts if recompute else 0.0)

    def linears_gemm_seconds(self, rows: int, linears: list[tuple[int, int]], backward: bool = False,
                             splits=None, tp: int = 1, fp8: bool = True) -> float:
        """Seconds of the GEMMs alone (no casts) of ``linears`` on ``rows`` tokens, forward or
        backward: each linear one GEMM of ``linear_shape`` (``splits[i]``: column, row or whole
        over ``tp`` GPUs; none: whole), timed by ``shaped_gemm_seconds``; without a shape model
        the ``dense`` curve by rows on their FLOPs (twice in the backward), as ``linears_time``."""
        if not self.shapes.enabled:
            seconds = self.gemm_time(2.0 * rows * sum(k * n for k, n in linears), rows, "dense", fp8=fp8)
            return 2.0 * seconds if backward else seconds
        splits = splits or ["whole"] * len(linears)
        return sum(self.shaped_gemm_seconds(*linear_shape(rows, k, n, split, tp), rows, fp8=fp8, backward=backward)
                   for (k, n), split in zip(linears, splits))

    def shaped_gemm_seconds(self, m, n, k, rows, kernel: str = "dense", fp8: bool = False,
                            backward: bool = False) -> float:
        """Seconds of one GEMM of (m, n, k) (forward; backward: its input gradient (m, k, n)
        and weight gradient (k, n, m)) at the ``kernel`` curve's efficiency at ``rows`` times
        the shape's correction (``sim.hardware.gemm_efficiency``), or its A, B and C bytes at
        ``memory_GBps``, or one launch each, whichever is slowest; ``fp8``: a linear layer's
        GEMM (at fp8's ceiling and bytes under fp8 GEMMs). Without a shape model
        ``gemm_time`` on its FLOPs (twice in the backward)."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        if not self.shapes.enabled:
            seconds = self.gemm_time(2.0 * m * n * k, rows, kernel, fp8=fp8)
            return 2.0 * seconds if backward else seconds
        low = fp8 and self.fp8
        peak = self.gemm_peak if fp8 else self.peak
        base = peak * self.profile.compute.efficiency_at(kernel, rows) / self.shapes.dense_reference_factor(low)
        in_bytes = FP8_BYTES if low else self.dtype_bytes
        out = 0.0
        for a, b, c in (((m, k, n), (k, n, m)) if backward else ((m, n, k),)):
            compute = 2.0 * a * b * c / (base * float(self.shapes.shape_factor(a, b, c, low)))
            memory = float(gemm_bytes(a, b, c, in_bytes, self.dtype_bytes)) / self.memory_bw
            out += max(compute, memory, self.launch)
        return out * self.scale

    def linears_cast_seconds(self, rows, linears: list[tuple[int, int]], backward: bool = False) -> float:
        """Seconds of the fp8 casts of ``linears``' GEMMs on ``rows`` tokens at memory bandwidth (0 without fp8)."""
        if not self.fp8:
            return 0.0
        nbytes = sum(float(gemm_cast_bytes(rows, k, n, self.dtype_bytes, self.fp8_scaling, backward))
                     for k, n in linears)
        return nbytes / self.memory_bw * self.scale

    def memory_seconds(self, nbytes):
        """Seconds of memory-bound kernels that read and write ``nbytes`` bytes in all
        (``testbed.model.memory_bound_kernels``) at the profile's memory bandwidth: a number,
        or an array of them (one per rank). Their launches are not added: they are queued
        behind the GEMMs around them (module doc)."""
        seconds = np.asarray(nbytes, dtype=np.float64) / self.memory_bw * self.scale
        return float(seconds) if seconds.ndim == 0 else seconds

    def router_time(self, tokens: int, hidden: int, experts: int) -> float:
        """Gate GEMM (tokens x H times H x E, a dense GEMM: the ``dense`` efficiency of
        ``tokens`` rows, reading the activations, or one launch, whichever is slowest)
        plus the profile's fixed router cost."""
        if tokens <= 0:
            return 0.0
        if self.shapes.enabled:  # tokens x H times H x E by shape (its A, B and C bytes its memory time)
            return self.shaped_gemm_seconds(tokens, experts, hidden, tokens) \
                + self.profile.overheads.router_us * 1e-6 * self.scale
        flops = 2.0 * tokens * hidden * experts
        compute = flops / (self.peak * self.profile.compute.efficiency_at("dense", tokens))
        memory = tokens * hidden * self.dtype_bytes / self.memory_bw
        return (max(compute, memory, self.launch) + self.profile.overheads.router_us * 1e-6) * self.scale

    def gemm_time(self, flops, rows: int, kernel: str, fp8: bool = False) -> float:
        """A GEMM of ``flops`` at the efficiency the profile's ``kernel`` curve gives
        ``rows`` (``dense``: rows; ``attention``: a sequence of ``rows``), or one launch;
        ``fp8``: a linear layer's GEMM, at the GEMMs' ceiling (fp8's under fp8 GEMMs)."""
        if flops <= 0:
            return 0.0
        peak = self.gemm_peak if fp8 else self.peak
        return max(flops / (peak * self.profile.compute.efficiency_at(kernel, rows)), self.launch) * self.scale

    def adam_time(self, params: float, param_bytes: int, state_bytes: int) -> float:
        """Mixed-precision Adam on ``params`` parameters: read the gradient and the fp32
        state (master weights, moments), write the state and the ``param_bytes`` weights,
        at memory bandwidth."""
        if params <= 0:
            return 0.0
        moved = params * (2 * param_bytes + 2 * state_bytes)
        return max(moved / self.memory_bw, self.launch) * self.scale

    def optimizer_time(self, param_bytes: float) -> float:
        """SGD step on ``param_bytes`` of weights: read weights and gradients, write
        weights (3x the bytes) at memory bandwidth; at least one launch."""
        if param_bytes <= 0:
            return 0.0
        return max(3.0 * param_bytes / self.memory_bw, self.launch) * self.scale

    def block_slowdown(self, hidden: int, ffn: int, page_bytes: int, matrices: int = 2) -> float:
        """How much longer an expert's GEMMs take in blocks of one page each (M14 page
        pipelining) than at full width. Page k of the flat weights holds rows of w1 (and
        SwiGLU's w3; F elements each) or of w2 (H each), so a block contracts over
        ``page / row`` of the H (or F) dimension; a GEMM of contraction width w runs at
        ``w / (w + k)`` of its full-width efficiency relative ``full / (full + k)``, k the
        profile's ``compute.block_half_width`` (an assumption unless measured). The mean
        over the ``matrices`` matrices (they have the same FLOPs)."""
        k = self.profile.compute.block_half_width
        elems = page_bytes / self.dtype_bytes

        def slower(full: float, row: float) -> float:
            width = min(full, elems / row)
            return (width + k) / width * full / (full + k)

        if matrices == 2:
            return 0.5 * (slower(hidden, ffn) + slower(ffn, hidden))
        return ((matrices - 1) * slower(hidden, ffn) + slower(ffn, hidden)) / matrices

    def copy_time(self, page_bytes):
        """Seconds to copy one page host <-> device: latency + bytes / table bandwidth."""
        return self.profile.copy.time(page_bytes)

    def defrag_time(self, nbytes):
        """Seconds to move ``nbytes`` of pages between device slots (M17): read and write
        each byte once at the device's memory bandwidth, staged through a buffer (twice)."""
        return 4.0 * np.asarray(nbytes, dtype=np.float64) / self.memory_bw * self.scale

    def page_read_time(self, pages):
        """Host seconds to read ``pages`` pages of expert weights to compute (a CPU rank's
        per-page cost, ``copy.read_page_us``; 0 on GPU profiles)."""
        return np.asarray(pages, dtype=np.float64) * self.profile.copy.read_page_us * 1e-6 * self.scale

    def page_update_time(self, pages):
        """Host seconds to update ``pages`` pages of expert weights in the optimizer step."""
        return np.asarray(pages, dtype=np.float64) * self.profile.copy.update_page_us * 1e-6 * self.scale

    def heat_update_time(self, experts: int) -> float:
        """One heat-map update over ``experts`` experts (M18)."""
        return experts * self.profile.overheads.heat_update_us_per_expert * 1e-6 * self.scale


def expert_gemm_shapes(tokens, hidden: int, ffn: int, matrices: int = 2, backward: bool = False):
    """(m, n, k) of an expert's GEMMs on ``tokens`` rows (arrays broadcast): forward its
    fc1 (T x H times H x (matrices - 1) F: SwiGLU's gate and up fused, Megatron-Core's
    linear_fc1) and fc2 (T x F times F x H); backward each one's input gradient (m, k, n)
    and weight gradient (k, n, m: its depth is the tokens)."""
    t = np.asarray(tokens, dtype=np.float64)
    wide = (matrices - 1) * ffn
    forward = [(t, wide, hidden), (t, hidden, ffn)]
    if not backward:
        return forward
    return [(m, k, n) for m, n, k in forward] + [(k, n, m) for m, n, k in forward]


def linear_shape(rows: int, inputs: int, outputs: int, split: str = "whole", tp: int = 1):
    """(m, n, k) of one GPU's GEMM of a linear layer of ``inputs`` x ``outputs`` on its
    ``rows`` tokens under tensor parallelism over ``tp`` GPUs with sequence parallelism
    (Megatron-Core's ColumnParallelLinear / RowParallelLinear: the group's tp x rows rows
    gathered): ``column`` 1/tp of the outputs, ``row`` 1/tp of the inputs (the depth),
    ``whole`` the GPU's own rows against the whole weight. The same FLOPs in each."""
    if split == "column":
        return tp * rows, outputs / tp, inputs
    if split == "row":
        return tp * rows, outputs, inputs / tp
    if split == "whole":
        return rows, outputs, inputs
    raise ValueError(f"unknown split {split!r} (column, row or whole)")


def contention_factor(profile: MachineProfile, world: int) -> float:
    """How much slower one rank computes with ``world`` ranks on the machine, all computing
    at once. Without ``measured.compute_scale``: ranks per shared core
    (``compute.host_cores``), else 1. With it: the factor of ``world`` where it was
    measured; elsewhere fitted, never below 1 (``sim.hardware.software_latency.fit_at``): the
    least-squares line in world through the measured worlds, or with one measured world
    ``w0`` the ranks-per-core rule with the cores fitted to it, ``factor(w0) x world / w0``."""
    rows = profile.measured.compute_scale
    if not rows:
        cores = profile.compute.host_cores
        return max(1.0, world / cores) if cores > 0 else 1.0
    fit = fit_at(world, [(r["world"], r["factor"]) for r in rows])
    if fit.measured:
        return fit.value
    if len({r["world"] for r in rows}) == 1:
        return max(1.0, float(rows[0]["factor"]) * world / rows[0]["world"])
    return max(1.0, fit.value)
