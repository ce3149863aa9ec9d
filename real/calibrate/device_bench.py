"""What ``testbed calibrate --device cuda`` measures on one device (``real.calibrate.gpu``).

Device-generic (each takes a ``torch.device``; on the CPU they run at small shapes, which
is how the tests check them):

- ``dense_rate``: FLOP/s of one GEMM of ``rows`` x K times K x N (the dense curve, by rows);
- ``expert_rate``: FLOP/s of an expert FFN forward over E experts of T tokens each, as one
  grouped GEMM (``torch._grouped_mm``, the real backend's CUDA kernel) or one GEMM pair per
  expert (the loop): the grouped and loop curves, by tokens per expert;
- ``attention_rate``: FLOP/s of causal attention's core, forward and backward
  (``scaled_dot_product_attention``: flash attention on CUDA), by sequence length;
- ``memory_rate``: bytes read + written per second by a device-to-device copy;
- ``launch_seconds``: the time of one tiny kernel issued back to back (the launch cost).

CUDA only (pinned host memory, side streams), apart below:

- ``pinned_copies``: host -> device page copies by page size, streamed (GB/s) and one page
  alone (seconds), as the pager issues them (pinned memory, a side stream);
- ``copy_latency``: the fixed cost per copy fitted to the single-page times;
- ``copy_overlap``: the share of a side-stream copy hidden behind a matmul on the compute
  stream.

Times are medians over ``reps`` runs after a warm-up: CUDA events on CUDA (the device's
own time), ``perf_counter`` on the CPU. FLOPs count 2 per multiply-add; nothing here fits
or writes anything.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from real.kernels.experts import GroupLayout, expert_ffn, grouped_forward
from testbed.model.whole_model import attention_core_flops

MiB = 2**20


class Clock:
    """Median seconds of a piece of work on ``device``."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, fn, reps: int) -> float:
        """Median seconds of ``fn()`` over ``reps`` calls after one warm-up call."""
        fn()
        self.sync()
        out = []
        for _ in range(reps):
            if self.cuda:  # the device's own time: events on the current stream
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) * 1e-3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return float(np.median(out))


def _randn(shape, device, dtype, seed: int, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)
    return x.requires_grad_(grad)


# ---- device-generic --------------------------------------------------------------------------
def dense_rate(device, dtype, rows: int, k: int, n: int, reps: int = 5, backward: bool = False) -> float:
    """FLOP/s of ``rows`` x ``k`` times ``k`` x ``n`` (2 rows k n FLOPs), or with
    ``backward`` of that GEMM's forward and backward (3x the FLOPs: input and weight
    gradients)."""
    x = _randn((rows, k), device, dtype, 1, 0.25, grad=backward)
    w = _randn((k, n), device, dtype, 2, k ** -0.5, grad=backward)
    flops = 2.0 * rows * k * n * (3 if backward else 1)

    def once():
        if backward:
            (x @ w).sum().backward()
        else:
            with torch.no_grad():
                x @ w

    return flops / Clock(device).seconds(once, reps)


def expert_rate(device, dtype, kernel: str, experts: int, tokens: int, hidden: int, ffn: int,
                reps: int = 5) -> float:
    """FLOP/s of the expert FFN forward (gelu(x w1) w2, 4 E T H F FLOPs) on ``experts``
    experts of ``tokens`` rows each, as one grouped GEMM per matrix (``grouped``) or one
    GEMM pair per expert (``loop``)."""
    if kernel not in ("grouped", "loop"):
        raise ValueError(f"unknown expert kernel {kernel!r} (grouped or loop)")
    x = _randn((experts * tokens, hidden), device, dtype, 3, 0.25)
    w = _randn((experts, 2 * hidden * ffn), device, dtype, 4, 1 / 64)
    if kernel == "grouped":
        layout = GroupLayout([tokens] * experts, device)

        def once():
            grouped_forward(x, w, layout, hidden, ffn)
    else:
        flats = list(w)

        def once():
            expert_ffn(x, [tokens] * experts, flats, hidden, ffn, grouped=False)

    with torch.no_grad():
        seconds = Clock(device).seconds(once, reps)
    return 4.0 * experts * tokens * hidden * ffn / seconds


