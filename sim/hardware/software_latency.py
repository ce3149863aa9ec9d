"""Software costs from a calibrated profile's measured tables, and the rule for where they apply.

A calibrated profile (``testbed calibrate``) measured its tables at a few world sizes
(``measured.collective_latency``, ``compute_scale``, ``stage_us``: one row per measured
world). A row applies only at the world it was measured at. At any other world the
simulator's own model runs, with its parameters fitted to the rows (``fit_at``): a
least-squares line in the world size through every measured world (the costs grow with
ranks per core, and the cores are the calibrated machine's), or, with one measured world
only, that world's constant. Either way the result is *fitted*, and says how
(``source``).

- ``SoftwareLatency``: the communication library's cost per call and per sequential
  algorithm step (seconds), which the collective model adds to the network's time of
  the bytes; the profile's ``collectives`` figures when nothing was measured;
- ``fitted_figure``: whether a figure of the profile itself is a fitted constant (its
  ``[sources]`` entry says "fitted": a built-in profile storing what a calibration fitted);
- ``stage_host_seconds``: the host's cost per stage call (``measured.stage_us``);
- ``compute_scale_fitted``: whether the compute contention factor (``compute_scale``,
  applied by ``sim.hardware.compute.contention_factor``) is fitted at the scenario's world.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from testbed.core.stages import stage_variant
from testbed.scenario.profile import MachineProfile
from testbed.scenario.scenario import Scenario


class Fit(NamedTuple):
    """A value for one world from a measured table: ``measured`` when the world was
    measured, else fitted; ``how`` says which, in words."""

    value: float
    measured: bool
    how: str


def fit_at(world: int, points: list[tuple[int, float]]) -> Fit:
    """The value at ``world`` from measured (world, value) ``points``: the measured value
    where ``world`` is among them; else the least-squares line through them at ``world``
    (points at two or more worlds), or the constant of the one measured world."""
    for w, v in points:
        if w == world:
            return Fit(float(v), True, f"measured at world {world}")
    worlds = sorted({w for w, _ in points})
    if len(worlds) == 1:
        return Fit(float(points[0][1]), False, f"fitted: the constant of world {worlds[0]}, the only one measured")
    x, y = np.array([p[0] for p in points], dtype=np.float64), np.array([p[1] for p in points], dtype=np.float64)
    slope, intercept = np.polyfit(x, y, 1)
    return Fit(float(intercept + slope * world), False,
               "fitted: a least-squares line in world over worlds " + ", ".join(map(str, worlds)))


def fitted_figure(profile: MachineProfile, key: str) -> bool:
    """The figure at dotted ``key`` is a fitted constant by the profile's ``[sources]``:
    its entry (``MachineProfile.source_of``) begins with "fitted"."""
    return profile.source_of(key).lstrip().lower().startswith("fitted")


class SoftwareLatency:
    """The communication library's software cost: per call (``call_s``) and per
    sequential algorithm step (``step_s``), seconds, at ``world`` ranks.

    From a calibrated profile's ``measured.collective_latency`` (module doc: the row of
    ``world`` where it was measured, else fitted to the rows; never below 0), which makes
    them *fitted* constants; else the profile's ``collectives`` figures, fitted where its
    ``[sources]`` say so (``fitted_figure``: a built-in profile that stores what a
    calibration fitted). ``source`` says which."""

    def __init__(self, profile: MachineProfile, world: int):
        rows = profile.measured.collective_latency
        if rows:
            call = fit_at(world, [(r["world"], r["call_us"]) for r in rows])
            step = fit_at(world, [(r["world"], r["step_us"]) for r in rows])
            self.call_s, self.step_s, self.fitted = max(call.value, 0.0) * 1e-6, max(step.value, 0.0) * 1e-6, True
            self.source, self.measured_here = call.how, call.measured
        else:
            c = profile.collectives
            self.call_s, self.step_s = c.latency_us * 1e-6, c.step_latency_us * 1e-6
            # one least-squares fit gives both (real.calibrate.latency_fit.fit_software_latency): either fitted, both are
            self.fitted = fitted_figure(profile, "collectives.latency_us") or \
                fitted_figure(profile, "collectives.step_latency_us")
            self.source = "the profile's collectives figures" + (", fitted (its [sources])" if self.fitted else "")
            self.measured_here = False


def stage_host_seconds(profile: MachineProfile, scenario: Scenario) -> dict[str, tuple[float, float]]:
    """Host cost per stage call: stage -> (seconds, seconds per byte of the stage's work),
    from ``measured.stage_us`` (module doc: each (stage, variant)'s row of the scenario's
    world where measured, else fitted to its rows, never below 0; for token stages and
    expert sync the entry of the scenario's strategy when there is one, else the generic
    one). Empty when nothing was measured."""
    rows = profile.measured.stage_us
    world = scenario.world_size
    comm = scenario.comm
    by_entry: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["variant"] in ("", stage_variant(r["stage"], comm.token_strategy, comm.expert_sync)):
            by_entry.setdefault((r["stage"], r["variant"]), []).append(r)
    out: dict[str, tuple[float, float]] = {}
    for (stage, variant), entry in sorted(by_entry.items()):  # "" first: a matching variant overrides it
        us = fit_at(world, [(r["world"], r["us"]) for r in entry]).value
        per_mb = fit_at(world, [(r["world"], r["us_per_MB"]) for r in entry]).value
        out[stage] = (max(us, 0.0) * 1e-6, max(per_mb, 0.0) * 1e-12)
    return out


def compute_scale_fitted(profile: MachineProfile, world: int, shared_cores: bool = False) -> bool:
    """The compute model's contention factor at ``world`` ranks is fitted
    (``sim.hardware.compute.contention_factor``): ``measured.compute_scale`` has rows but none of
    ``world``, so the factor is extrapolated from them (module doc). Never with
    ``shared_cores``: the flow model then shares the cores itself, at factor 1."""
    rows = profile.measured.compute_scale
    return bool(rows) and not shared_cores and all(r["world"] != world for r in rows)
