"""CPU cores shared by CPU ranks, in simulated time: processor sharing per core.

On a CPU backend several ranks run on one machine, each pinned to core ``rank % cores``
(as the real backend pins them) and running one thread. A core splits its time equally
among the ranks computing on it at that moment (the Linux scheduler's fair share), so a
rank's compute of ``s`` core-seconds takes ``s`` alone and ``n s`` while ``n`` ranks of
its core compute. Ranks waiting for the network use no core: this is why a step whose
ranks rarely compute at once runs its compute faster than the contention of every rank
computing at the same time (``measured.compute_scale``) says.

``CorePool.run(rank, seconds)`` returns an event that fires when the rank's work is
done. Between changes (a job starts or ends) every job on a core progresses at 1 / n
core-seconds per second; the next change is the earliest finish.
"""

from __future__ import annotations

from functools import partial

import simpy


class CorePool:
    """``cores`` cores shared by ranks; rank r computes on core ``r % cores``."""

    def __init__(self, env: simpy.Environment, cores: int):
        if cores < 1:
            raise ValueError(f"a core pool needs at least one core, got {cores}")
        self.env, self.cores = env, int(cores)
        self._jobs: list[dict[int, list]] = [{} for _ in range(self.cores)]  # core -> id -> [left s, event]
        self._last = [env.now] * self.cores
        self._gen = [0] * self.cores
        self._ids = 0

    def core_of(self, rank: int) -> int:
        return rank % self.cores

    def run(self, rank: int, seconds: float) -> simpy.Event:
        """Compute ``seconds`` core-seconds on ``rank``'s core; the event fires when done."""
        done = self.env.event()
        if seconds <= 0:
            return done.succeed()
        c = self.core_of(rank)
        self._advance(c)
        self._ids += 1
        self._jobs[c][self._ids] = [float(seconds), done]
        self._schedule(c)
        return done

    def _advance(self, c: int) -> None:
        """Every job on core ``c`` progresses to now at its share."""
        jobs = self._jobs[c]
        dt = self.env.now - self._last[c]
        self._last[c] = self.env.now
        if dt > 0 and jobs:
            share = dt / len(jobs)
            for job in jobs.values():
                job[0] -= share

    def _schedule(self, c: int) -> None:
        jobs = self._jobs[c]
        self._gen[c] += 1
        if jobs:
            first = min(job[0] for job in jobs.values())
            wait = max(first, 0.0) * len(jobs)
            self.env.timeout(wait).callbacks.append(partial(self._on_finish, c, self._gen[c]))

    def _on_finish(self, c: int, gen: int, _event) -> None:
        if gen != self._gen[c]:  # superseded: a job started or ended since
            return
        self._advance(c)
        jobs = self._jobs[c]
        first = min(job[0] for job in jobs.values())
        for key in [k for k, job in jobs.items() if job[0] <= first + 1e-12]:
            jobs.pop(key)[1].succeed()
        self._schedule(c)
