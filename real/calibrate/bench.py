"""Micro-benchmarks that ``testbed calibrate`` and ``testbed collective`` run in rank processes.

Ranks are started as a real run starts them (spawned, pinned to cores, gloo; on an
emulated cluster each in its network namespace) and measure, all at the same time:

- ``software_latency``: tiny collectives of every kind the planner uses, at every group
  size that divides the world with all groups busy, timed in back-to-back bursts as a
  step issues them. Their bytes are negligible, so what they take is the library's
  software cost (per call, per algorithm step) and the links' latency.
- ``link_rate`` (loopback only): ranks in pairs exchange large messages both ways at
  once, so every "link" of the loopback carries traffic: bytes per second per direction.
- ``ffn_seconds`` on every rank at once: an expert FFN forward + backward (compute
  contention for cores and memory).

``measure_nccl_latency`` (``testbed calibrate --device cuda``, CUDA only) runs
``software_latency`` on NCCL ranks, one GPU each.

``collective_table`` (``testbed collective --backend real``) times one collective kind
by size as nccl-tests does, on the same ranks (``spawn_ranks``).

Nothing here fits anything; ``real.calibrate.tool`` does.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import tempfile
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from real.comm.collectives import Comm, _all_gather_tensor, _reduce_scatter_tensor, all_to_all_p2p
from real.launch.launcher import pin_to_core
from real.netem import EmulatedFabric, join_rank_network
from real.paging.paged_store import PagedExpertStore
from testbed.core.errors import RunError
from testbed.policy.collectives import ByteLedger
from testbed.policy.pager import RankPager
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.sections import PagerConfig
from testbed.scenario.topology import Layout

TINY_BYTES = 64  # per member: the software cost, not the bytes
RATE_BYTES = 8 * 2**20  # per direction of a pair in the loopback link-rate benchmark


def timed(fn, reps: int, burst: int = 4, sync=None) -> float:
    """Seconds per call of ``fn``: the median over ``reps`` bursts of ``burst`` calls issued
    back to back after a barrier, as a training step issues its collectives (a single
    call after a barrier also pays waking every peer, which back-to-back calls hide).
    ``sync`` (CUDA: ``torch.cuda.synchronize``) waits for the device before and after a burst."""
    sync = sync or (lambda: None)
    fn()
    out = []
    for _ in range(reps):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / burst)
    return float(np.median(out))


def _groups(world: int) -> list[int]:
    return [g for g in range(2, world + 1) if world % g == 0]


def software_latency(rank: int, world: int, reps: int, emulated: bool, device: str = "cpu") -> list[dict]:
    """Rows (kind, group_size, seconds) of tiny collectives, all groups of a size busy at once.
    Groups are contiguous ranks (a node, then a leaf, ...). The all-to-all is the one a
    real run on this network uses (``real.comm.collectives.Comm``). ``device = "cuda"``: NCCL ranks,
    the tensors on this rank's GPU, each burst timed to the device's completion."""
    cuda = device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else None
    layout = Layout(Scenario.from_dict({"cluster": {"gpus_per_node": world, "nodes_per_microcluster": 1,
                                                    "microclusters": 1}, "parallelism": {"ep_size": 1}}))
    comm = Comm(rank, ByteLedger(layout), lambda: "route", p2p_all_to_all=emulated)
    rows = []
    for g in _groups(world):
        groups = [tuple(range(i, i + g)) for i in range(0, world, g)]
        handles = [dist.new_group(list(m)) for m in groups]  # every rank, same order
        members, pg = groups[rank // g], handles[rank // g]
        me = members.index(rank)
        x = torch.ones(max(g, TINY_BYTES // 4 // g * g), device=dev)
        split = [x.numel() // g] * g
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
            rows.append({"kind": kind, "group_size": g, "members": members, "seconds": timed(fn, reps, sync=sync)})
    return rows


def link_rate(rank: int, world: int, reps: int) -> float:
    """Bytes/s per direction when every rank exchanges ``RATE_BYTES`` with a partner at once."""
    peer = rank ^ 1
    if peer >= world:
        return 0.0
    send = torch.ones(RATE_BYTES // 4)
    recv = torch.empty_like(send)

    def exchange():
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return RATE_BYTES / timed(exchange, reps, burst=2)


def ffn_seconds(tokens: int, hidden: int, ffn: int, reps: int = 5) -> float:
    """Forward + backward seconds of one expert FFN on ``tokens`` rows (fp32, this process)."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(hidden, ffn, generator=g, requires_grad=True)
    w2 = torch.randn(ffn, hidden, generator=g, requires_grad=True)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)

    def once():
        y = torch.nn.functional.gelu(x @ w1) @ w2
        y.sum().backward()

    return median_seconds(once, reps)


