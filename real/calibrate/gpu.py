"""``testbed calibrate --device cuda``: measure this machine's GPU (and NCCL across its
GPUs) and write a profile the GPU validation grid can judge with.

What it measures (``real.calibrate.device_bench``; GPU 0, bf16 unless said):

- dense GEMMs by rows (``DeviceShapes.dense_rows`` x K x K): ``compute.efficiency.dense``,
  and the fp32 and fp16 ceilings at K x K x K;
- the expert FFN forward by tokens per expert, as one grouped GEMM and as a loop of GEMMs
  per expert (E experts, hidden H, ffn F): ``compute.efficiency.grouped`` and ``loop``;
- causal attention's core forward and backward by sequence length:
  ``compute.efficiency.attention``;
- the bf16 ceiling ``compute.peak_tflops.bf16``: the best rate of the GEMMs above, so
  every curve is a fraction of one measured rate and none is clamped;
- device memory bandwidth (a device-to-device copy), the launch cost of a tiny kernel,
  and device memory (the allocator's total);
- pinned host -> device page copies by page size (``copy.table``; ``links.pcie`` is the
  largest page's rate), the per-copy latency fitted to single-page copies, and the share
  of a side-stream copy hidden behind matmuls (``copy.overlap``);
- with two or more GPUs, NCCL's software latency per call and per algorithm step at
  worlds 2, 4, ... up to ``--ranks`` (``measured.collective_latency``, fitted to tiny
  collectives as the CPU calibration fits gloo's). With one GPU it is not measured and
  the profile says so.

Everything else (links, collectives, bookkeeping) is the base profile's (default
``h200``), with its source. No scenario's runs are fitted here (no host cost per stage),
so ``calibration.scenarios`` is empty. ``measure_compute`` and ``device_profile`` run on
any device (the tests run them on the CPU at small shapes); ``measure_copies`` and
``calibrate_cuda`` need CUDA.
"""

from __future__ import annotations

import datetime
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from real.calibrate.bench import measure_nccl_latency
from real.calibrate.device_bench import (
    attention_rate,
    copy_latency,
    copy_overlap,
    dense_rate,
    expert_rate,
    launch_seconds,
    memory_rate,
    pinned_copies,
)
from real.calibrate.latency_fit import QUICK_REPS, REPS, fit_software_latency
from testbed.core.errors import ScenarioError
from testbed.scenario.profile import (
    CALIBRATE_TOOL,
    Calibration,
    Efficiency,
    LinkFigures,
    MachineProfile,
    Measured,
    PeakTflops,
    load_profile,
    save_profile,
)
from testbed.scenario.scenario import Scenario

MiB = 2**20


@dataclass(frozen=True)
class DeviceShapes:
    """The shapes of every measurement of one device calibration."""

    dense_rows: tuple[int, ...]  # rows of the dense GEMMs, each rows x dense_k times dense_k x dense_k
    dense_k: int
    expert_tokens: tuple[int, ...]  # tokens per expert of the expert FFN
    experts: int
    hidden: int
    ffn: int
    seq_lens: tuple[int, ...]  # attention's sequence lengths
    attention_tokens: int
    attention_hidden: int
    heads: int
    memory_bytes: int  # the device-to-device copy
    pages_MiB: tuple[float, ...] = ()  # CUDA only: page sizes of the copies
    copy_bytes: int = 0  # CUDA only: bytes streamed per page size
    overlap_bytes: int = 0  # CUDA only: the copy hidden behind matmuls
    overlap_matmul: int = 0  # CUDA only: the matmul's side


#: an H200-class GPU (the shapes of benchmarks/h200-ceilings.json where it has them)
GPU_SHAPES = DeviceShapes(dense_rows=(1024, 2048, 4096, 8192, 16384), dense_k=8192,
                          expert_tokens=(128, 512, 1024, 4096), experts=16, hidden=4096, ffn=1408,
                          seq_lens=(512, 1024, 2048, 4096, 8192), attention_tokens=16384, attention_hidden=2048,
                          heads=16, memory_bytes=1024 * MiB, pages_MiB=(1, 2, 4, 8, 16, 32, 64, 128),
                          copy_bytes=512 * MiB, overlap_bytes=256 * MiB, overlap_matmul=8192)
QUICK_GPU_SHAPES = replace(GPU_SHAPES, dense_rows=(2048, 8192), expert_tokens=(128, 512, 4096),
                           seq_lens=(512, 4096), pages_MiB=(1, 4, 16, 64), copy_bytes=256 * MiB)


def _curve(points: dict[int, float], peak: float) -> tuple[tuple[float, float], ...]:
    return tuple((float(x), float(min(1.0, r / peak))) for x, r in sorted(points.items()))


