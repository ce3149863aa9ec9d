"""The control plane of a real run: starting each step together and reporting its metrics.

The testbed's own bookkeeping must not disturb what it measures. Two ways:

- ``LocalControl`` (ranks spawned on this machine): ranks start every step at a
  process barrier (``gate``) that the launching process takes part in, and send their
  step metrics to it through a queue (``publish``); the launcher merges them into one
  ``StepRecord``. Nothing of this crosses the ranks' network, so on an emulated cluster
  the kernel's byte counters see only training traffic, and the launcher can read them
  while every rank waits at the gate.
- ``DistControl`` (under torchrun, ranks on several machines): the gate is a
  ``torch.distributed`` barrier and rank 0 gathers the metrics over the process group.

``merge_step`` turns every rank's local metrics into one record, the same way for both.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from testbed.core.stages import STAGES
from testbed.run.results import StepRecord, frozen_fraction, sum_counts


def lead_fields(cache, states) -> dict:
    """Step facts every rank knows alike (the shared controller decided them from the
    step's discovery and heat); rank 0 sends them. Routed and dropped slots are each
    rank's own (``local``), summed by ``merge_step``."""
    return {"cache_hits": cache.hits if cache else 0, "cache_lookups": cache.lookups if cache else 0,
            "states": states}


def merge_step(step: int, gathered: list[dict], lead: dict, wire_bytes_by_level: dict | None = None) -> StepRecord:
    """One StepRecord from every rank's local metrics (see testbed.run.results for meanings)."""
    n = len(gathered)
    by_stage: dict[str, int] = {}
    by_level: dict[str, int] = {}
    for g in gathered:
        for k, v in g["by_stage"].items():
            by_stage[k] = by_stage.get(k, 0) + int(v)
        for k, v in g["by_level"].items():
            by_level[k] = by_level.get(k, 0) + int(v)
    fullest = max(range(n), key=lambda r: gathered[r]["peak"])
    return StepRecord(
        extra=dict({"memory_breakdown_bytes": gathered[fullest]["memory"]},
                   **({"pipeline_sent_bytes": sum(g["pipeline_sent_bytes"] for g in gathered)}
                      if any(g.get("pipeline_sent_bytes") for g in gathered) else {}),
                   # MTP (real.rank.mtp): the mean over ranks of their modules' mean cross entropy
                   **({"mtp_loss": sum(mtp) / len(mtp)}
                      if (mtp := [g["mtp_loss"] for g in gathered if g.get("mtp_loss") is not None]) else {})),
        step=step,
        step_time_s=max(g["step_time_s"] for g in gathered),
        stage_time_s={s: sum(g["stage_time_s"].get(s, 0.0) for g in gathered) / n for s in STAGES},
        bytes_by_stage=by_stage,
        bytes_by_level=by_level,
        peak_memory_bytes=max(g["peak"] for g in gathered),
        routed_slots=sum(g["routed"] for g in gathered),
        dropped_slots=sum(g["dropped"] for g in gathered),
        page_moves=sum(g["page_moves"] for g in gathered),
        page_bytes=sum(g["page_bytes"] for g in gathered),
        page_stall_s=sum(g["stall_s"] for g in gathered) / n,
        cache_hits=lead["cache_hits"],
        cache_lookups=lead["cache_lookups"],
        # pipeline stages: the last stage's ranks compute the loss
        loss=(sum(losses) / len(losses)) if (losses := [g["loss"] for g in gathered if g["loss"] is not None]) else None,
        aux_loss=sum(g["aux"] for g in gathered) / n,
        expert_states=lead["states"],
        moves_by_reason=sum_counts([g["moves_by_reason"] for g in gathered]) or {},
        frozen_fraction=(None if gathered[0]["frozen"] is None else
                         frozen_fraction({i: g["frozen"] for i, g in enumerate(gathered)},
                                         sum(g["local_experts"] for g in gathered))),
        wire_bytes_by_level=wire_bytes_by_level,
        discovery_s=max((g["discovery_s"] for g in gathered if g.get("discovery_s") is not None), default=None),
    )


class DistControl:
    """Gate and metrics over the process group (torchrun); rank 0 hands records to ``report``."""

    def __init__(self, rank: int, world: int, world_group, report):
        self.rank, self.world, self.group = rank, world, world_group
        self.report = report

    def gate(self, step: int) -> None:
        dist.barrier(group=self.group)

    def finish(self) -> None:
        """Nothing to do: the last step's metrics went with its publish."""

    def publish(self, step: int, local: dict, lead: dict) -> None:
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if self.rank == 0:
            self.report(merge_step(step, gathered, lead))


class LocalControl:
    """Gate and metrics through the launching process (spawned ranks).

    ``gate`` is two waits on a ``multiprocessing`` barrier of world + 1 parties: between
    them every rank is stopped and the launcher (``GateKeeper``) may read counters.
    ``publish`` puts ``("local", step, rank, local, lead)`` on the launcher's queue.
    """

    def __init__(self, rank: int, barrier, queue, timeout_s: float):
        self.rank, self.barrier, self.queue, self.timeout = rank, barrier, queue, timeout_s

    def gate(self, step: int) -> None:
        self.barrier.wait(self.timeout)  # every rank has finished its previous step
        self.barrier.wait(self.timeout)  # the launcher has read what it reads between steps

    def finish(self) -> None:
        """A last gate after the last step, so the launcher sees where that step ended."""
        self.gate(-1)

    def publish(self, step: int, local: dict, lead: dict) -> None:
        self.queue.put(("local", step, self.rank, local, lead if self.rank == 0 else None))


class GateKeeper:
    """The launcher's side of ``LocalControl.gate``: a thread that passes every gate with
    the ranks and, while they wait, calls ``at_gate()`` (e.g. reads link counters).
    ``results`` holds what each call returned, gate by gate; ``passed`` is set each time."""

    def __init__(self, barrier, at_gate=None):
        self.barrier = barrier
        self.at_gate = at_gate
        self.results: list = []
        self.changed = threading.Condition()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="testbed-gate", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while True:
                self.barrier.wait()
                got = self.at_gate() if self.at_gate is not None else None
                with self.changed:
                    self.results.append(got)
                    self.changed.notify_all()
                self.barrier.wait()
        except threading.BrokenBarrierError:
            return
        except BaseException as e:  # noqa: BLE001 - reported to whoever waits for a result
            self.error = e
            self.barrier.abort()
            with self.changed:
                self.changed.notify_all()

    def result(self, k: int, timeout_s: float):
        """What the k-th gate's call returned, waiting for it up to ``timeout_s``."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.results) > k or self.error is not None, timeout_s)
            if self.error is not None:
                raise self.error
            if len(self.results) <= k:
                raise TimeoutError(f"gate {k} not passed within {timeout_s:.0f} s")
            return self.results[k]

    def stop(self) -> None:
        """Release the thread (and any rank still waiting: they see a broken barrier)."""
        self.barrier.abort()
        self.thread.join(timeout=5)
