"""Hierarchical checkpoints of one rank (M23), written in the background, and resuming.

A checkpoint *at n* holds the state after n completed steps; a run resumed from it
starts with step n. Each rank writes its own files into ``<directory>/rank<r>/``, three
kinds at their own intervals (``checkpoint.*_interval``, in completed steps):

- ``rng-n``: the random state the rank carries across steps. The router noise and the
  data are drawn from generators seeded per step and the heat map's generator travels
  with the controller, so this is the step and torch's global generators.
- ``optimizer-n-from-p``: what the optimizer step changes besides expert weights (the
  router parameters, the shared experts, the whole transformer's dense weights and its
  Adam state; plain SGD keeps no moments), the controller's whole state (page table, heat map, group cache,
  replica freshness, the routing bias of bias balancing - ``Controller.balance``, which
  the rank's router reads at each step's start; pickled) and, incrementally, the expert
  pages modified since the previous optimizer checkpoint p (their values at n).
  The rank adds its own routed counts of steps p .. n-1 (its rows of the run folder's
  routing trace).
- ``experts-n``: every expert page (a full snapshot).

n = 0 is implicit: the seeded initial state. The state at n is *complete* when rng-n
exists and the chain of optimizer checkpoints from n back to 0 does: their page sets,
applied in order on top of the newest full snapshot e <= n (or the initial weights),
give every page's value at n. A run resumes from the largest n complete on every rank.

Writes go to a background thread through a queue, so the step loop only pays for the
copies of what is written; a file appears atomically (written aside, then renamed), so
a rank killed mid-write leaves the whole file or none. Files of steps after the resume
point (an abandoned future) are deleted when a run resumes.
"""

from __future__ import annotations

import os
import pickle
import queue
import re
import threading
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from testbed.core.errors import RunError
from testbed.scenario.scenario import Scenario

_NAME = re.compile(r"^(rng|experts|optimizer)-(\d{8})(?:-from-(\d{8}))?\.pt$")


def checkpoint_dir(scenario: Scenario, run_dir: str | os.PathLike | None) -> Path | None:
    """``checkpoint.directory``, else ``<run folder>/checkpoints``; None without either."""
    if scenario.checkpoint.directory:
        return Path(scenario.checkpoint.directory)
    return Path(run_dir) / "checkpoints" if run_dir is not None else None


def resumable_steps(scenario: Scenario, directory: Path) -> set[int]:
    """Steps every rank's checkpoint files let a run resume from, read from the files alone
    (0, the start, always): what ``--resume`` can continue from, checked before any rank
    starts."""
    common: set[int] | None = None
    for rank in range(scenario.world_size):
        steps = CheckpointFiles(Path(directory) / f"rank{rank}").complete_steps()
        common = steps if common is None else common & steps
    return common or {0}


class CheckpointFiles:
    """One rank's checkpoint files: which steps they let it resume from."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    def files(self) -> dict[str, dict[int, Path]]:
        files: dict[str, dict[int, Path]] = {"rng": {}, "experts": {}, "optimizer": {}}
        self.prev_of: dict[int, int] = {}
        for path in self.dir.iterdir() if self.dir.is_dir() else []:
            m = _NAME.match(path.name)
            if m:
                kind, step = m.group(1), int(m.group(2))
                files[kind][step] = path
                if kind == "optimizer":
                    self.prev_of[step] = int(m.group(3))
        return files

    def chain(self, files, n: int) -> list[int] | None:
        """Optimizer checkpoints from 0 up to n (ascending), None when a link is missing."""
        out = []
        while n > 0:
            if n not in files["optimizer"] or self.prev_of[n] >= n:
                return None
            out.append(n)
            n = self.prev_of[n]
        return out[::-1]

    def complete_steps(self) -> set[int]:
        """Steps whose state this rank can restore (0 always)."""
        files = self.files()
        return {0} | {n for n in files["rng"] if n > 0 and self.chain(files, n) is not None}


class AsyncWriter:
    """Saves payloads to files on one background thread, in submission order."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, path: Path, payload: dict) -> None:
        self._raise()
        self._queue.put((path, payload))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                path, payload = item
                tmp = path.with_name(path.name + ".tmp")
                torch.save(payload, tmp)
                os.replace(tmp, path)
            except BaseException as e:  # reported on the step loop's next call
                self._error = e
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            raise RunError(f"writing a checkpoint failed: {type(self._error).__name__}: {self._error}")

    def close(self) -> None:
        """Wait for every queued write (flush on exit), then stop the thread."""
        self._queue.put(None)
        self._queue.join()
        self._thread.join()
        self._raise()