def measure_compute(device, dtype, shapes: DeviceShapes, reps: int) -> dict:
    """Rates (FLOP/s) of every GEMM kind by its key (``dense`` by rows, ``grouped`` and
    ``loop`` by tokens per expert, ``attention`` by sequence length), the ``fp32`` and
    ``fp16`` ceilings, ``memory_Bps`` (read + write), ``launch_s`` on ``device``."""
    s = shapes
    out = {
        "dense": {r: dense_rate(device, dtype, r, s.dense_k, s.dense_k, reps) for r in s.dense_rows},
        "grouped": {t: expert_rate(device, dtype, "grouped", s.experts, t, s.hidden, s.ffn, reps)
                    for t in s.expert_tokens},
        "loop": {t: expert_rate(device, dtype, "loop", s.experts, t, s.hidden, s.ffn, reps) for t in s.expert_tokens},
        "attention": {q: attention_rate(device, dtype, s.attention_tokens, q, s.attention_hidden, s.heads, reps)
                      for q in s.seq_lens},
    }
    k = s.dense_k
    out["fp32"] = dense_rate(device, torch.float32, k, k, k, reps)
    out["fp16"] = dense_rate(device, torch.float16, k, k, k, reps)
    out["memory_Bps"] = memory_rate(device, s.memory_bytes, reps)
    out["launch_s"] = launch_seconds(device, reps=reps)
    return out


def measure_copies(device, shapes: DeviceShapes, reps: int) -> dict:
    """CUDA only: ``table`` ([page MiB, GB/s]), ``latency_s`` and ``overlap`` of pinned
    host -> device page copies (``real.calibrate.device_bench``)."""
    rows = pinned_copies(device, shapes.pages_MiB, shapes.copy_bytes, reps)
    overlap = copy_overlap(device, shapes.overlap_bytes, shapes.overlap_matmul, reps)
    return {"table": [(r["page_MiB"], r["GBps"]) for r in rows], "latency_s": copy_latency(rows),
            "overlap": overlap["hidden"], "overlap_runs": overlap}


def device_profile(base: MachineProfile, name: str, compute: dict, copies: dict, latency_rows: list[dict],
                   shapes: DeviceShapes, gpu: str, gpus: int, memory_GB: float, quick: bool,
                   versions: dict[str, str]) -> MachineProfile:
    """The profile of a device calibration: ``base`` with what was measured replaced, and
    every replaced figure's ``sources`` entry saying how it was measured."""
    bf16 = max(max(compute[k].values()) for k in ("dense", "grouped", "loop"))
    s = shapes
    how = f"measured by {CALIBRATE_TOOL} --device cuda on {gpu} ({datetime.date.today().isoformat()})"
    dense_shapes = f"{'/'.join(map(str, s.dense_rows))} rows x {s.dense_k} x {s.dense_k}"
    ffn = f"{s.experts} experts of H {s.hidden}, F {s.ffn}, tokens per expert {'/'.join(map(str, s.expert_tokens))}"
    table = tuple((float(mb), float(g)) for mb, g in copies["table"])
    latency_us = copies["latency_s"] * 1e6
    sources = dict(base.sources)
    sources.update({
        "compute.peak_tflops.bf16": f"{how}: the best bf16 rate of the dense GEMMs ({dense_shapes}) and the expert "
                                    f"FFNs ({ffn})",
        "compute.peak_tflops.fp32": f"{how}: a {s.dense_k}^3 fp32 matmul (TF32 "
                                    f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'})",
        "compute.peak_tflops.fp16": f"{how}: a {s.dense_k}^3 fp16 matmul",
        "compute.efficiency.dense": f"{how}: bf16 matmuls of {dense_shapes}, forward, / the bf16 ceiling",
        "compute.efficiency.grouped": f"{how}: the expert FFN forward as one torch._grouped_mm per matrix ({ffn}) "
                                      "/ the bf16 ceiling",
        "compute.efficiency.loop": f"{how}: the expert FFN forward as one GEMM pair per expert ({ffn}) / the bf16 "
                                   "ceiling",
        "compute.efficiency.attention": f"{how}: causal scaled_dot_product_attention forward and backward, "
                                        f"{s.attention_tokens} tokens, {s.heads} heads of "
                                        f"{s.attention_hidden // s.heads}, sequences of "
                                        f"{'/'.join(map(str, s.seq_lens))} / the bf16 ceiling",
        "compute.memory_GBps": f"{how}: a device-to-device copy of {s.memory_bytes // MiB} MiB, read + write bytes",
        "compute.launch_us": f"{how}: a one-element in-place add issued 200 times back to back",
        "compute.device_memory_GB": f"{how}: torch.cuda.get_device_properties(0).total_memory",
        "copy.table": f"{how}: pinned host -> device pages of {'/'.join(f'{m:g}' for m in s.pages_MiB)} MiB, "
                      f"{s.copy_bytes // MiB} MiB back to back on a side stream",
        "copy.latency_us": f"{how}: fitted to single-page copies (intercept of time against bytes)",
        "copy.overlap": f"{how}: a {s.overlap_bytes // MiB} MiB side-stream copy beside {s.overlap_matmul}^3 bf16 "
                        "matmuls, (copy + compute - both) / copy",
        "links.pcie": f"{how}: the largest page's pinned copy rate and the fitted copy latency",
    })
    if latency_rows:
        sources["measured.collective_latency"] = (f"{how}: tiny NCCL collectives of every kind and group size "
                                                  f"on {gpus} GPUs, fitted per world (fit_software_latency)")
    else:
        base_note = base.source_of("collectives.latency_us") or "the base profile's"
        sources["collectives.latency_us"] = (f"not measured: this machine has {gpus} GPU (NCCL's latency needs two "
                                             f"or more); {base_note}")
    source = (f"Measured by `{CALIBRATE_TOOL} --device cuda` (real/calibrate/gpu.py, real/calibrate/device_bench.py) on "
              f"{gpus} x {gpu}: GEMM rates by kind and shape, attention's core by sequence length, memory bandwidth, "
              "launch cost, pinned page copies by size, copy latency and copy/compute overlap"
              + (", NCCL's software latency per world" if latency_rows else
                 f"; NCCL's latency not measured ({gpus} GPU)")
              + f". Links, collectives and bookkeeping are the base profile's ({base.name}). [sources] names the "
              "source of every figure.")
    return replace(
        base, name=name, source=source, date=datetime.date.today().isoformat(), versions=versions,
        description=f"this machine ({platform.node()}), {gpus} x {gpu}, NCCL, calibrated",
        machine=f"{gpus} x {gpu}, {platform.machine()} host",
        links=replace(base.links, pcie=LinkFigures(bandwidth_GBps=table[-1][1], latency_us=latency_us)),
        compute=replace(base.compute, memory_GBps=compute["memory_Bps"] / 1e9, launch_us=compute["launch_s"] * 1e6,
                        device_memory_GB=memory_GB, host_cores=0.0,
                        peak_tflops=PeakTflops(fp32=compute["fp32"] / 1e12, bf16=bf16 / 1e12,
                                               fp16=compute["fp16"] / 1e12),
                        efficiency=Efficiency(grouped=_curve(compute["grouped"], bf16),
                                              loop=_curve(compute["loop"], bf16),
                                              dense=_curve(compute["dense"], bf16),
                                              attention=_curve(compute["attention"], bf16))),
        copy=replace(base.copy, table=table, latency_us=latency_us, overlap=float(copies["overlap"]),
                     read_page_us=0.0, update_page_us=0.0),
        measured=Measured(collective_latency=tuple(latency_rows)),
        calibration=Calibration(tool=CALIBRATE_TOOL, device="cuda", fabric="device", gpu=gpu, quick=quick),
        sources=sources)


