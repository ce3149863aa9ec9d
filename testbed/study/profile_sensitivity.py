"""The assumed constants of a machine profile and the profile with one of them moved, for
the sensitivity of a prediction to what nobody measured (issue 26, item 4: "the share of
the predicted time from each assumed constant: the prediction with that constant moved
±20%").

A constant is *assumed* where its ``[sources]`` entry (``MachineProfile.source_of``: its own
or its section's) says so: the entry starts with "assumed", or a measured entry names an
assumed part ("...; assumed: below 8192 rows the 8192 value", ``partly`` then). Only numbers
can be moved: booleans and names (NVLS off, an algorithm) are left out and listed as such,
and so is a constant of 0 (moving it by a factor leaves it 0). A curve (``compute.efficiency.*``)
moves its fractions, not its points.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from testbed.core.errors import ScenarioError
from testbed.scenario.profile import MachineProfile, profile_from_dict, save_profile
from testbed.scenario.scenario import Scenario

#: sections that say how a profile was made, not what the machine does
NOT_FIGURES = ("name", "description", "source", "machine", "date", "versions", "measured", "calibration", "sources")


@dataclass(frozen=True)
class AssumedConstant:
    """One assumed figure of a profile: its dotted key, its value (a number, or a curve's
    points) and its source entry; ``movable``: a number (or curve) a factor changes;
    ``partly``: only part of it is assumed (the source names a measured part)."""

    key: str
    value: object
    source: str
    movable: bool
    partly: bool


def _leaves(data: dict, prefix: str = ""):
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _leaves(v, f"{key}.")
        else:
            yield key, v


def _is_curve(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in value)


def _movable(value) -> bool:
    if _is_curve(value):
        return any(float(y) != 0 for _, y in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0


def assumed_constants(profile: MachineProfile) -> list[AssumedConstant]:
    """Every figure of ``profile`` whose source says it is assumed (module doc), in file order."""
    out = []
    for key, value in _leaves({k: v for k, v in profile.to_dict().items() if k not in NOT_FIGURES}):
        source = profile.source_of(key)
        text = source.lower()
        if "assumed" not in text:
            continue
        out.append(AssumedConstant(key, value, source, _movable(value), partly=not text.startswith("assumed")))
    return out


def unread_by(scenario: Scenario, key: str) -> str:
    """Why a run of ``scenario`` cannot read the profile figure ``key``, so moving it cannot move
    the run ('' where it may): the mechanism that reads it is off. Each rule is checked on a
    published scenario by tests/testbed/study/test_profile_sensitivity_unread.py."""
    s = scenario
    if key == "overheads.heat_update_us_per_expert" and not s.heat.enabled:
        return "heat.enabled is false (the heat map's update reads it)"
    if key in ("compute.block_half_width", "links.pcie.bandwidth_GBps") and not s.pager.enabled:
        return "pager.enabled is false (page moves and page-blocked GEMMs read it)"
    if key in ("collectives.deepep_dispatch_GBps", "collectives.deepep_combine_GBps") \
            and s.comm.token_strategy != "deepep":
        return f"comm.token_strategy is {s.comm.token_strategy!r} (DeepEP's internode forwards read it)"
    if key == "compute.peak_tflops.fp8" and s.model.gemm_dtype != "fp8":
        return f"model.gemm_dtype is {s.model.gemm_dtype!r} (fp8 GEMMs read it)"
    if key == "compute.peak_tflops.fp16" and s.model.dtype != "fp16":
        return f"model.dtype is {s.model.dtype!r} (fp16 GEMMs read it)"
    if key.startswith("links.spine.") and s.cluster.microclusters == 1 and not s.cluster.rail_optimized:
        return "one micro-cluster, one leaf: no path crosses the spine"
    return ""


def moved(profile: MachineProfile, key: str, factor: float) -> MachineProfile:
    """``profile`` with the figure ``key`` times ``factor`` (a curve: its fractions, capped
    at 1, the whole of a peak); its name gets the move appended. ScenarioError naming the
    key where the moved profile is not a valid one."""
    data = profile.to_dict()
    *path, leaf = key.split(".")
    section = data
    for part in path:
        section = section[part]
    value = section[leaf]
    if _is_curve(value):
        section[leaf] = [[x, min(1.0, float(y) * factor)] for x, y in value]
    elif _movable(value):
        new = float(value) * factor
        section[leaf] = round(new) if isinstance(value, int) else new
    else:
        raise ScenarioError("profile", key, f"{value!r} is not a number a factor moves")
    data["name"] = f"{profile.name}-{key}-x{factor:g}"
    return profile_from_dict(data, data["name"])


def moved_profile_file(profile: MachineProfile, key: str, factor: float, folder: str | Path) -> Path:
    """``moved(profile, key, factor)`` written to ``folder`` (one file a key and factor, so
    that reruns find the same path and a run store's index its runs)."""
    p = moved(profile, key, factor)
    return save_profile(p, Path(folder) / f"{p.name}.toml")
