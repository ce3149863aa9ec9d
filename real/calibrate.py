"""``testbed calibrate``: measure this machine and write a profile the simulator can use.

For each world size (2, 4, ... up to ``--ranks``) the ranks are started like a real run
and measure, all at the same time, as in a training step:

- collectives of every kind the planner uses (all_to_all_v, all_gather, reduce_scatter,
  all_reduce, p2p) for every group size that divides the world, all groups busy at once,
  at message sizes from 4 KiB to 4 MiB per member; a least-squares fit gives
  ``time = latency + bytes per member / bandwidth`` per (kind, group size, world);
- compute under contention: an expert FFN (forward + backward) on every rank at once,
  against the same work on one rank alone: ``compute_scale`` per world.

In this process (one rank, nothing else running): the expert GEMM rate by tokens per
expert (the efficiency curve and the fp32 peak), and page copies by page size (memcpy
on CPU, pinned host -> device on CUDA). Last, the *host cost per stage* (Python,
autograd and bookkeeping, which the models above do not see): a calibration scenario,
which is not one the validation judges, runs on the real backend and on the simulator
with the profile measured so far, and the difference per stage per call becomes
``measured.stage_us``.

The profile records machine, library versions and date, and says how it was made.
"""

from __future__ import annotations

import datetime
import itertools
import os
import pickle
import platform
import queue as queue_mod
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from real.comm import Comm
from real.launch import pin_to_core
from testbed.collectives import ByteLedger
from testbed.errors import RunError, ScenarioError
from testbed.profile import (Algorithms, CopyFigures, Efficiency, MachineProfile, Measured, PeakTflops,
                             load_profile, save_profile)
from testbed.runner import run_scenario
from testbed.scenario import Scenario
from testbed.stages import STAGES, stage_variant
from testbed.topology import Layout

KINDS = ("all_to_all_v", "all_gather", "reduce_scatter", "all_reduce", "p2p")
SIZES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 4 * 2**20)  # bytes per member
QUICK_SIZES = (4 * 2**10, 256 * 2**10, 2 * 2**20)
TOKENS = (8, 32, 128, 512, 2048)
PAGE_SIZES_MB = (0.0625, 0.25, 1, 4, 16)
FFN_SHAPE = (128, 256)  # H, F of the compute benchmarks


SIZES_HFT = ((64, 128, 256, "16KiB", "768KiB"), (192, 384, 768, "64KiB", "4MiB"))


def calibration_scenarios(world: int, output_dir: str) -> list[Scenario]:
    """The scenarios whose stage times give the host costs: every token strategy with
    all-reduce sync, and all-to-all with two-stage sync, each at two sizes: small (H 64,
    F 128, 256 tokens) and large (H 192, F 384, 768 tokens). 2 layers of 8 experts, EP 2,
    paging on, 24 steps. Validation grids use other sizes."""
    combos = [(t, "allreduce") for t in ("alltoall", "allgather", "hierarchical")] + [("alltoall", "two_stage")]
    out = []
    for (token, sync), (hidden, ffn, tokens, page, budget) in itertools.product(combos, SIZES_HFT):
        out.append(Scenario.from_dict({
            "model": {"hidden_size": hidden, "ffn_hidden_size": ffn, "num_layers": 2, "num_experts": 8},
            "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": max(1, world // 2), "microclusters": 1,
                        "profile": "local-cpu"},
            "parallelism": {"ep_size": 2},
            "pager": {"page_size_bytes": page, "gpu_budget_bytes": budget},
            "heat": {"update_interval": 3, "window_steps": 6},
            "comm": {"token_strategy": token, "expert_sync": sync},
            "workload": {"tokens_per_rank": tokens},
            "run": {"steps": 24, "warmup_steps": 3, "output_dir": output_dir},
        }))
    return out