def calibrate_cuda(name: str, ranks: int = 4, base: str = "h200", out_dir: str | Path = "profiles",
                   quick: bool = False, log=print) -> Path:
    """Measure GPU 0 of this machine (and NCCL over up to ``ranks`` of its GPUs) and write
    ``out_dir/NAME.toml``; returns its path. Needs CUDA."""
    if not torch.cuda.is_available():
        raise ScenarioError("--device", "cuda", "this machine has no CUDA device (torch.cuda.is_available() is false)")
    base_profile = load_profile(base)
    shapes, reps = (QUICK_GPU_SHAPES, QUICK_REPS) if quick else (GPU_SHAPES, REPS)
    device = torch.device("cuda", 0)
    gpu, gpus = torch.cuda.get_device_name(0), torch.cuda.device_count()
    started = time.perf_counter()
    log(f"calibrate: GEMMs, attention, memory and launches on {gpu} ({datetime.datetime.now():%H:%M:%S})")
    compute = measure_compute(device, torch.bfloat16, shapes, reps)
    log(f"calibrate: pinned page copies and overlap ({time.perf_counter() - started:.0f} s)")
    copies = measure_copies(device, shapes, reps)
    latency = []
    for w in [w for w in (2, 4, 8, 16) if w <= min(ranks, gpus)]:
        log(f"calibrate: NCCL latency with {w} GPUs ({time.perf_counter() - started:.0f} s)")
        cluster = Scenario.from_dict({"cluster": {"gpus_per_node": w, "nodes_per_microcluster": 1,
                                                  "microclusters": 1}, "parallelism": {"ep_size": 1}}).cluster
        latency.append(fit_software_latency(measure_nccl_latency(w, reps), w, cluster, base_profile))
    versions = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version(),
                "backend": "nccl", "host": platform.node(), "gpu": gpu}
    memory_GB = torch.cuda.get_device_properties(0).total_memory / 1e9
    profile = device_profile(base_profile, name, compute, copies, latency, shapes, gpu, gpus, memory_GB, quick,
                             versions)
    path = save_profile(profile, Path(out_dir) / f"{name}.toml")
    log(f"calibrate: wrote {path} in {time.perf_counter() - started:.0f} s")
    return path
