"""The simulator's expert kernels against Transformer Engine's published grouped-GEMM figures.

    python benchmarks/te_grouped_gemm.py [--profile h100]

For each figure of NVIDIA/TransformerEngine#2045 (bf16 on an H100; docs/published.md section 9)
it prints the profile's time of the same call as one grouped launch (``sim.expert_kernel =
grouped``) and as Transformer Engine's multi-stream cuBLAS loop (``multistream``), in TFLOP/s,
and each model's error. The two TE v2.2 figures calibrate ``compute.gemm.multistream_call_us``
(so multistream's errors on them show the fit, not a check); the TE v2.7 and CUTLASS figures
are only compared against.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from sim.hardware.compute import ComputeModel
from testbed.core.errors import ScenarioError, run_as_command
from testbed.scenario.profile import load_profile
from testbed.study.published_runs import TE_GROUPED_GEMM_FIGURES, TE_GROUPED_GEMM_SOURCE


def modelled_tflops(compute: ComputeModel, groups: int, m: int, n: int, k: int) -> dict[str, float]:
    """TFLOP/s of one call of ``groups`` GEMMs of (m, n, k) under each expert kernel."""
    rows = np.full((1, groups), float(m))
    flops = 2.0 * groups * m * n * k
    return {"grouped": flops / float(compute.grouped_call_seconds(rows, n, k, [m])[0]) / 1e12,
            "multistream": flops / float(compute.multistream_call_seconds(rows, n, k, [m])[0]) / 1e12}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100", help="a GPU profile with a GEMM shape model (default h100)")
    args = ap.parse_args(argv)
    return run_as_command("te_grouped_gemm", lambda: report(args.profile), "stopped")


def report(profile: str) -> int:
    compute = ComputeModel(load_profile(profile), "bf16")
    if not compute.shapes.enabled:
        raise ScenarioError("--profile", profile, "has no GEMM shape model (compute.gemm), which both kernels need")
    print(f"profile {profile}; published: {TE_GROUPED_GEMM_SOURCE}")
    print(f"{'row':10} {'implementation':15} {'groups x (m, n, k)':24} {'published':>9} "
          f"{'grouped':>15} {'multistream':>15}")
    for f in TE_GROUPED_GEMM_FIGURES:
        got = modelled_tflops(compute, f.groups, f.m, f.n, f.k)
        cells = "".join(f" {got[k]:7.1f} ({got[k] / f.tflops - 1:+6.1%})" for k in ("grouped", "multistream"))
        shape = f"{f.groups} x ({f.m}, {f.n}, {f.k})"
        print(f"{f.id:10} {f.implementation:15} {shape:24} {f.tflops:9.1f}{cells}")
    print("TFLOP/s (error against the published figure); te-2.2 calibrates multistream's fixed time a call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