class Checkpointer:
    """The checkpoints of one rank: what is due after a step, and resuming from them."""

    def __init__(self, scenario: Scenario, rank: int, directory: Path):
        self.cfg = scenario.checkpoint
        self.rank = rank
        self.dir = Path(directory) / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.on_disk = CheckpointFiles(self.dir)
        self.prev = 0  # the last optimizer checkpoint (0: the initial state)
        self.routing_since: list[np.ndarray] = []  # the rank's routing of the steps since ``prev``
        self.writer = AsyncWriter()

    # ---- writing ---------------------------------------------------------------------------------
    def after_step(self, done: int, state, routing: np.ndarray | None) -> list[str]:
        """Checkpoint what is due after ``done`` completed steps; returns the kinds written.
        ``routing`` is this rank's routed counts of the step [L, E]."""
        if routing is not None:
            self.routing_since.append(routing)
        cfg = self.cfg
        optimizer = done % cfg.optimizer_interval == 0
        experts = done % cfg.expert_interval == 0
        rng = done % cfg.rng_interval == 0 or optimizer  # a resume point needs its RNG state
        written = []
        if experts:  # before the optimizer file: one that exists implies this one does
            self.writer.submit(self._path("experts", done), {"step": done, "pages": state.weight_pages(False)})
            written.append("experts")
        if optimizer:
            payload = {
                "step": done, "prev": self.prev,
                "router": [(w.detach().to("cpu", copy=True), b.detach().to("cpu", copy=True)) for w, b in state.router],
                "dense": ([p.detach().to("cpu", copy=True) for p in state.dense.params()]
                          if state.dense is not None else None),
                "adam": state.adam.state_dict() if state.adam is not None else None,
                "shared": [p.detach().to("cpu", copy=True) for p in state.shared_params()],
                "controller": pickle.dumps(state.controller),
                "pages": state.weight_pages(True),
                "routing": list(self.routing_since),
            }
            self.writer.submit(self._path("optimizer", done, self.prev), payload)
            state.clear_modified()
            self.prev, self.routing_since = done, []
            written.append("optimizer")
        if rng:
            payload = {"step": done, "torch": torch.get_rng_state()}
            if state.device.type == "cuda":
                payload["cuda"] = torch.cuda.get_rng_state(state.device)
            self.writer.submit(self._path("rng", done), payload)
            written.append("rng")
        return written

    def close(self) -> None:
        self.writer.close()

    def _path(self, kind: str, step: int, prev: int | None = None) -> Path:
        name = f"{kind}-{step:08d}" + (f"-from-{prev:08d}" if prev is not None else "") + ".pt"
        return self.dir / name

    # ---- finding a resume point -------------------------------------------------------------------
    def complete_steps(self) -> set[int]:
        """Steps whose state this rank can restore (0 always)."""
        return self.on_disk.complete_steps()

    def resume_point(self, requested: int | None) -> int:
        """The step every rank can resume from: ``requested``, or the latest (collective)."""
        mine = self.complete_steps()
        world = dist.get_world_size()
        every = [None] * world
        dist.all_gather_object(every, sorted(mine))
        common = set.intersection(*(set(s) for s in every))
        if requested is None:
            return max(common)
        if requested not in common:
            raise RunError(f"no complete checkpoint at step {requested} on every rank "
                           f"(complete everywhere: {sorted(common)})")
        return requested

    # ---- restoring -------------------------------------------------------------------------------
    def restore(self, n: int, state) -> list[np.ndarray]:
        """Put ``state`` back to step ``n``; returns the rank's routing of steps 0 .. n-1
        ([L, E] each). Files of later steps are deleted."""
        files = self.on_disk.files()
        self._forget_after(n, files)
        self.prev, self.routing_since = n, []
        if n == 0:
            return []
        chain = self.on_disk.chain(files, n)
        base = max((e for e in files["experts"] if e <= n), default=0)
        pages: dict[int, torch.Tensor] = {}
        if base > 0:
            pages.update(_load(files["experts"][base])["pages"])
        routing: list[np.ndarray] = []
        last = None
        for m in chain:
            last = _load(files["optimizer"][m])
            if m > base:
                pages.update(last["pages"])
            routing += last["routing"]
        state.restore(pickle.loads(last["controller"]), last["router"], pages, last.get("dense"), last.get("adam"),
                      last.get("shared"))
        rng = _load(files["rng"][n])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and state.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], state.device)
        return routing

    def _forget_after(self, n: int, files) -> None:
        for kind in files.values():
            for step, path in kind.items():
                if step > n:
                    path.unlink(missing_ok=True)
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)


def _load(path: Path) -> dict:
    # our own files: they hold numpy arrays and a pickled controller, not only tensors
    return torch.load(path, map_location="cpu", weights_only=False)
