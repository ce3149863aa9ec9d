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
  mean tokens per expert over all experts passed; max(compute, memory, launches).

Every GEMM names the profile's curve it is timed at (``compute.efficiency``): expert
GEMMs ``grouped`` or ``loop`` (by tokens per expert, ``scenario.expert_kernel``); the
router's gate and every dense GEMM of the whole transformer ``dense`` (by rows);
flash attention's core ``attention`` (by sequence length).

SwiGLU (``model.ffn_activation``): an expert has three matrices (gate and up H x F, down
F x H), so 2 x 3 x tokens x H x F FLOPs forward and 1.5 x gelu's weight bytes at equal F;
its gate and up run as one GEMM (Megatron-Core's linear_fc1 of 2 F), so the launches stay
2 forward and 4 backward.

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

    def expert_cast_bytes(self, tokens, hidden: int, ffn: int, matrices: int = 2, backward: bool = False):
        """[..., experts] bytes of the fp8 casts of each expert's two GEMMs on ``tokens``
        rows (``testbed.model.fp8_casts.gemm_cast_bytes``): H x (matrices - 1) F, then F x H."""
        t = np.asarray(tokens, dtype=np.float64)
        return sum(gemm_cast_bytes(t, k, n, self.dtype_bytes, self.fp8_scaling, backward)
                   for k, n in ((hidden, (matrices - 1) * ffn), (ffn, hidden)))

    def linears_time(self, rows: int, linears: list[tuple[int, int]], backward: bool = False,
                     recompute: bool = False) -> float:
        """Seconds of the linear layers ``linears`` ((inputs, outputs) each) on ``rows``
        tokens as dense GEMMs (the ``dense`` curve by rows, at the GEMMs' ceiling), forward
        or backward (twice the FLOPs; with ``recompute`` the forward first), with fp8's casts."""
        flops = 2.0 * rows * sum(k * n for k, n in linears)
        seconds = self.gemm_time(flops, rows, "dense", fp8=True)
        casts = self.linears_cast_seconds(rows, linears) if self.fp8 else 0.0
        if not backward:
            return seconds + casts
        out = 2.0 * seconds + (self.linears_cast_seconds(rows, linears, backward=True) if self.fp8 else 0.0)
        return out + (seconds + casts if recompute else 0.0)

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
