"""Starting the ranks of a real run, and noticing when one fails.

Two ways, one entry point (``RealBackend.run``):

- *spawned* (``run_ranks``): this process starts every rank of the scenario on this
  machine as a separate process (``spawn``); they meet through a file store in a private
  temporary folder, so concurrent runs never race for a port. Every rank starts each
  step at a gate this process takes part in and sends its step metrics here through a
  queue (``real.comm.control.LocalControl``); this process merges them and streams each
  record on. On an emulated cluster (``real.network = "emulated"``) the ranks run in
  the network namespaces of an ``EmulatedFabric`` (``real.netem``). If a rank raises, or dies without a word
  (killed, out of memory), the parent stops every other rank at once and raises
  ``RunError`` naming the rank: a run never hangs on a dead peer.
- *under torchrun* (``run_in_process``): ``torchrun`` (or any launcher that sets
  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT) started this process as
  one rank; it joins the others through ``env://`` and runs its rank in-process, on
  GPU ``LOCAL_RANK`` when there is one. torchrun's agent stops the job when a rank fails.

Collectives carry the scenario's ``real.timeout_s`` either way.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue as queue_mod
import signal
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from real.comm.control import DistControl, GateKeeper, LocalControl, merge_step
from real.comm.groups import eager_device
from real.netem import EmulatedFabric, join_rank_network
from real.rank.worker import RankRunner
from testbed.core.errors import RunError, ScenarioError, signals_stop_work
from testbed.scenario.links import counted_bytes_by_level
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

POLL_S = 0.2
REPORTED_EXIT = 3  # a rank that raised and sent its error exits with this code
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env() -> dict[str, str] | None:
    """The launcher's variables when torchrun (or the like) started this process, else None."""
    if all(v in os.environ for v in TORCHRUN_VARS):
        return {v: os.environ[v] for v in TORCHRUN_VARS}
    return None


