"""Process groups of one rank: fixed groups made at start, cached groups made on demand.

``torch.distributed.new_group`` must be called by every rank in the same order, so
fixed groups are created from the layout in one fixed order, and cached groups (M10)
from the group cache's ``created`` / ``evicted`` lists, which every rank's controller
computes identically.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from testbed.group_cache import CacheEvents, GroupCache
from testbed.planner import Planner


class Groups:
    def __init__(self, planner: Planner):
        lay = planner.layout
        self.world = tuple(range(lay.world))
        self.fixed: dict[tuple[int, ...], object] = {self.world: dist.group.WORLD}
        wanted = [tuple(sorted(lay.ep_group(g))) for g in range(lay.replicas)]
        wanted += [tuple(sorted(lay.replica_group(j))) for j in range(lay.ep_size)]
        for grid in planner.grids or []:
            wanted += [tuple(int(r) for r in row) for row in grid]
            wanted += [tuple(int(r) for r in grid[:, c]) for c in range(grid.shape[1])]
        for members in wanted:
            if members not in self.fixed:
                self.fixed[members] = dist.new_group(list(members)) if len(members) > 1 else None
        self.cached: dict[tuple[int, ...], object] = {}
        self._retired: list[object] = []
        self.created_s = 0.0  # seconds spent creating cached groups (all of them)

    def get(self, members: tuple[int, ...], cached: bool = False):
        members = tuple(members)
        return self.cached[members] if cached else self.fixed[members]

    def apply(self, events: CacheEvents) -> float:
        """Create the groups the cache missed on; evicted ones are destroyed by ``retire``.
        Returns the seconds the creation took."""
        t0 = time.perf_counter()
        for members in events.evicted:
            self._retired.append(self.cached.pop(members, None))
        for members in events.created:
            self.cached[members] = dist.new_group(list(members))
        seconds = time.perf_counter() - t0
        self.created_s += seconds
        return seconds

    def restore(self, cache: GroupCache) -> None:
        """After a resume (M23): one communicator per group of a restored cache, created
        in the cache's LRU order, which every rank's restored controller shares."""
        for pg in self.cached.values():
            self._retired.append(pg)
        self.cached = {}
        self.retire()
        for members in cache.groups():  # least recently used first
            self.cached[members] = dist.new_group(list(members))

    def retire(self) -> None:
        """Destroy groups evicted this round, after the round's ops ran."""
        for pg in self._retired:
            if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(pg)
        self._retired = []
