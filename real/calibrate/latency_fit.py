"""Fits shared by every calibration (CPU ranks and GPUs): the library's software latency
from tiny collectives, and how many repetitions a measurement takes."""

from __future__ import annotations

import numpy as np

from testbed.policy.collectives import algorithm_steps
from testbed.scenario.links import path_latency_s
from testbed.scenario.profile import MachineProfile

#: repetitions of each measurement: with --quick, and without
QUICK_REPS, REPS = 3, 7


def fit_software_latency(rows: list[dict], world: int, cluster, profile: MachineProfile) -> dict:
    """Least squares ``seconds = call + steps x (step + hop latency)`` over every kind and
    group size, steps by ``testbed.policy.collectives.algorithm_steps`` (the links' hop latency
    is the profile's, so it is not fitted twice); call, step >= 0. Returns a
    ``measured.collective_latency`` row."""
    steps, y = [], []
    for r in rows:
        m = r["members"]
        n = algorithm_steps(r["kind"], r["group_size"], profile.collectives.algorithm.reduce_scatter == "all_reduce")
        if r["kind"] in ("all_to_all_v", "p2p"):  # every message in flight at once: one path latency
            links = max(path_latency_s(cluster, profile, a, b) for a in m for b in m)
        else:  # a ring: each step waits for its slowest hop
            links = n * max(path_latency_s(cluster, profile, a, b) for a, b in zip(m, m[1:] + m[:1]))
        steps.append(n)
        y.append(r["seconds"] - links)
    X = np.column_stack([np.ones(len(steps)), steps])
    (call, step), *_ = np.linalg.lstsq(X, np.array(y), rcond=None)
    if step < 0:
        call, step = float(np.mean(y)), 0.0
    if call < 0:
        call, step = 0.0, float(np.dot(steps, y) / np.dot(steps, steps))
    return {"world": world, "call_us": float(max(call, 0.0) * 1e6), "step_us": float(max(step, 0.0) * 1e6)}
