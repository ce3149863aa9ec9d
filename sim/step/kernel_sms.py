"""Compute beside communication kernels runs on the SMs they leave.

A communication kernel that moves data with SMs holds them while it runs, and compute
kernels do not share them (NCCL: one CTA a channel, each on an SM of its own, nccl#689;
DeepEP's kernels, ``comm.deepep_sms``; Transformer Engine's userbuffer reduce-scatters).
Compute of t seconds at every SM that starts with such kernels running for c seconds on
a share f of the SMs runs at 1 - f of its speed while they run (``sm_slowed``).
"""

from __future__ import annotations

import numpy as np

from testbed.core.errors import ScenarioError
from testbed.scenario.scenario import Scenario


def exchange_sm_share(scenario: Scenario, sm_count: int, nccl_sms: int = 0) -> float:
    """The share f of a GPU's SMs the token exchange's kernels hold while they run:
    ``comm.deepep_sms / sm_count`` under deepep, ``nccl_sms / sm_count`` (the profile's
    ``collectives.kernel_sms``) for NCCL's all-to-all and all-gather; 0 without SMs
    (``sm_count`` 0, CPU ranks). ScenarioError when they would hold every SM."""
    c = scenario.comm
    field, sms = ("comm.deepep_sms", c.deepep_sms) if c.token_strategy == "deepep" else \
        ("collectives.kernel_sms", nccl_sms)
    if sm_count <= 0 or sms <= 0:
        return 0.0
    if sms >= sm_count:
        raise ScenarioError(field, sms, f"leaves no SM for compute: the profile's compute.sm_count is {sm_count}")
    return sms / sm_count


def sm_slowed(seconds: np.ndarray, beside_s: np.ndarray, share: float) -> np.ndarray:
    """[W] seconds of compute of ``seconds`` (at every SM) that starts with exchange kernels
    running ``beside_s`` seconds and holding ``share`` f of the SMs: it runs at 1 - f
    while they run, so it takes ``seconds / (1 - f)`` when it ends first, else
    ``seconds + f beside_s``: ``seconds + min(seconds f / (1 - f), f beside_s)``."""
    return seconds + np.minimum(seconds * share / (1.0 - share), share * np.asarray(beside_s, dtype=np.float64))
