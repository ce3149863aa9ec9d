"""Where a run's numbers come from, said in its summary: the machine profile and the routing.

A simulated step time means little without knowing whether the simulator used a generic
built-in profile or one calibrated on this machine, and whether it timed synthetic
routing or replayed a real run's; a real run routes with its router.
"""

from __future__ import annotations

import platform

from testbed.profile import MachineProfile, load_profile
from testbed.scenario import Scenario


def calibrated_here(profile: MachineProfile) -> bool:
    """The profile holds measurements (``testbed calibrate``) taken on this machine."""
    m = profile.measured
    measured = bool(m.collective_latency or m.compute_scale or m.stage_us)
    host = platform.node()
    return measured and (profile.versions.get("host") == host or (bool(host) and host in profile.description))


def describe_sources(scenario: Scenario, backend: str) -> dict:
    """Summary fields: ``profile``, ``profile_source`` (its first sentence),
    ``profile_calibrated_here`` and ``routing_source``. Loading the profile here also
    refuses a missing one before any run starts."""
    profile = load_profile(scenario.cluster.profile)
    if backend == "real":
        routing = "real router"
    elif scenario.workload.trace:
        routing = f"replayed trace of {scenario.workload.trace}"
    else:
        routing = "synthetic workload (M4)"
    return {"profile": profile.name, "profile_source": profile.source.split(". ")[0].strip()[:200],
            "profile_calibrated_here": calibrated_here(profile), "routing_source": routing}
