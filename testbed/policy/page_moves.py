"""Page moves: what the pager tells a backend to do, one row per page (M12-M16).

Location codes say where a page's copy lives; ``PEER`` is the source of pages that
arrive over the fabric from another GPU (a stale replica's refresh, M9/M16). Reasons say
why a row exists. A backend executes the rows in order; the simulator puts their bytes
on links, the real backend copies tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

# Locations (where a page's copy lives) and the extra source code of fabric moves (M16).
GPU, HOST, NONE = 0, 1, 2
PEER = 3
LOCATION_NAMES = ("gpu", "host", "none", "peer")

REASONS = ("demand", "prefetch", "wake", "refresh", "cold", "emergency", "update", "stale", "defrag")
DEMAND, PREFETCH, WAKE, REFRESH, COLD_MIGRATION, EMERGENCY, UPDATE, STALE, DEFRAG = range(len(REASONS))


@dataclass
class PageMoves:
    """Struct of arrays, one row per page move, in the order they must be executed."""

    rank: np.ndarray    # int32 GPU whose page table this is
    expert: np.ndarray  # int32 expert instance id (as given to the pager)
    page: np.ndarray    # int32 page index inside the expert
    slot: np.ndarray    # int32 GPU slot read from (src GPU) or written to (dst GPU); -1 otherwise
    src: np.ndarray     # int8 location code (GPU, HOST, NONE, PEER)
    dst: np.ndarray     # int8 location code
    nbytes: np.ndarray  # int64 bytes that cross a link (0: drop of a clean page, invalidation)
    reason: np.ndarray  # int8 index into REASONS

    _DTYPES = {"rank": np.int32, "expert": np.int32, "page": np.int32, "slot": np.int32,
               "src": np.int8, "dst": np.int8, "nbytes": np.int64, "reason": np.int8}

    @classmethod
    def empty(cls) -> "PageMoves":
        return cls(**{name: np.empty(0, dtype) for name, dtype in cls._DTYPES.items()})

    @classmethod
    def concat(cls, parts: Sequence["PageMoves"]) -> "PageMoves":
        """The rows of ``parts`` one after the other."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in _MOVE_FIELDS))

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def pcie_bytes(self) -> int:
        """Bytes of HOST<->GPU rows (they cross the GPU's PCIe link)."""
        pcie = ((self.src == HOST) & (self.dst == GPU)) | ((self.src == GPU) & (self.dst == HOST))
        return int(self.nbytes[pcie].sum())

    @property
    def peer_bytes(self) -> int:
        """Bytes of PEER->GPU rows (they cross the fabric, carried by a p2p op, M16)."""
        return int(self.nbytes[(self.src == PEER) & (self.dst == GPU)].sum())

    def count_by_reason(self) -> dict[str, int]:
        """Rows per reason, every reason present (0 when none)."""
        counts = np.bincount(self.reason, minlength=len(REASONS))
        return {name: int(c) for name, c in zip(REASONS, counts)}

_MOVE_FIELDS = tuple(f.name for f in fields(PageMoves))



def add_reason_counts(total: dict[str, int], moves: PageMoves, times: int = 1) -> dict[str, int]:
    """``total`` (reason -> rows) with ``times`` x the rows of ``moves`` added, in place."""
    for name, c in moves.count_by_reason().items():
        total[name] = total.get(name, 0) + times * c
    return total


def page_move_count(moves: PageMoves) -> int:
    """Page relocations in ``moves``: loads, write-backs, drops and refreshes; gradient
    shipping (``update``) and invalidation of stale replicas (``stale``) are not moves."""
    if not len(moves):
        return 0
    return int(len(moves) - np.count_nonzero((moves.reason == UPDATE) | (moves.reason == STALE)))
