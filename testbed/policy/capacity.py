"""Expert capacity and token dropping (M2), shared by the router and by count replay."""

from __future__ import annotations

import math

import numpy as np


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float,
                    ep_size: int = 1, pad_to_ep: bool = False) -> int | None:
    """Token slots one expert accepts from one rank's ``tokens`` tokens per step.

    ``ceil(tokens * top_k / num_experts * capacity_factor)``, at least 1, optionally
    rounded up to a multiple of ``ep_size``. ``capacity_factor == 0`` means dropless
    and returns None.
    """
    if capacity_factor == 0:
        return None
    cap = max(1, math.ceil(tokens * top_k / num_experts * capacity_factor))
    if pad_to_ep and ep_size > 1:
        cap = math.ceil(cap / ep_size) * ep_size
    return cap


def kept_counts(routed: np.ndarray, capacity: int | None) -> np.ndarray:
    """Token slots kept per (rank, expert) when each rank caps every expert at ``capacity``."""
    routed = np.asarray(routed)
    if capacity is None:
        return routed.copy()
    if np.issubdtype(routed.dtype, np.integer):  # a capacity past the dtype keeps every slot anyway
        capacity = min(int(capacity), int(np.iinfo(routed.dtype).max))
    return np.minimum(routed, capacity)
