"""The communication library's software cost per call and per algorithm step (seconds):
measured on a calibrated profile, else the profile's own figures."""

from __future__ import annotations

from testbed.profile import MachineProfile


class SoftwareLatency:
    """The communication library's software cost: per call and per sequential algorithm
    step, seconds. From a calibrated profile's ``measured.collective_latency`` (the entry of
    the measured world nearest to the scenario's: the cost grows with ranks per core), which
    makes them *fitted* constants, or else the profile's ``collectives`` figures."""

    def __init__(self, profile: MachineProfile, world: int):
        rows = profile.measured.collective_latency
        if rows:
            row = min(rows, key=lambda r: (abs(r["world"] - world), r["world"]))
            self.call_s, self.step_s, self.fitted = row["call_us"] * 1e-6, row["step_us"] * 1e-6, True
        else:
            c = profile.collectives
            self.call_s, self.step_s, self.fitted = c.latency_us * 1e-6, c.step_latency_us * 1e-6, False
