"""A built-in machine profile against one measured on the machine it describes.

    python benchmarks/profile_check.py h200 /tmp/gpu-check/local-gpu.toml

prints one row per figure that shapes a GPU prediction: the built-in value, the measured
one and their ratio (measured / built-in). It judges nothing: the figures are to put in
the profile's sources, or to show where the built-in profile is off. Curves are read at
a few points of their x (tokens, rows, sequence length, page size). Needs numpy and the
standard library only (no simpy), so it runs on the GPU machine as it is.
"""

from __future__ import annotations

import argparse
import sys

from testbed.core.errors import ScenarioError, run_as_command
from testbed.scenario.profile import CALIBRATE_TOOL, MachineProfile, load_profile

MiB = 2**20

#: (label, unit, value of a profile) for every row of the table
ROWS = [
    ("bf16 ceiling", "TFLOP/s", lambda p: p.compute.peak_tflops.bf16),
    ("memory bandwidth", "GB/s", lambda p: p.compute.memory_GBps),
    ("kernel launch", "us", lambda p: p.compute.launch_us),
    ("device memory", "GB", lambda p: p.compute.device_memory_GB),
    *[(f"dense GEMM efficiency, {rows} rows", "of peak",
       (lambda r: lambda p: p.compute.efficiency_at("dense", r))(rows)) for rows in (2048, 8192)],
    *[(f"grouped expert GEMM efficiency, {t} tokens/expert", "of peak",
       (lambda t: lambda p: p.compute.efficiency_at("grouped", t))(t)) for t in (512, 4096)],
    *[(f"looped expert GEMM efficiency, {t} tokens/expert", "of peak",
       (lambda t: lambda p: p.compute.efficiency_at("loop", t))(t)) for t in (512, 4096)],
    *[(f"attention efficiency, sequence {s}", "of peak",
       (lambda s: lambda p: p.compute.efficiency_at("attention", s))(s)) for s in (1024, 4096)],
    *[(f"pinned copy, {m} MiB pages", "GB/s", (lambda m: lambda p: float(p.copy.GBps(m * MiB)))(m)) for m in (1, 16)],
    ("copy latency", "us", lambda p: p.copy.latency_us),
    ("copy hidden behind compute", "share", lambda p: p.copy.overlap),
    ("collective call latency", "us", lambda p: p.collectives.latency_us),
]


def table(built_in: MachineProfile, measured: MachineProfile) -> list[tuple[str, str, float, float, float]]:
    """(figure, unit, built-in, measured, measured / built-in) for every row of ``ROWS``."""
    out = []
    for label, unit, value in ROWS:
        a, b = float(value(built_in)), float(value(measured))
        out.append((label, unit, a, b, b / a if a else float("nan")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("built_in", help="the profile to check (a name, e.g. h200, or a path)")
    ap.add_argument("measured", help="the profile testbed calibrate --device cuda wrote")
    args = ap.parse_args(argv)

    def run() -> int:
        a, b = load_profile(args.built_in), load_profile(args.measured)
        if b.calibration.tool != CALIBRATE_TOOL:
            raise ScenarioError("measured", args.measured, "not made by testbed calibrate (no [calibration])")
        print(f"# {a.name} (built-in) against {b.name} (measured on {b.machine or 'this machine'}, {b.date})")
        print(f"# {'figure':50s} {'unit':>8s} {'built-in':>11s} {'measured':>11s} {'ratio':>7s}")
        for label, unit, x, y, r in table(a, b):
            print(f"  {label:50s} {unit:>8s} {x:11.4g} {y:11.4g} {r:7.3f}")
        return 0

    return run_as_command("profile_check", run, "stopped")


if __name__ == "__main__":
    sys.exit(main())
