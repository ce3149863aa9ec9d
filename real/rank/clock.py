"""Per-rank stage clock: which stage a rank is in, and for how long.

The forward switches stages explicitly; the backward switches them through
``StageMarker`` nodes placed in the autograd graph (their backward runs when the
gradient reaches that point).

On CPU every op has finished when it returns, so a switch reads ``perf_counter``. On
CUDA a switch records an event on the current stream instead of synchronising: a stage
lasts from its opening event to the next one on the device's own timeline, so queued
kernels land in the stage that launched them without stalling the host. ``take`` waits
for the device once and turns the events into seconds, anchored to the host time of the
step's first event (``now``, which synchronises).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class StageClock:
    """Accumulates seconds per stage and keeps (stage, start_s, end_s) regions for traces."""

    def __init__(self, origin_s: float, cuda: bool = False):
        self.origin = origin_s
        self.cuda = cuda
        self.current: str | None = None
        self.started = 0.0
        self.totals: dict[str, float] = defaultdict(float)
        self.regions: list[tuple[str, float, float]] = []
        self._anchor: tuple[torch.cuda.Event, float] | None = None  # CUDA: (event, host seconds)
        self._open: torch.cuda.Event | None = None
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def now(self) -> float:
        """Host seconds with the device idle (CUDA: synchronises, and anchors the events)."""
        if not self.cuda:
            return time.perf_counter()
        torch.cuda.synchronize()
        t = time.perf_counter()
        if not self._pending:  # anchor before the regions it will place (a step's start)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._anchor = (ev, t)
        return t

    def switch(self, stage: str | None) -> None:
        """Close the current stage's region and open ``stage`` (None: stop the clock)."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            if self.current is not None and self._open is not None:
                self._pending.append((self.current, self._open, ev))
            self.current, self._open = stage, ev
            return
        t = time.perf_counter()
        if self.current is not None and t > self.started:
            self.totals[self.current] += t - self.started
            self.regions.append((self.current, self.started - self.origin, t - self.origin))
        self.current, self.started = stage, t

    @contextmanager
    def region(self, stage: str):
        previous = self.current
        self.switch(stage)
        try:
            yield
        finally:
            self.switch(previous)

    def take(self) -> tuple[dict[str, float], list[tuple[str, float, float]]]:
        """Totals and regions since the last ``take``; the clock keeps running."""
        self.switch(self.current)
        if self.cuda:
            self._resolve()
        totals, regions = dict(self.totals), self.regions
        self.totals, self.regions = defaultdict(float), []
        return totals, regions

    def _resolve(self) -> None:
        torch.cuda.synchronize()
        anchor, t0 = self._anchor if self._anchor is not None else (None, self.origin)
        for stage, start, end in self._pending:
            seconds = start.elapsed_time(end) * 1e-3
            if seconds <= 0:
                continue
            self.totals[stage] += seconds
            at = t0 + (anchor.elapsed_time(start) * 1e-3 if anchor is not None else 0.0)
            self.regions.append((stage, at - self.origin, at + seconds - self.origin))
        self._pending = []


class StageMarker(torch.autograd.Function):
    """Identity whose backward switches the clock to ``stage`` (marks backward stages)
    and then runs ``hook`` (work that must happen at that point of the backward)."""

    @staticmethod
    def forward(ctx, x, clock: StageClock, stage: str, hook):
        ctx.clock, ctx.stage, ctx.hook = clock, stage, hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.hook is not None:
            ctx.hook()
        ctx.clock.switch(ctx.stage)
        return grad, None, None, None


def mark(x: torch.Tensor, clock: StageClock, stage: str, hook=None) -> torch.Tensor:
    """``x`` unchanged; when its gradient arrives in the backward, ``hook()`` runs and
    the clock enters ``stage``."""
    return StageMarker.apply(x, clock, stage, hook) if x.requires_grad else x
