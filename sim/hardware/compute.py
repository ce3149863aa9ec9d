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

All times in seconds; sizes in bytes; no randomness.
"""

from __future__ import annotations

import numpy as np

from sim.hardware.software_latency import fit_at
from testbed.scenario.profile import MachineProfile
from testbed.scenario.sections import DTYPE_BYTES

GEMMS_FORWARD = 2  # x @ w1, h @ w2
GEMMS_BACKWARD = 4  # input and weight gradient of each matrix


class ComputeModel:
    """Roofline times of one GPU (or CPU rank) of ``profile`` in ``dtype``."""

    def __init__(self, profile: MachineProfile, dtype: str, world: int = 1, shared_cores: bool = False):
        """``shared_cores``: the caller shares CPU cores between ranks itself
        (``sim.hardware.cores.CorePool``), so times are for one rank alone on its core."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPE_BYTES)})")
        self.profile = profile
        self.dtype = dtype
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.peak = profile.compute.peak(dtype)  # FLOP/s
        self.memory_bw = profile.compute.memory_GBps * 1e9  # bytes/s
        self.launch = profile.compute.launch_us * 1e-6  # s
        self.scale = 1.0 if shared_cores else contention_factor(profile, world)

    def expert_time(self, tokens_per_expert, hidden: int, ffn: int, kernel: str = "grouped",
                    backward: bool = False) -> float:
        """Seconds to run the experts of one rank on ``tokens_per_expert`` (one count each)."""
        t = np.asarray(tokens_per_expert, dtype=np.float64).reshape(1, -1)
        return float(self.expert_times(t, hidden, ffn, kernel, backward)[0])

    def expert_times(self, tokens, hidden: int, ffn: int, kernel: str = "grouped",
                     backward: bool = False) -> np.ndarray:
        """[ranks] seconds for ``tokens`` [ranks, experts per rank], one rank per row."""
        t = np.asarray(tokens, dtype=np.float64)
        mult = 2 if backward else 1
        gemms = GEMMS_BACKWARD if backward else GEMMS_FORWARD
        flops = 4.0 * t * hidden * ffn * mult  # per expert
        weight_bytes = 2.0 * hidden * ffn * self.dtype_bytes * mult  # per active expert
        eff = self.profile.compute.efficiency_at
        idle = t.sum(axis=1) <= 0
        if kernel == "loop":
            active = t > 0
            with np.errstate(divide="ignore", invalid="ignore"):
                compute = np.where(active, flops / (self.peak * eff("loop", np.where(active, t, 1.0))), 0.0)
            floor = max(weight_bytes / self.memory_bw, gemms * self.launch)
            seconds = np.where(active, np.maximum(compute, floor), 0.0).sum(axis=1)
        elif kernel == "grouped":
            mean = np.maximum(t.mean(axis=1), 1e-12)
            compute = flops.sum(axis=1) / (self.peak * eff("grouped", mean))
            memory = weight_bytes * np.count_nonzero(t, axis=1) / self.memory_bw
            seconds = np.maximum(np.maximum(compute, memory), gemms * self.launch)
        else:
            raise ValueError(f"unknown expert kernel {kernel!r} (grouped or loop)")
        return np.where(idle, 0.0, seconds * self.scale)

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

    def gemm_time(self, flops, rows: int, kernel: str) -> float:
        """A GEMM of ``flops`` at the efficiency the profile's ``kernel`` curve gives
        ``rows`` (``dense``: rows; ``attention``: a sequence of ``rows``), or one launch."""
        if flops <= 0:
            return 0.0
        return max(flops / (self.peak * self.profile.compute.efficiency_at(kernel, rows)), self.launch) * self.scale

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

    def block_slowdown(self, hidden: int, ffn: int, page_bytes: int) -> float:
        """How much longer an expert's GEMMs take in blocks of one page each (M14 page
        pipelining) than at full width. Page k of the flat weights holds rows of w1 (F
        elements each) or of w2 (H each), so a block contracts over ``page / row`` of the
        H (or F) dimension; a GEMM of contraction width w runs at ``w / (w + k)`` of its
        full-width efficiency relative ``full / (full + k)``, k the profile's
        ``compute.block_half_width`` (an assumption unless measured). The mean over the
        two matrices (they have the same FLOPs)."""
        k = self.profile.compute.block_half_width
        elems = page_bytes / self.dtype_bytes

        def slower(full: float, row: float) -> float:
            width = min(full, elems / row)
            return (width + k) / width * full / (full + k)

        return 0.5 * (slower(hidden, ffn) + slower(ffn, hidden))

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