def usable_cores() -> list[int]:
    """The cores this process (and the ranks it starts) may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin_to_core(rank: int) -> None:
    """Keep a CPU rank on one core (rank mod cores): ranks that migrate between cores make
    timings vary by 10% from run to run on a small machine. Not done on CUDA."""
    cores = usable_cores()
    if len(cores) > 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def pick_device(scenario: Scenario) -> str:
    """"cuda" when asked for or when auto finds a GPU per rank, else "cpu"."""
    want = scenario.real.device
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and gpus < scenario.world_size:
        raise RunError(f"real.device = cuda needs {scenario.world_size} GPUs, this machine has {gpus}")
    if want == "cuda" or (want == "auto" and gpus >= scenario.world_size):
        return "cuda"
    return "cpu"


def _rank_main(rank: int, scenario_dict: dict, store_path: str, q, barrier, device_kind: str, debug: dict | None,
               run_dir: str | None, resume, netns: tuple[str, str] | None):
    """Body of one rank process. ``netns``: (namespace, interface) of this rank on an
    emulated cluster: the rank enters the namespace before it opens any socket, and gloo
    binds to that interface."""
    try:
        join_rank_network(netns)
        scenario = Scenario.from_dict(scenario_dict)
        world = scenario.world_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        if device_kind == "cpu":
            pin_to_core(rank)
        store = dist.FileStore(store_path, world)
        backend = "nccl" if device_kind == "cuda" else "gloo"
        device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
        if device_kind == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=scenario.real.timeout_s), **eager_device(device))
        runner = RankRunner(scenario, rank, device)
        q.put(("up", rank))  # in the process group, model built: the launcher shows progress
        control = LocalControl(rank, barrier, q, scenario.real.timeout_s)
        result = runner.run(control, debug, run_dir, resume)
        # plain bytes: torch would pass tensors as shared-memory handles that die with this process
        q.put(("done", rank, pickle.dumps(result)))
        del runner
        _tear_down()
    except BaseException as e:  # report, then die: the parent stops the others
        q.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        q.close()
        q.join_thread()
        os._exit(REPORTED_EXIT)


def say(text: str) -> None:
    """One progress line on stderr (``progress``: where the CLI shows progress)."""
    print(text, file=sys.stderr, flush=True)


def run_ranks(scenario: Scenario, on_step, debug: dict | None = None, run_dir: str | None = None,
              resume=None, progress: bool = False) -> dict:
    """Run every rank on this machine; returns rank 0's final payload.

    ``progress``: say on stderr when the ranks start and when all are up (in the process
    group, model built: several seconds for 8 CPU ranks, each importing torch).

    With ``real.network = "emulated"`` the ranks run in the network namespaces of an
    ``EmulatedFabric`` made for this run, which is torn down however the run ends; each
    step's record then carries ``wire_bytes_by_level``, read from the kernel's counters
    while every rank waits at the step's gate.

    ``run_dir`` and ``resume``: see ``RankRunner.run``. ``debug`` is for tests (see
    ``RankRunner.run``): make a rank die, capture tensors.
    """
    world = scenario.world_size
    device_kind = pick_device(scenario)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(world + 1)  # the ranks and this process's GateKeeper
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="testbed-") as tmp:
        fabric = None
        if scenario.real.network == "emulated":
            fabric = stack.enter_context(EmulatedFabric(scenario, load_profile(scenario.cluster.profile)))
        stack.enter_context(signals_stop_work(signal.SIGTERM, signal.SIGHUP))  # unwind like Ctrl-C: teardown runs
        store_path = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_rank_main,
                             args=(r, scenario.to_dict(), store_path, q, barrier, device_kind, debug, run_dir, resume,
                                   fabric.rank_network(r) if fabric else None),
                             name=f"testbed-rank{r}") for r in range(world)]
        keeper = GateKeeper(barrier, fabric.counters if fabric else None)
        started = time.perf_counter()
        if progress:
            say(f"real: starting {world} ranks ({'nccl' if device_kind == 'cuda' else 'gloo'}"
                f"{', emulated cluster' if fabric else ''})...")
        for p in procs:
            p.start()

        def up() -> None:
            say(f"real: {world} ranks up ({time.perf_counter() - started:.1f} s)")
        try:
            return _collect(procs, q, on_step, keeper, fabric is not None, scenario.real.timeout_s,
                            up if progress else None)
        finally:
            keeper.stop()
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)


def _silent_death(procs, done, wait_s: float) -> int | None:
    """A rank that exited abnormally without reporting an error, if one does within wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        for r, p in enumerate(procs):
            if r not in done and p.exitcode not in (None, 0, REPORTED_EXIT):
                return r
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _collect(procs, q, on_step, keeper: GateKeeper, counted: bool, timeout_s: float, on_up=None) -> dict:
    """Merge the ranks' step metrics into records (in step order) until every rank is done;
    stop at the first rank that fails. ``counted``: the keeper reads link counters at every
    gate, and each record gets the bytes per level between its step's two gates.
    ``on_up()``: called once every rank has said it is up."""
    world = len(procs)
    up: set[int] = set()
    done: dict[int, dict] = {}
    steps: dict[int, dict] = {}  # step -> {"locals": {rank: local}, "lead": lead}
    ready: list[tuple[int, dict]] = []  # complete steps waiting for their closing gate
    merged = [0]  # records handed on: the k-th step of this run lies between gates k and k + 1

    def flush(wait: bool) -> None:
        while ready:
            if counted and not wait and len(keeper.results) <= merged[0] + 1:
                return  # the step's closing gate has not been passed yet
            step, entry = ready.pop(0)
            wire = None
            if counted:
                k = merged[0]
                wire = counted_bytes_by_level(keeper.result(k, timeout_s), keeper.result(k + 1, timeout_s))
            on_step(merge_step(step, [entry["locals"][r] for r in range(world)], entry["lead"], wire))
            merged[0] += 1

    while len(done) < world:
        flush(wait=False)
        try:
            msg = q.get(timeout=POLL_S)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
            if not dead:
                continue
            try:  # a rank that raised sent its error just before exiting: prefer that message
                msg = q.get(timeout=1.0)
            except queue_mod.Empty:
                r = dead[0]
                raise RunError(f"rank {r} died (exit code {procs[r].exitcode}); the other ranks were stopped") from None
        kind, rank = msg[0], msg[1]
        if kind == "up":
            up.add(rank)
            if len(up) == world and on_up is not None:
                on_up()
        elif kind == "local":
            _, step, rank, local, lead = msg
            entry = steps.setdefault(step, {"locals": {}, "lead": None})
            entry["locals"][rank] = local
            entry["lead"] = lead if lead is not None else entry["lead"]
            if len(entry["locals"]) == world:
                ready.append((step, steps.pop(step)))
        elif kind == "error":
            # a peer's death surfaces on the survivors as connection errors: name the cause
            cause = _silent_death(procs, done, wait_s=2.0)
            if cause is not None and cause != rank:
                raise RunError(f"rank {cause} died (exit code {procs[cause].exitcode}); "
                               f"the other ranks were stopped (rank {rank} saw: {msg[2][:200]})")
            raise RunError(f"rank {rank} failed: {msg[2]}")
        else:
            done[rank] = pickle.loads(msg[2])
    flush(wait=True)  # every rank passed its last gate before it reported done
    return done[0]


