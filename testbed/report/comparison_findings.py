"""What a comparison of runs shows, in a few sentences computed from the runs themselves.

A report page opens with these (``testbed.report.comparison``): which run is fastest and by how
much, and, where a simulated run and a measured run of the same scenario stand side by
side, how far apart they are and which of the known reasons apply to them: a machine
profile not calibrated on this machine, a simulator routing a synthetic workload while
the real run routed with its router, CPU ranks sharing fewer cores than there are
ranks. Each reason is stated only when the runs' summaries show it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

#: scenario sections and fields that may differ between a simulated run and the measured
#: run it is set beside: where results go, the machine profile, a replayed trace, notes
_PAIR_IGNORE = ("run", "notes")
_PAIR_IGNORE_FIELDS = {("cluster", "profile"), ("workload", "trace")}


class RunLike(Protocol):
    label: str
    scenario: dict
    summary: dict

    @property
    def backend(self) -> str: ...


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _same_scenario(a: dict, b: dict) -> bool:
    """The two scenario mappings describe the same training step, up to where results
    go, the machine profile and a replayed routing trace."""
    def key(d: dict) -> dict:
        out = {}
        for section, fields in d.items():
            if section in _PAIR_IGNORE:
                continue
            if isinstance(fields, dict):
                out[section] = {k: v for k, v in fields.items() if (section, k) not in _PAIR_IGNORE_FIELDS}
            else:
                out[section] = fields
        return out
    return key(a) == key(b)


def pairs(runs: Sequence[RunLike]) -> list[tuple[RunLike, RunLike]]:
    """(simulated run, measured run) of the same scenario, each real run with the last
    simulated run before it in ``runs`` that matches it."""
    out = []
    for real in (r for r in runs if r.backend == "real"):
        sims = [r for r in runs if r.backend == "sim" and _same_scenario(r.scenario, real.scenario)]
        if sims:
            out.append((sims[-1], real))
    return out


def why_backends_differ(sim: dict, real: dict) -> list[str]:
    """The reasons, among the known ones, that a simulated summary ``sim`` and a measured
    summary ``real`` of one scenario show: each a sentence that names its evidence."""
    reasons = []
    if not sim.get("profile_calibrated_here"):
        reasons.append(f"the simulator timed it with the {sim.get('profile', '?')} profile, which was not calibrated "
                       f"on this machine (testbed calibrate measures it)")
    routing = str(sim.get("routing_source") or "")
    if not routing.startswith("replayed trace"):
        reasons.append(f"the simulator routed a {routing or 'synthetic workload'} while the real run routed its "
                       f"tokens with its router ({100 * sim.get('dropped_token_fraction', 0):.1f}% against "
                       f"{100 * real.get('dropped_token_fraction', 0):.1f}% dropped slots); workload.trace = the real "
                       f"run's folder replays its routing")
    ranks, cores = real.get("ranks"), real.get("host_cpu_count")
    if real.get("device") == "cpu" and ranks and cores and ranks > cores:
        reasons.append(f"the real run's {ranks} CPU ranks shared {cores} cores")
    return reasons


def comparison_findings(runs: Sequence[RunLike]) -> list[str]:
    """One to three sentences on what the comparison of ``runs`` shows."""
    timed = [r for r in runs if r.summary.get("step_time_s")]
    if not timed:
        return ["No run has a step time."]
    out = []
    if len(timed) == 1:
        r = timed[0]
        stages = {k: v for k, v in r.summary.get("stage_time_s", {}).items() if v > 0}
        top = max(stages, key=stages.get) if stages else None
        out.append(f"One run: {r.label}, a {_ms(r.summary['step_time_s'])} step"
                   + (f", most of it in {top} ({100 * stages[top] / sum(stages.values()):.0f}% of the stage times)."
                      if top else "."))
    else:
        fast = min(timed, key=lambda r: r.summary["step_time_s"])
        slow = max(timed, key=lambda r: r.summary["step_time_s"])
        out.append(f"Of {len(timed)} runs, {fast.label} has the shortest step ({_ms(fast.summary['step_time_s'])}) "
                   f"and {slow.label} the longest ({_ms(slow.summary['step_time_s'])}, "
                   f"{slow.summary['step_time_s'] / fast.summary['step_time_s']:.2f}x).")
    for sim, real in pairs(timed):
        ratio = sim.summary["step_time_s"] / real.summary["step_time_s"]
        reasons = why_backends_differ(sim.summary, real.summary)
        out.append(f"The simulated step of {sim.label} is {ratio:.2f}x the measured one of {real.label}"
                   + (": " + "; ".join(reasons) + "." if reasons else
                      "; both used a calibrated profile and the same routing, so the difference is the simulator's "
                      "error on this machine."))
        if real.summary.get("peak_memory_note"):  # the two peaks do not count the same things
            out.append(f"Peak memory: {_mib(sim.summary.get('peak_memory_bytes', 0))} simulated against "
                       f"{_mib(real.summary.get('peak_memory_bytes', 0))} measured; "
                       f"{real.summary['peak_memory_note']}.")
    return out


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"
