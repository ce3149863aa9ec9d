"""``testbed calibrate``: measure this machine and write a profile the simulator can use.

What is measured stays a measurement; what is fitted is few constants, from scenarios
listed in the profile's ``[calibration]`` section, against which a validation checks (and
refuses) its points (``testbed.run.sources.check_out_of_sample``). Per world size
(loopback: 2, 4, ... up to ``--ranks``; emulated: the 8 ranks of a 2 x 2 x 2 cluster on
the emulated fabric of the base profile):

- ``real.calibrate.bench`` in rank processes: tiny collectives of every kind and group size (the
  library's software latency: ``call_us`` per call plus ``step_us`` per sequential step
  of its algorithm, fitted by least squares over kinds and group sizes), loopback link
  rates (ranks in pairs exchanging large messages at once), compute under contention;
- in this process: the expert FFN rate by tokens per expert (the grouped and loop curves)
  and a dense GEMM's by rows (the dense curve) at a shape of their own (``FFN_SHAPE``),
  fp32 (the fp32 peak: the best of them), and the dense GEMM's bf16 and fp16 rates (their
  peaks); causal attention's core by sequence length (``SEQ_LENS``;
  ``compute.efficiency.attention``), and page copies by page size.

The link figures of an emulated profile are not touched: its links are shaped at those
rates, and ``testbed net probe`` measured their latency and protocol overhead. The
collectives' bytes are always timed by the simulator's network model: no collective
time table is ever fitted.

Last, the *host cost per stage* (Python, autograd, bookkeeping), which no model above
sees: calibration scenarios (``calibration_scenarios``: hidden sizes, token counts and
expert counts of their own) run on the real backend and on the simulator with the
profile measured so far; the residual per stage per call becomes ``measured.stage_us``,
a fixed cost per call plus a cost per MB of the stage's data, except for communication
stages, which get a fixed cost only (a cost per byte there would stand in for the
network model).

Every table is measured per world size, and the simulator applies a row only at the
world it was measured at; at other worlds it runs its model with the parameters fitted
to the rows (``sim.hardware.software_latency``: a least-squares line in world through the
measured worlds, one world's constant when only one was measured), counted as fitted.
Measure the worlds you will simulate (``--ranks``).

The profile records machine, library versions and date, says how it was made
(``source``, and ``sources`` for every figure it measured), and what calibration did
(``[calibration]``: device, network, and every scenario whose runs it fitted), which the
validation checks (``testbed.run.sources``).

``--device cuda`` measures a GPU instead (``real.calibrate.gpu``).
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from real.calibrate.bench import attention_seconds, ffn_seconds, measure_world, page_touch_us
from real.calibrate.device_bench import dense_rate
from real.calibrate.gpu import calibrate_cuda
from real.calibrate.latency_fit import QUICK_REPS, REPS, fit_software_latency
from real.launch.launcher import usable_cores
from real.netem import EmulatedFabric
from testbed.core.errors import ScenarioError
from testbed.core.stages import STAGES, TOKEN_STAGES, stage_variant
from testbed.model.whole_model import attention_core_flops
from testbed.run.runner import run_scenario
from testbed.run.sources import scenario_record
from testbed.scenario.profile import (
    CALIBRATE_TOOL,
    Algorithms,
    Calibration,
    CopyFigures,
    Efficiency,
    LinkFigures,
    Links,
    MachineProfile,
    Measured,
    PeakTflops,
    load_profile,
    save_profile,
)
from testbed.scenario.scenario import Scenario

TOKENS = (8, 32, 128, 512, 2048)
PAGE_SIZES_MB = (0.0625, 0.25, 1, 4, 16)
FFN_SHAPE = (96, 320)  # H, F of the compute benchmarks: no validation scenario has these
CONTENTION_TOKENS = 512
#: stages that are mostly a collective: their host cost is a fixed cost per call only
COMM_STAGES = TOKEN_STAGES + ("expert_sync", "dense_sync")
#: (hidden, ffn, tokens per rank, experts) of the two calibration sizes (docs of calibration_scenarios)
CALIBRATION_SHAPES = ((96, 192, 256, 12), (192, 384, 640, 4))
#: the whole transformer's calibration scenarios: sequences of 64 tokens, 4 heads, a vocabulary of 384
CALIBRATION_SEQ_LEN = 64
#: sequence lengths of the attention benchmark (its own shape: hidden FFN_SHAPE[0], 4 heads, 2,048 tokens)
SEQ_LENS = (32, 128, 512)
EMULATED_CLUSTER = {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 2}


def _pages(hidden: int, ffn: int, experts_per_rank: int, layers: int) -> tuple[str, str]:
    """(page size, GPU budget): about 9 pages per expert, a budget of 3/4 of the rank's experts."""
    expert = 2 * hidden * ffn * 4
    page = 16 * 2**10 if expert < 256 * 2**10 else 64 * 2**10
    pages = -(-expert // page) * experts_per_rank * layers
    return f"{page // 1024}KiB", f"{max(1, 3 * pages // 4) * page // 1024}KiB"


def calibration_scenarios(world: int, output_dir: str, fabric: str = "loopback", profile: str = "local-cpu",
                          steps: int = 24) -> list[Scenario]:
    """The scenarios whose stage times give the host costs: every token strategy with
    all-reduce sync, and all-to-all with two-stage sync, each at the two
    ``CALIBRATION_SHAPES`` (2 layers, paging on under a budget of 3/4 of a rank's experts).
    Loopback: 2 ranks per node, EP 2; emulated: the 2 x 2 x 2 cluster, EP 4. They are
    recorded in the profile (``calibration.scenarios``); a validation refuses any point
    with one's model shape and token count."""
    combos = [(t, "allreduce") for t in ("alltoall", "allgather", "hierarchical")] + [("alltoall", "two_stage")]
    if fabric == "emulated":
        cluster, ep = dict(EMULATED_CLUSTER), 4
    else:
        cluster, ep = {"gpus_per_node": 2, "nodes_per_microcluster": max(1, world // 2), "microclusters": 1}, 2
    out = []
    # the whole transformer (the dense stages' host costs): all-to-all, all-reduce sync, both shapes
    whole = [(("alltoall", "allreduce"), shape, True) for shape in CALIBRATION_SHAPES]
    for (token, sync), (hidden, ffn, tokens, experts), transformer in (
            [(c, shape, False) for c, shape in itertools.product(combos, CALIBRATION_SHAPES)] + whole):
        page, budget = _pages(hidden, ffn, experts // ep, 2)
        out.append(Scenario.from_dict({
            "model": {"hidden_size": hidden, "ffn_hidden_size": ffn, "num_layers": 2, "num_experts": experts},
            "cluster": dict(cluster, profile=profile),
            "parallelism": {"ep_size": ep},
            "pager": {"page_size_bytes": page, "gpu_budget_bytes": budget},
            "heat": {"update_interval": 3, "window_steps": 6},
            "comm": {"token_strategy": token, "expert_sync": sync},
            "workload": {"tokens_per_rank": tokens},
            "transformer": ({"enabled": True, "num_heads": 4, "seq_len": CALIBRATION_SEQ_LEN, "vocab_size": 384}
                            if transformer else {}),
            "real": {"network": fabric},
            "run": {"steps": steps, "warmup_steps": 3, "output_dir": output_dir},
        }))
    return out


# ---- fits ----------------------------------------------------------------------------------
def scenario_name(s: Scenario) -> str:
    """A calibration scenario's name in ``calibration.scenarios``."""
    m = s.model
    return (f"{s.comm.token_strategy}/{s.comm.expert_sync} {m.hidden_size}x{m.ffn_hidden_size}x{m.num_experts} "
            f"{s.workload.tokens_per_rank} tokens{' whole' if s.transformer.enabled else ''} x{s.world_size}")


# ---- measurements in this process -----------------------------------------------------------
def _gemm_curves() -> dict:
    """Rates (FLOP/s) on this CPU, forward + backward, at ``FFN_SHAPE``: ``ffn`` (the
    expert FFN) and ``dense`` (one H x F GEMM) by rows in ``TOKENS``, fp32; and the dense
    GEMM's ``bf16`` and ``fp16`` rates at ``best_rows``, where its fp32 rate is best."""
    h, f = FFN_SHAPE
    ffn = {t: 3 * 4.0 * t * h * f / ffn_seconds(t, h, f) for t in TOKENS}  # forward 4 t H F, backward twice that
    cpu = torch.device("cpu")
    dense = {t: dense_rate(cpu, torch.float32, t, h, f, backward=True) for t in TOKENS}
    best = max(dense, key=dense.get)
    return {"ffn": ffn, "dense": dense, "best_rows": best,
            "bf16": dense_rate(cpu, torch.bfloat16, best, h, f, backward=True),
            "fp16": dense_rate(cpu, torch.float16, best, h, f, backward=True)}


def _efficiency(rates: dict, peak: float) -> tuple[tuple[float, float], ...]:
    return tuple((float(t), float(min(1.0, r / peak))) for t, r in sorted(rates.items()))


def _attention_curve(peak: float) -> list[list[float]]:
    """Efficiency by sequence length of causal attention's core (scores and weighted
    values, forward + backward, ``attention_seconds``) against ``peak`` FLOP/s."""
    hidden, heads, tokens = FFN_SHAPE[0], 4, 2048
    out = []
    for s in SEQ_LENS:
        flops = 3 * attention_core_flops(tokens, s, hidden)  # forward and backward (twice it)
        out.append([float(s), float(min(1.0, flops / attention_seconds(tokens, s, hidden, heads) / peak))])
    return out


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
        return ffn_seconds(CONTENTION_TOKENS, *FFN_SHAPE)
    finally:
        torch.set_num_threads(before)


# ---- host costs per stage -----------------------------------------------------------------
def stage_calls(scenario: Scenario) -> dict[str, int]:
    """Calls of each stage per step, as the simulator counts host costs (sim/step/phase_builder.py)."""
    layers = scenario.model.num_layers
    calls = {s: layers for s in STAGES}
    calls["paging"] = 2 * layers + 1
    for s in ("expert_sync", "dense_sync", "optimizer", "heat"):
        calls[s] = 1
    for s in ("dense", "dense_backward"):  # the whole transformer's: a block per layer and the head
        calls[s] = layers + 1 if scenario.transformer.enabled else 0
    return calls


def fit_host_costs(points: dict[tuple[str, str], list[tuple[float, float]]], world: int) -> list[dict]:
    """``measured.stage_us`` rows from (bytes handled per call, residual seconds per call)
    points per (stage, variant): fixed + per byte by least squares, both >= 0; stages in
    ``COMM_STAGES`` get the mean residual as a fixed cost only."""
    rows = []
    for (st, variant), pts in sorted(points.items()):
        z, r = np.array(pts).T
        per_byte = 0.0
        if st not in COMM_STAGES and np.ptp(z) > 0:
            per_byte = max(0.0, float(np.polyfit(z, r, 1)[0]))
        fixed = max(0.0, float(np.mean(r - per_byte * z)))
        rows.append({"world": world, "stage": st, "variant": variant, "us": fixed * 1e6, "us_per_MB": per_byte * 1e12})
    return rows


def _host_costs(profile: MachineProfile, world: int, fabric: str, workdir: str, steps: int, log) -> list[dict]:
    """What the real backend took per stage call beyond what the simulator models, over the
    calibration scenarios (``fit_host_costs``)."""
    path = Path(workdir) / f"calibration-{world}.toml"
    save_profile(profile, path)
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    scenarios = calibration_scenarios(world, workdir, fabric, str(path), steps)
    for i, s in enumerate(scenarios, 1):
        real = run_scenario(s, "real")
        sim = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
        log(f"calibrate: host costs, scenario {i}/{len(scenarios)}: measured {real['step_time_s'] * 1e3:.1f} ms, "
            f"modelled without host costs {sim['step_time_s'] * 1e3:.1f} ms")
        calls = stage_calls(s)
        for st in STAGES:
            if not calls[st]:  # a stage the real backend never runs (the whole transformer's)
                continue
            residual = (real["stage_time_s"][st] - sim["stage_time_s"][st]) / calls[st]
            key = (st, stage_variant(st, s.comm.token_strategy, s.comm.expert_sync))
            points.setdefault(key, []).append((sim["host_bytes_by_stage"][st] / calls[st], residual))
    return fit_host_costs(points, world)


# ---- the whole calibration ------------------------------------------------------------------
def _measured_sources(fabric: str, base: str) -> dict[str, str]:
    """``sources`` entries of the figures a CPU calibration measures (the others keep the
    base profile's)."""
    how = f"measured by {CALIBRATE_TOOL} (--fabric {fabric}) on this machine"
    h, f = FFN_SHAPE
    out = {
        "compute.peak_tflops.fp32": f"{how}: the best fp32 rate of the expert FFN and the dense GEMM at H x F = "
                                    f"{h} x {f}, forward + backward",
        "compute.peak_tflops.bf16": f"{how}: the fp32 peak x the bf16 / fp32 rate of the dense GEMM (H x F = {h} x "
                                    f"{f}, forward + backward) at the rows where its fp32 rate is best",
        "compute.peak_tflops.fp16": f"{how}: the fp32 peak x the fp16 / fp32 rate of the dense GEMM (H x F = {h} x "
                                    f"{f}, forward + backward) at the rows where its fp32 rate is best",
        "compute.efficiency.grouped": f"{how}: the expert FFN forward + backward by tokens "
                                      f"({'/'.join(map(str, TOKENS))}), fp32; the CPU has one kernel, so loop is the "
                                      "same curve",
        "compute.efficiency.loop": f"{how}: the same curve as grouped (one kernel on the CPU)",
        "compute.efficiency.dense": f"{how}: one H x F GEMM forward + backward by rows ({'/'.join(map(str, TOKENS))}), "
                                    "fp32",
        "compute.efficiency.attention": f"{how}: causal attention's core forward + backward by sequence length "
                                        f"({'/'.join(map(str, SEQ_LENS))}), fp32",
        "compute.host_cores": f"{how}: the cores this process may run on",
        "copy.table": f"{how}: copies between host buffers by page size",
        "copy.latency_us": f"{how}: the time of the smallest copy",
        "copy.overlap": "CPU ranks: copies and compute share the cores, nothing is hidden",
        "copy.read_page_us": f"{how}: paged reads of 4 KiB pages against whole-expert pages",
        "copy.update_page_us": f"{how}: paged updates of 4 KiB pages against whole-expert pages",
        "collectives.algorithm": "gloo: ring all-reduce and all-gather, reduce-scatter as an all-reduce, direct "
                                 "all-to-all",
        "measured": f"{how}: library latency, compute contention and host cost per stage (the source above)",
    }
    if fabric == "loopback":
        out["links"] = f"{how}: ranks exchanging 8 MiB in pairs at once (every link the same loopback path)"
    return out


def calibrate(name: str, ranks: int = 4, base: str | None = None, out_dir: str | Path = "profiles",
              quick: bool = False, fabric: str = "loopback", log=print, device: str = "cpu") -> Path:
    """Measure this machine and write ``out_dir/NAME.toml``; returns its path.

    ``device``: ``cpu`` (CPU ranks over gloo) or ``cuda`` (this machine's GPU and NCCL,
    ``real.calibrate.gpu``; base profile ``h200``; loopback only). ``fabric``:
    ``loopback`` (ranks over this machine's loopback; worlds 2, 4, ... up to ``ranks``;
    base profile ``local-cpu``) or ``emulated`` (8 ranks on the emulated 2 x 2 x 2
    cluster of the base profile, default ``emulated``; needs root)."""
    if device not in ("cpu", "cuda"):
        raise ScenarioError("--device", device, "expected cpu or cuda")
    if fabric not in ("loopback", "emulated"):
        raise ScenarioError("--fabric", fabric, "expected loopback or emulated")
    if device == "cuda" and fabric != "loopback":
        raise ScenarioError("--fabric", fabric, "a GPU calibration measures NCCL over this machine's own GPUs: "
                            "leave --fabric out")
    if ranks < 2:
        raise ScenarioError("--ranks", ranks, "calibration needs at least 2 ranks")
    if not name or "/" in name:
        raise ScenarioError("--name", name, "expected a plain file name")
    if device == "cuda":
        return calibrate_cuda(name, ranks, base or "h200", out_dir, quick, log)
    base = base or ("emulated" if fabric == "emulated" else "local-cpu")
    base_profile = load_profile(base)
    if fabric == "emulated":
        worlds = [8]
    else:
        worlds = [w for w in (2, 4, 8, 16) if w <= ranks]
    reps = QUICK_REPS if quick else REPS
    started = time.perf_counter()
    log(f"calibrate: expert GEMM rate and page copies on one rank ({datetime.datetime.now():%H:%M:%S})")
    threads = torch.get_num_threads()
    # as one rank of the smallest measured world computes (the launcher gives each rank
    # cores // world threads), so that contention factors compare like with like
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // worlds[0]))
    rates = _gemm_curves()
    peak = max(max(rates["ffn"].values()), max(rates["dense"].values()))  # fp32: every curve a fraction of it
    # the 16-bit ceilings: the fp32 peak times the dense GEMM's 16-bit / fp32 rate where fp32 is best,
    # so that the fp32 curves at those ceilings give the 16-bit rate measured there
    ceiling = {d: peak * rates[d] / rates["dense"][rates["best_rows"]] for d in ("bf16", "fp16")}
    curve = _efficiency(rates["ffn"], peak)
    alone = {w: _alone(w) for w in worlds}
    copy_table, copy_latency = _copy_table()
    touch = page_touch_us()  # per-page host cost of reading and updating paged weights
    torch.set_num_threads(threads)
    latency, scale, link_Bps = [], [], None
    for w in worlds:
        log(f"calibrate: library latency and contention with {w} ranks ({time.perf_counter() - started:.0f} s)")
        if fabric == "emulated":
            scenario = Scenario.from_dict({"cluster": dict(EMULATED_CLUSTER, profile=base), "parallelism": {"ep_size": 4}})
            net = EmulatedFabric(scenario, base_profile)
        else:
            scenario = Scenario.from_dict({"cluster": {"gpus_per_node": w, "nodes_per_microcluster": 1,
                                                       "microclusters": 1}, "parallelism": {"ep_size": 1}})
            net = None
        with net if net is not None else nullcontext():
            got = measure_world(w, reps, (CONTENTION_TOKENS, *FFN_SHAPE), net)
        latency.append(fit_software_latency(got["latency"], w, scenario.cluster, base_profile))
        scale.append({"world": w, "factor": got["busy_ffn_s"] / alone[w]})
        link_Bps = got.get("link_Bps", link_Bps)
    links = base_profile.links
    if fabric == "loopback" and link_Bps:  # every "link" of a loopback is the same memory-to-memory path
        rate = LinkFigures(bandwidth_GBps=link_Bps / 1e9, latency_us=links.nic.latency_us)
        links = Links(nvlink=rate, nic=rate, spine=rate, pcie=links.pcie)
    how = ("Measured by `testbed calibrate --fabric %s` (real/calibrate/tool.py, real/calibrate/bench.py): the library's "
           "software latency per call and per algorithm step, fitted to tiny collectives of every kind and group "
           "size with all groups busy; compute contention per world size; expert FFN and dense GEMM rates by "
           "tokens (fp32, H x F = %d x %d; the dense GEMM's bf16 and fp16 rates for their peaks); causal "
           "attention's core by sequence length (%s tokens, 4 heads); page copies by size; the host's cost per "
           "page of reading and updating paged weights (4 KiB against whole-expert pages of 256 KiB experts); %s "
           "host cost per stage fitted to calibration scenarios (real minus simulated, per call; shapes H x F x "
           "tokens x experts %s, each also as a whole transformer of 4 heads, sequences of %d and a vocabulary of "
           "384), every one listed in [calibration] scenarios, against which a validation checks its points. "
           "[sources] names how each measured figure was taken; the others are the base profile's."
           % (fabric, *FFN_SHAPE, "/".join(map(str, SEQ_LENS)),
              "loopback link rate from ranks exchanging 8 MiB in pairs at once;" if fabric == "loopback"
              else "link rates, latencies and protocol overhead are the base profile's (%s);" % base,
              ", ".join("x".join(map(str, shape)) for shape in CALIBRATION_SHAPES), CALIBRATION_SEQ_LEN))
    profile = replace(
        base_profile, name=name,
        description=f"this machine ({platform.node()}), CPU ranks over gloo on a{'n emulated' if fabric == 'emulated' else ' loopback'} network, calibrated",
        source=how,
        machine=f"{platform.machine()} {platform.processor() or ''} x{os.cpu_count()} cores".strip(),
        date=datetime.date.today().isoformat(),
        versions={"torch": torch.__version__, "python": platform.python_version(), "backend": "gloo",
                  "host": platform.node()},
        links=links,
        compute=replace(base_profile.compute, host_cores=float(len(usable_cores())),
                        peak_tflops=PeakTflops(fp32=peak / 1e12, bf16=ceiling["bf16"] / 1e12,
                                               fp16=ceiling["fp16"] / 1e12),
                        efficiency=Efficiency(grouped=curve, loop=curve, dense=_efficiency(rates["dense"], peak),
                                              attention=tuple(map(tuple, _attention_curve(peak))))),
        copy=CopyFigures(table=tuple(map(tuple, copy_table)), latency_us=copy_latency, overlap=0.0,
                         read_page_us=touch["read_page_us"], update_page_us=touch["update_page_us"]),
        collectives=replace(base_profile.collectives,
                            algorithm=Algorithms(all_reduce="ring", reduce_scatter="all_reduce",
                                                 all_gather="ring", all_to_all_v="direct")),
        measured=Measured(collective_latency=tuple(latency), compute_scale=tuple(scale), stage_us=()),
        sources=dict(base_profile.sources, **_measured_sources(fabric, base)),
    )
    host = []
    with tempfile.TemporaryDirectory(prefix="testbed-calibrate-") as tmp:
        for w in worlds:
            log(f"calibrate: host cost per stage with {w} ranks ({time.perf_counter() - started:.0f} s)")
            host += _host_costs(profile, w, fabric, tmp, 12 if quick else 24, log)
    fitted = tuple(scenario_record(scenario_name(s), s) for w in worlds
                   for s in calibration_scenarios(w, "runs", fabric, base))
    profile = replace(profile, measured=replace(profile.measured, stage_us=tuple(host)),
                      calibration=Calibration(tool=CALIBRATE_TOOL, device="cpu", fabric=fabric, quick=quick,
                                              scenarios=fitted))
    path = Path(out_dir) / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path)
    log(f"calibrate: wrote {path} in {time.perf_counter() - started:.0f} s")
    return path