def median_seconds(once, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``once`` after one warm-up call."""
    once()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def attention_seconds(tokens: int, seq_len: int, hidden: int, heads: int, reps: int = 5) -> float:
    """Forward + backward seconds of causal attention's core (``scaled_dot_product_attention``
    on ``tokens`` tokens in sequences of ``seq_len``; fp32, this process)."""
    g = torch.Generator().manual_seed(0)
    shape = (tokens // seq_len, heads, seq_len, hidden // heads)
    q, k, v = (torch.randn(*shape, generator=g, requires_grad=True) for _ in range(3))

    def once():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return median_seconds(once, reps)


def _calibration_work(rank: int, world: int, report, reps: int, shape: tuple[int, int, int], loopback: bool) -> dict:
    """What one rank of ``testbed calibrate`` measures (module doc)."""
    out = {"latency": software_latency(rank, world, reps, emulated=not loopback)}
    if loopback:
        out["link_Bps"] = link_rate(rank, world, reps)
    dist.barrier()
    out["busy_ffn_s"] = ffn_seconds(*shape)  # every rank at once: contention for cores and memory
    return out


def _nccl_latency_work(rank: int, world: int, report, reps: int) -> dict:
    """What one GPU rank of ``testbed calibrate --device cuda`` measures: NCCL's software
    latency (``software_latency`` on this rank's GPU)."""
    return {"latency": software_latency(rank, world, reps, emulated=False, device="cuda")}


def measure_nccl_latency(world: int, reps: int) -> list[dict]:
    """``software_latency`` rows of ``world`` NCCL ranks, one GPU each (CUDA only), each
    row the slowest member's seconds."""
    results = spawn_ranks(world, _nccl_latency_work, (reps,), device="cuda", what="NCCL latency benchmark")
    rows = [dict(r) for r in results[0]["latency"]]
    for i, row in enumerate(rows):
        row["seconds"] = max(results[k]["latency"][i]["seconds"] for k in results)
    return rows


def _rank_main(rank: int, world: int, store_path: str, q, work, args: tuple, netns: tuple[str, str] | None,
               device: str):
    try:
        join_rank_network(netns)
        if device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            pin_to_core(rank)  # as the real backend's ranks run
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.FileStore(store_path, world),
                                rank=rank, world_size=world, timeout=timedelta(seconds=300))
        out = work(rank, world, lambda payload: q.put(("progress", rank, pickle.dumps(payload))), *args)
        q.put(("done", rank, pickle.dumps(out)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stops the others
        q.put(("error", rank, f"{type(e).__name__}: {e}"))


def spawn_ranks(world: int, work, args: tuple = (), fabric=None, device: str = "cpu", what: str = "calibration",
                on_progress=None) -> dict[int, object]:
    """Run ``work(rank, world, report, *args)`` in ``world`` spawned rank processes that
    share one process group (gloo; NCCL with ``device = "cuda"``, one GPU per rank), CPU
    ranks pinned to cores as a real run pins them, each in its namespace of ``fabric``
    (an ``EmulatedFabric``) when given. ``work`` is a module-level function; ``report(x)``
    hands ``x`` to ``on_progress(rank, x)`` in this process at once. Returns rank -> what
    ``work`` returned; a rank that fails, or no word from the ranks for 10 minutes, raises
    ``RunError`` naming ``what``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="testbed-bench-") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(
            r, world, str(Path(tmp) / "store"), q, work, args,
            fabric.rank_network(r) if fabric is not None else None, device)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        try:
            while len(results) < world:
                try:
                    kind, rank, payload = q.get(timeout=600)
                except queue_mod.Empty:
                    raise RunError(f"{what} with {world} ranks made no progress for 10 minutes") from None
                if kind == "error":
                    raise RunError(f"{what} rank {rank} failed: {payload}")
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(rank, pickle.loads(payload))
                    continue
                results[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return results


def measure_world(world: int, reps: int, shape: tuple[int, int, int], fabric=None) -> dict:
    """Run the rank benchmarks with ``world`` ranks (on ``fabric``'s namespaces when given).

    Returns ``latency`` rows (the slowest member's seconds per row), ``link_Bps`` (loopback:
    the median over ranks) and ``busy_ffn_s`` (median over ranks)."""
    results = spawn_ranks(world, _calibration_work, (reps, shape, fabric is None), fabric)
    rows = [dict(r) for r in results[0]["latency"]]
    for i, row in enumerate(rows):  # the slowest member sets a collective's pace
        row["seconds"] = max(results[k]["latency"][i]["seconds"] for k in results)
    out = {"latency": rows, "busy_ffn_s": float(np.median([results[k]["busy_ffn_s"] for k in results]))}
    if fabric is None:
        out["link_Bps"] = float(np.median([results[k]["link_Bps"] for k in results if results[k]["link_Bps"] > 0]))
    return out


# ---- one collective by size, as nccl-tests times it -----------------------------------------
def _collective_call(kind: str, nbytes: int, rank: int, world: int, device, p2p_all_to_all: bool):
    """A call of ``kind`` on float32 buffers allocated once, ``nbytes`` counted as nccl-tests
    counts them (``testbed.cli.collective``): all_reduce a buffer of nbytes in place;
    all_gather nbytes / world from each rank into an output of nbytes; reduce_scatter an
    input of nbytes into nbytes / world; all_to_all_v nbytes / world to each rank (itself
    included) from a send buffer of nbytes into a receive buffer of nbytes. The all-to-all
    is the one a real run on this network issues (``real.comm.collectives.Comm.all_to_all``)."""
    count = nbytes // 4
    part = count // world
    x = torch.zeros(count if kind != "all_gather" else part, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "all_gather":
        out = torch.empty(part * world, device=device)
        return lambda: _all_gather_tensor(out, x)
    if kind == "reduce_scatter":
        out = torch.empty(part, device=device)
        return lambda: _reduce_scatter_tensor(out, x)
    out = torch.empty_like(x)
    split = [part] * world
    if p2p_all_to_all:
        return lambda: all_to_all_p2p(out, x, split, split, list(range(world)), rank, None)
    return lambda: dist.all_to_all_single(out, x, split, split)


def _collective_work(rank: int, world: int, report, kind: str, sizes: list[int], iters: int, warmup: int,
                     p2p_all_to_all: bool) -> None:
    """Per size: ``warmup`` calls, then ``iters`` back to back after a barrier, timed
    around them (the device synchronised on CUDA); the seconds per call are averaged over
    the ranks with an all-reduce, as nccl-tests does, and rank 0 reports each size as
    ``(nbytes, mean seconds, slowest rank's seconds)``."""
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for nbytes in sizes:
        call = _collective_call(kind, nbytes, rank, world, device, p2p_all_to_all)
        for _ in range(warmup):
            call()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        seconds = (time.perf_counter() - t0) / iters
        del call
        mean, slowest = (torch.tensor([seconds], dtype=torch.float64, device=device) for _ in range(2))
        dist.all_reduce(mean)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            report((nbytes, float(mean) / world, float(slowest)))


def collective_table(scenario: Scenario, kind: str, sizes: list[int], iters: int = 20, warmup: int = 5,
                     on_row=None) -> dict:
    """Time one collective ``kind`` (``all_reduce``, ``all_gather``, ``reduce_scatter`` or
    ``all_to_all_v``) at each of ``sizes`` (bytes, nccl-tests' sizes: ``_collective_call``)
    on ``scenario.world_size`` ranks of this machine: gloo CPU ranks over the loopback, or
    on the emulated cluster of ``scenario.cluster`` when ``real.network = "emulated"``;
    NCCL with one GPU per rank when this machine has the GPUs (and ``real.device`` is not
    cpu). ``on_row(row)`` gets each row as soon as it is measured. Returns ``library``
    (gloo or nccl), ``device`` and ``rows``: ``size``, ``seconds`` (mean over ranks of the
    seconds per call), ``seconds_max`` (the slowest rank's), ``algorithm`` (the library:
    which algorithm it ran is its own choice)."""
    world = scenario.world_size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if scenario.real.device != "cpu" and gpus >= world else "cpu"
    if scenario.real.device == "cuda" and device != "cuda":
        raise RunError(f"real.device = cuda needs {world} GPUs, this machine has {gpus}")
    emulated = scenario.real.network == "emulated"
    library = "nccl" if device == "cuda" else "gloo"
    rows = []

    def row(_rank, got):
        rows.append({"size": got[0], "seconds": got[1], "seconds_max": got[2], "algorithm": library})
        if on_row is not None:
            on_row(rows[-1])

    with EmulatedFabric(scenario, load_profile(scenario.cluster.profile)) if emulated else nullcontext() as fabric:
        spawn_ranks(world, _collective_work, (kind, list(sizes), iters, warmup, emulated and device == "cpu"),
                    fabric, device, f"{kind} benchmark", on_progress=row)
    return {"library": library, "device": device, "rows": rows}


def page_touch_us(expert_bytes: int = 256 * 1024, small_page: int = 4096, experts: int = 8, reps: int = 20) -> dict:
    """Host microseconds per page when the real backend reads an expert's weights to
    compute (``PagedExpertStore.read``) and updates them in the optimizer step
    (``update``), on a CPU rank: the time with ``small_page`` pages minus the time with
    one page an expert, over the extra pages. All pages resident (no copies from host)."""
    elems = expert_bytes // 4
    grad = torch.full((elems,), 1e-3)

    def timed(page_bytes: int) -> tuple[float, float, int]:
        config = PagerConfig(page_size_bytes=page_bytes, gpu_budget_bytes=0, emergency_free_fraction=0.0)
        pager = RankPager(0, range(experts), expert_bytes, config)
        store = PagedExpertStore(pager, elems, torch.float32, torch.device("cpu"),
                                 lambda i: torch.full((elems,), float(i)))
        out = torch.empty(elems)
        store.read(0, out)
        t0 = time.perf_counter()
        for _ in range(reps):
            for i in range(experts):
                store.read(i, out)
        read_s = (time.perf_counter() - t0) / (reps * experts)
        t0 = time.perf_counter()
        for _ in range(reps):
            for i in range(experts):
                store.update(i, grad, 1e-6)
        update_s = (time.perf_counter() - t0) / (reps * experts)
        return read_s, update_s, pager.pages_per_expert

    r_small, u_small, n_small = timed(small_page)
    r_one, u_one, n_one = timed(expert_bytes)
    extra = max(1, n_small - n_one)
    return {"read_page_us": max(0.0, (r_small - r_one) / extra * 1e6),
            "update_page_us": max(0.0, (u_small - u_one) / extra * 1e6)}
