"""Starting the ranks of a real run on this machine, and noticing when one fails.

Ranks are separate processes (``spawn``) that meet through a file store in a private
temporary folder, so concurrent runs never race for a port. Rank 0 streams each step's
record to the parent through a queue. If a rank raises, or dies without a word (killed,
out of memory), the parent stops every other rank at once and raises ``RunError``
naming the rank: a run never hangs on a dead peer. Collectives also carry the scenario's
``real.timeout_s``.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from testbed.errors import RunError
from testbed.results import StepRecord
from testbed.scenario import Scenario

POLL_S = 0.2
REPORTED_EXIT = 3  # a rank that raised and sent its error exits with this code


def pick_device(scenario: Scenario) -> str:
    """"cuda" when asked for or when auto finds a GPU per rank, else "cpu"."""
    want = scenario.real.device
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and gpus < scenario.world_size:
        raise RunError(f"real.device = cuda needs {scenario.world_size} GPUs, this machine has {gpus}")
    if want == "cuda" or (want == "auto" and gpus >= scenario.world_size):
        return "cuda"
    return "cpu"


def _rank_main(rank: int, scenario_dict: dict, store_path: str, q, device_kind: str, debug: dict | None):
    """Body of one rank process."""
    try:
        from real.worker import (
            RankRunner,  # the spawned child imports the model code itself
        )

        scenario = Scenario.from_dict(scenario_dict)
        world = scenario.world_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        store = dist.FileStore(store_path, world)
        backend = "nccl" if device_kind == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=scenario.real.timeout_s))
        device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
        if device_kind == "cuda":
            torch.cuda.set_device(device)
        runner = RankRunner(scenario, rank, device)

        result = runner.run(lambda record: q.put(("step", rank, record.to_dict())), debug)
        # plain bytes: torch would pass tensors as shared-memory handles that die with this process
        q.put(("done", rank, pickle.dumps(result)))
        dist.destroy_process_group()
    except BaseException as e:  # report, then die: the parent stops the others
        q.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        q.close()
        q.join_thread()
        os._exit(REPORTED_EXIT)


def run_ranks(scenario: Scenario, on_step, debug: dict | None = None) -> dict:
    """Run every rank on this machine; returns rank 0's final payload.

    ``debug`` is for tests (see ``RankRunner.run``): make a rank die, capture tensors.
    """
    world = scenario.world_size
    device_kind = pick_device(scenario)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="testbed-") as tmp:
        store_path = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_rank_main, args=(r, scenario.to_dict(), store_path, q, device_kind, debug),
                             name=f"testbed-rank{r}") for r in range(world)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, q, on_step)
        finally:
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


def _collect(procs, q, on_step) -> dict:
    world = len(procs)
    done: dict[int, dict] = {}
    while len(done) < world:
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
        if kind == "step":
            on_step(StepRecord.from_dict(msg[2]))
        elif kind == "error":
            # a peer's death surfaces on the survivors as connection errors: name the cause
            cause = _silent_death(procs, done, wait_s=2.0)
            if cause is not None and cause != rank:
                raise RunError(f"rank {cause} died (exit code {procs[cause].exitcode}); "
                               f"the other ranks were stopped (rank {rank} saw: {msg[2][:200]})")
            raise RunError(f"rank {rank} failed: {msg[2]}")
        else:
            done[rank] = pickle.loads(msg[2])
    return done[0]