def attention_rate(device, dtype, tokens: int, seq_len: int, hidden: int, heads: int, reps: int = 5) -> float:
    """FLOP/s of causal attention's core, forward and backward (3 x
    ``testbed.model.whole_model.attention_core_flops``), on ``tokens`` tokens in sequences of
    ``seq_len``, ``heads`` heads of ``hidden / heads``."""
    shape = (max(1, tokens // seq_len), heads, seq_len, hidden // heads)
    q, k, v = (_randn(shape, device, dtype, 5 + i, grad=True) for i in range(3))

    def once():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = 3 * attention_core_flops(shape[0] * seq_len, seq_len, shape[1] * shape[3])
    return flops / Clock(device).seconds(once, reps)


def memory_rate(device, nbytes: int, reps: int = 5) -> float:
    """Bytes read + written per second by copying ``nbytes`` between two device buffers."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / Clock(device).seconds(lambda: dst.copy_(src), reps)


def launch_seconds(device, ops: int = 200, reps: int = 5) -> float:
    """Seconds per tiny kernel (an in-place add on one element) issued back to back."""
    x = torch.zeros(1, device=device)

    def once():
        for _ in range(ops):
            x.add_(1.0)

    return Clock(device).seconds(once, reps) / ops


# ---- CUDA only: pinned host memory and side streams ------------------------------------------
def _need_cuda(device) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{device}: pinned copies and side streams need a CUDA device")
    return device


def pinned_copies(device, page_sizes_MiB, total_bytes: int, reps: int = 5) -> list[dict]:
    """Per page size: ``GBps`` of host (pinned) -> device copies of ``total_bytes`` as
    back-to-back pages on a side stream, and ``single_s``, the seconds of one page alone."""
    device = _need_cuda(device)
    host = torch.ones(total_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total_bytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    clock = Clock(device)
    rows = []
    for mb in page_sizes_MiB:
        page = int(mb * MiB)
        pages = max(1, total_bytes // page)

        def streamed():  # the side stream starts after the clock's start event, the clock stops after it
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for i in range(pages):
                    dev[i * page:(i + 1) * page].copy_(host[i * page:(i + 1) * page], non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(stream)

        def single():
            dev[:page].copy_(host[:page], non_blocking=True)

        seconds = clock.seconds(streamed, reps)
        rows.append({"page_MiB": float(mb), "GBps": pages * page / seconds / 1e9,
                     "single_s": clock.seconds(single, reps)})
    return rows


def copy_latency(rows: list[dict]) -> float:
    """Seconds of fixed cost per copy: the intercept of a least-squares line through the
    single-page times against the page bytes (``pinned_copies`` rows), at least 0."""
    x = np.array([r["page_MiB"] * MiB for r in rows])
    y = np.array([r["single_s"] for r in rows])
    if len(rows) < 2:
        return float(max(0.0, y[0] - x[0] / (rows[0]["GBps"] * 1e9)))
    slope, intercept = np.polyfit(x, y, 1)
    return float(max(0.0, intercept))


def copy_overlap(device, copy_bytes: int, matmul: int, reps: int = 5) -> dict:
    """The share of a host -> device copy of ``copy_bytes`` (pinned, side stream) hidden
    behind ``matmul`` x ``matmul`` bf16 matmuls on the compute stream, repeated to take
    about three times the copy: (copy + compute - both) / copy, clamped to [0, 1]. Wall
    seconds with the device synchronised around each."""
    device = _need_cuda(device)
    host = torch.ones(copy_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    a = _randn((matmul, matmul), device, torch.bfloat16, 7, 0.25)
    b = _randn((matmul, matmul), device, torch.bfloat16, 8, matmul ** -0.5)
    stream = torch.cuda.Stream(device)
    clock = Clock(device)

    def copy():
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)

    def wall(fn) -> float:
        out = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            out.append(time.perf_counter() - t0)
        return float(np.median(out[1:]))

    one = clock.seconds(lambda: a @ b, reps)
    alone = wall(copy)
    n = max(1, round(3 * alone / one))

    def compute():
        for _ in range(n):
            a @ b

    def both():
        copy()
        compute()

    computed, together = wall(compute), wall(both)
    hidden = min(1.0, max(0.0, (alone + computed - together) / alone))
    return {"copy_s": alone, "compute_s": computed, "both_s": together, "hidden": hidden}
