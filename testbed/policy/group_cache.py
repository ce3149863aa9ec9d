"""The expert group cache (M10): an LRU of active groups and their communicators.

Two-stage sync (M9) needs a communicator per active group A_e. Creating one is costly
(on NCCL ~0.5 GB and up to seconds for its first collective), so recent groups are
kept: a *hit* reuses one, a *miss* creates one and may evict the least recently used.
The cache is a pure state machine; the real backend mirrors ``created`` / ``evicted``
with ``torch.distributed.new_group`` / ``destroy_process_group`` in the same order on
every rank, the simulator charges the profile's creation cost per miss.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class CacheEvents:
    """What one round of lookups did, in order."""

    hits: int = 0
    misses: int = 0
    created: list[tuple[int, ...]] = field(default_factory=list)
    evicted: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def lookups(self) -> int:
        return self.hits + self.misses


class GroupCache:
    """LRU cache of groups (sorted rank tuples) with at most ``capacity`` entries."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("group cache capacity must be >= 1")
        self.capacity = capacity
        self._groups: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __contains__(self, group) -> bool:
        return tuple(group) in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def groups(self) -> list[tuple[int, ...]]:
        """The cached groups, least recently used first."""
        return list(self._groups)

    def lookup(self, groups, events: CacheEvents | None = None) -> CacheEvents:
        """Look every group up in order; returns (or extends) the events of this round.

        A group needed twice in one round is created once. A backend should destroy the
        ``evicted`` groups only after the round's ops ran: when one round needs more
        groups than the cache holds, a group may be evicted before its own op.
        """
        events = events or CacheEvents()
        for group in groups:
            key = tuple(group)
            if key in self._groups:
                self._groups.move_to_end(key)
                self.hits += 1
                events.hits += 1
                continue
            self.misses += 1
            events.misses += 1
            if len(self._groups) >= self.capacity:
                old, _ = self._groups.popitem(last=False)
                events.evicted.append(old)
            self._groups[key] = None
            events.created.append(key)
        return events

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None