# ---- measurements in the rank processes -------------------------------------------------
def _timed(fn, reps: int, burst: int = 4) -> float:
    """Seconds per call of ``fn``: the median over ``reps`` bursts of ``burst`` calls issued
    back to back after a barrier, as a training step issues its collectives (a single
    call after a barrier also pays waking every peer, which back-to-back calls hide)."""
    fn()
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        out.append((time.perf_counter() - t0) / burst)
    return float(np.median(out))


def _bench_collectives(rank: int, world: int, sizes, reps: int) -> list[dict]:
    """Rows (kind, group_size, bytes, seconds) measured with all groups busy at once."""
    rows = []
    layout = Layout(Scenario.from_dict({"cluster": {"gpus_per_node": world, "nodes_per_microcluster": 1,
                                                    "microclusters": 1}, "parallelism": {"ep_size": 1}}))
    comm = Comm(rank, ByteLedger(layout), lambda: "route")
    for g in [g for g in range(2, world + 1) if world % g == 0]:
        groups = [tuple(range(i, i + g)) for i in range(0, world, g)]
        handles = [dist.new_group(list(m)) for m in groups]  # every rank, same order
        members = groups[rank // g]
        pg = handles[rank // g]
        me = members.index(rank)
        for nbytes in sizes:
            elems = max(g, nbytes // 4 // g * g)
            x = torch.ones(elems)
            split = [elems // g] * g
            calls = {
                "all_to_all_v": lambda: comm.all_to_all(x, split, split, members, pg),
                "all_gather": lambda: comm.all_gather(x, members, pg),
                "reduce_scatter": lambda: comm.reduce_scatter(x, members, pg),
                "all_reduce": lambda: comm.all_reduce(x, members, pg),
            }
            if g == 2:  # p2p between pairs: one sends, the other receives
                peer = members[1 - me]
                calls["p2p"] = lambda: comm.p2p([("send" if me == 0 else "recv", x, peer)])
            for kind, fn in calls.items():
                per_member = elems * 4 * (1 - 1 / g) if kind == "all_to_all_v" else elems * 4
                rows.append({"kind": kind, "group_size": g, "bytes": per_member, "seconds": _timed(fn, reps)})
    return rows


def _ffn_seconds(tokens: int, reps: int = 5) -> float:
    """Forward + backward seconds of one expert FFN on ``tokens`` rows (fp32, this process)."""
    h, f = FFN_SHAPE
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(h, f, generator=g, requires_grad=True)
    w2 = torch.randn(f, h, generator=g, requires_grad=True)
    x = torch.randn(tokens, h, generator=g, requires_grad=True)

    def once():
        y = torch.nn.functional.gelu(x @ w1) @ w2
        y.sum().backward()

    once()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def _rank_main(rank: int, world: int, store_path: str, q, sizes, reps: int):
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        pin_to_core(rank)  # as the real backend's ranks run
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        rows = _bench_collectives(rank, world, sizes, reps)
        dist.barrier()
        busy = _ffn_seconds(512)  # every rank at once: contention for cores and memory
        q.put(("done", rank, pickle.dumps({"collectives": rows, "busy_ffn_s": busy})))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stops the others
        q.put(("error", rank, f"{type(e).__name__}: {e}"))


def _measure_world(world: int, sizes, reps: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="testbed-calibrate-") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, world, str(Path(tmp) / "store"), q, sizes, reps))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        try:
            while len(results) < world:
                try:
                    kind, rank, payload = q.get(timeout=600)
                except queue_mod.Empty:
                    raise RunError(f"calibration with {world} ranks made no progress for 10 minutes") from None
                if kind == "error":
                    raise RunError(f"calibration rank {rank} failed: {payload}")
                results[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    # the slowest member sets a collective's pace: take the max over ranks per row
    rows = [dict(r) for r in results[0]["collectives"]]
    for i, row in enumerate(rows):
        row["seconds"] = max(results[k]["collectives"][i]["seconds"] for k in results)
    busy = float(np.median([results[k]["busy_ffn_s"] for k in results]))
    return {"collectives": rows, "busy_ffn_s": busy}


def fit_alpha_beta(rows: list[dict], world: int) -> list[dict]:
    """Least squares ``seconds = a + bytes / b`` per (kind, group size); a, b >= 0."""
    out = []
    keys = sorted({(r["kind"], r["group_size"]) for r in rows})
    for kind, g in keys:
        pts = [(r["bytes"], r["seconds"]) for r in rows if (r["kind"], r["group_size"]) == (kind, g)]
        x, y = np.array(pts).T
        slope, intercept = np.polyfit(x, y, 1)
        slope = max(slope, 1e-15)
        intercept = max(intercept, 0.0)
        out.append({"kind": kind, "group_size": int(g), "world": world,
                    "latency_us": intercept * 1e6, "GBps": 1.0 / slope / 1e9})
    return out


# ---- measurements in this process -----------------------------------------------------------
def _gemm_curve() -> tuple[float, list[list[float]]]:
    """(peak FLOP/s, efficiency by tokens) of the expert FFN forward + backward alone."""
    h, f = FFN_SHAPE
    rates = []
    for t in TOKENS:
        flops = 3 * 4.0 * t * h * f  # forward 4 t H F, backward twice that
        rates.append(flops / _ffn_seconds(t))
    peak = max(rates)
    return peak, [[float(t), float(min(1.0, r / peak))] for t, r in zip(TOKENS, rates)]


def _copy_table() -> tuple[list[list[float]], float]:
    """([page MiB, GB/s], latency us) of page copies into a separate buffer; the latency
    is the time of the smallest copy."""
    table = []
    for mb in PAGE_SIZES_MB:
        n = int(mb * 2**20) // 4
        src, dst = torch.ones(n), torch.empty(n)
        reps = max(3, int(64 / mb))
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        seconds = (time.perf_counter() - t0) / reps
        table.append([mb, n * 4 / seconds / 1e9])
    small = int(PAGE_SIZES_MB[0] * 2**20) // 4
    src, dst = torch.ones(small), torch.empty(small)
    t0 = time.perf_counter()
    for _ in range(200):
        dst.copy_(src)
    latency_us = (time.perf_counter() - t0) / 200 * 1e6
    return table, latency_us


def _alone(world: int) -> float:
    """The contention benchmark on one rank alone, with the threads a rank of ``world`` gets."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        return _ffn_seconds(512)
    finally:
        torch.set_num_threads(before)


# ---- host costs per stage -----------------------------------------------------------------
def stage_calls(scenario: Scenario) -> dict[str, int]:
    """Calls of each stage per step, as the simulator counts host costs (phases.py)."""
    layers = scenario.model.num_layers
    calls = {s: layers for s in STAGES}
    calls["paging"] = 2 * layers + 1
    for s in ("expert_sync", "dense_sync", "optimizer", "heat"):
        calls[s] = 1
    return calls


def _host_costs(profile: MachineProfile, world: int, workdir: str, log) -> list[dict]:
    """Per stage (and strategy variant): host seconds per call = a + b x bytes handled,
    least squares over the calibration runs: what the real backend took beyond what the
    simulator models, per call."""
    path = Path(workdir) / f"calibration-{world}.toml"
    save_profile(profile, path)
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in calibration_scenarios(world, workdir):
        real = run_scenario(s, "real")
        sim = run_scenario(s.replace(workload={"trace": real["run_dir"]}, cluster={"profile": str(path)}), "sim")
        calls = stage_calls(s)
        for st in STAGES:
            residual = (real["stage_time_s"][st] - sim["stage_time_s"][st]) / calls[st]
            points.setdefault((st, stage_variant(st, s.comm.token_strategy, s.comm.expert_sync)), []).append((sim["host_bytes_by_stage"][st] / calls[st], residual))
    rows = []
    for (st, variant), pts in sorted(points.items()):
        z, r = np.array(pts).T
        per_byte = max(0.0, float(np.polyfit(z, r, 1)[0])) if np.ptp(z) > 0 else 0.0
        fixed = max(0.0, float(np.mean(r - per_byte * z)))
        rows.append({"world": world, "stage": st, "variant": variant, "us": fixed * 1e6, "us_per_MB": per_byte * 1e12})
    return rows


def calibrate(name: str, ranks: int = 4, base: str = "local-cpu", out_dir: str | Path = "profiles",
              quick: bool = False, log=print) -> Path:
    """Measure this machine and write ``out_dir/NAME.toml``; returns its path."""
    if ranks < 2:
        raise ScenarioError("--ranks", ranks, "calibration needs at least 2 ranks")
    if not name or "/" in name:
        raise ScenarioError("--name", name, "expected a plain file name")
    worlds = [w for w in (2, 4, 8, 16) if w <= ranks]
    sizes = QUICK_SIZES if quick else SIZES
    reps = 3 if quick else 7
    started = time.perf_counter()
    log(f"calibrate: expert GEMM rate and page copies on one rank ({datetime.datetime.now():%H:%M:%S})")
    threads = torch.get_num_threads()
    # as one rank of the smallest measured world computes (the launcher gives each rank
    # cores // world threads), so that contention factors compare like with like
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // worlds[0]))
    peak, curve = _gemm_curve()
    alone = {w: _alone(w) for w in worlds}
    copy_table, copy_latency = _copy_table()
    rows, scale = [], []
    for w in worlds:
        log(f"calibrate: collectives and contention with {w} ranks ({time.perf_counter() - started:.0f} s)")
        got = _measure_world(w, sizes, reps)
        rows += fit_alpha_beta(got["collectives"], w)
        scale.append({"world": w, "factor": got["busy_ffn_s"] / alone[w]})
    base_profile = load_profile(base)
    profile = replace(
        base_profile, name=name,
        description=f"this machine ({platform.node()}), CPU ranks over gloo, calibrated",
        source=("Measured by `testbed calibrate` (real/calibrate.py): collective alpha-beta per kind, group "
                "size and world size with all groups busy; compute contention per world size; expert FFN "
                "rate by tokens (fp32, H x F = %d x %d); page copies by size; host cost per stage from a "
                "calibration scenario (real minus simulated, per call). Link figures are the base "
                "profile's (%s) and only matter for ops without a measurement." % (*FFN_SHAPE, base)),
        machine=f"{platform.machine()} {platform.processor() or ''} x{os.cpu_count()} cores".strip(),
        date=datetime.date.today().isoformat(),
        versions={"torch": torch.__version__, "python": platform.python_version(), "backend": "gloo"},
        compute=replace(base_profile.compute, peak_tflops=PeakTflops(fp32=peak / 1e12,
                                                                    bf16=base_profile.compute.peak_tflops.bf16,
                                                                    fp16=base_profile.compute.peak_tflops.fp16),
                        efficiency=Efficiency(grouped=tuple(map(tuple, curve)), loop=tuple(map(tuple, curve)))),
        copy=CopyFigures(table=tuple(map(tuple, copy_table)), latency_us=copy_latency, overlap=0.0),
        collectives=replace(base_profile.collectives,
                            algorithm=Algorithms(all_reduce="ring", reduce_scatter="all_reduce",
                                                 all_gather="ring", all_to_all_v="direct")),
        measured=Measured(collectives=tuple(rows), compute_scale=tuple(scale), stage_us=()),
    )
    torch.set_num_threads(threads)
    host = []
    with tempfile.TemporaryDirectory(prefix="testbed-calibrate-") as tmp:
        for w in worlds:
            log(f"calibrate: host cost per stage with {w} ranks ({time.perf_counter() - started:.0f} s)")
            host += _host_costs(profile, w, tmp, log)
    profile = replace(profile, measured=replace(profile.measured, stage_us=tuple(host)))
    path = Path(out_dir) / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path)
    log(f"calibrate: wrote {path} in {time.perf_counter() - started:.0f} s")
    return path