def torchrun_device(scenario: Scenario, local_rank: int) -> torch.device:
    """This rank's device under torchrun: GPU ``LOCAL_RANK`` when CUDA is there (and not
    ``real.device = cpu``), else the CPU."""
    want = scenario.real.device
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and local_rank >= gpus:
        raise RunError(f"real.device = cuda: local rank {local_rank} has no GPU (this node has {gpus})")
    if want != "cpu" and local_rank < gpus:
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run_in_process(scenario: Scenario, env: dict[str, str], on_step, debug: dict | None = None,
                   run_dir: str | None = None, resume=None, progress: bool = False) -> dict | None:
    """Run this process's rank of a torchrun job; rank 0 returns its final payload
    (and calls ``on_step``), the other ranks None. ``progress``: say on stderr when this
    rank joins the job and when every rank is in."""
    rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if world != scenario.world_size:
        c = scenario.cluster
        raise ScenarioError("cluster.gpus_per_node", c.gpus_per_node,
                            f"torchrun started WORLD_SIZE = {world} ranks, but the scenario's cluster has "
                            f"{scenario.world_size} GPUs (cluster.gpus_per_node x cluster.nodes_per_microcluster"
                            f" x cluster.microclusters = {c.gpus_per_node} x {c.nodes_per_microcluster}"
                            f" x {c.microclusters})")
    device = torchrun_device(scenario, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    started = time.perf_counter()
    if progress:
        say(f"real: rank {rank} joining {world} ranks ({backend}, torchrun)...")
    dist.init_process_group(backend, init_method="env://", rank=rank,
                            world_size=world, timeout=timedelta(seconds=scenario.real.timeout_s), **eager_device(device))
    if progress:  # the default group's rendezvous waits for every rank
        say(f"real: {world} ranks up ({time.perf_counter() - started:.1f} s)")
    runner = RankRunner(scenario, rank, device)
    control = DistControl(rank, world, dist.group.WORLD, on_step)
    result = runner.run(control, debug, run_dir, resume)
    del runner
    _tear_down()
    return result if rank == 0 else None


def _tear_down() -> None:
    """End this rank's process groups while the interpreter still runs.

    Every rank leaves its last collective first (a barrier), then the groups are
    destroyed and the rank's objects that hold them collected, so gloo joins its worker
    threads now: left to interpreter shutdown, a worker thread that frees a finished
    collective needs the GIL after it is gone, and the process aborts ("terminate called
    without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
