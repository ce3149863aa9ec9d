"""Per-rank stage clock: which stage a rank is in, and for how long.

The forward switches stages explicitly; the backward switches them through
``StageMarker`` nodes placed in the autograd graph (their backward runs when the
gradient reaches that point). On CUDA each switch synchronises the device first, so the
time of queued kernels lands in the stage that launched them.
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

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def switch(self, stage: str | None) -> None:
        """Close the current stage's region and open ``stage`` (None: stop the clock)."""
        t = self.now()
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
        totals, regions = dict(self.totals), self.regions
        self.totals, self.regions = defaultdict(float), []
        return totals, regions


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
