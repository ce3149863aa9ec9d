"""Process groups of one rank: fixed groups made at start, cached groups made on demand.

``torch.distributed.new_group`` must be called by every rank in the same order, so
fixed groups are created from the layout in one fixed order, and cached groups (M10)
from the group cache's ``created`` / ``evicted`` lists, which every rank's controller
computes identically.

On CUDA every group is made with ``device_id`` (torch >= 2.5), so NCCL creates its
communicator at once: its time and its device memory are paid, and measured, where the
group is created (``created_s``, ``created_bytes``), not in the group's first collective.
"""

from __future__ import annotations

import inspect
import time

import torch
import torch.distributed as dist

from testbed.policy.group_cache import CacheEvents, GroupCache
from testbed.policy.planner import Planner


def eager_device(device: torch.device | None) -> dict:
    """``device_id`` for ``init_process_group`` / ``new_group`` where it makes NCCL create
    the communicator at once (a CUDA device, a torch that takes it); else nothing."""
    if device is None or device.type != "cuda" or "device_id" not in inspect.signature(dist.new_group).parameters:
        return {}
    return {"device_id": device}


def free_device_bytes(device: torch.device | None) -> int:
    """Free memory of the CUDA device as the driver reports it (NCCL's buffers included,
    which the caching allocator does not see); 0 off CUDA."""
    if device is None or device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return int(torch.cuda.mem_get_info(device)[0])


class Groups:
    """The process groups of one rank, by member set (the rank's scenario numbering).

    With pipeline stages (``place``) each stage's ranks are numbered from 0 and its world
    is a group of its own; every rank creates every stage's groups, in one order, as
    ``torch.distributed.new_group`` needs of all ranks, and keeps its stage's."""

    def __init__(self, planner: Planner, device: torch.device | None = None, place=None):
        self.eager = eager_device(device)
        self.device = device
        self.place = place
        lay = planner.layout
        self.world = tuple(range(lay.world))
        # the world's group as is (a pipeline stage's: a group of its own); one rank needs none
        self.fixed: dict[tuple[int, ...], object] = {self.world: dist.group.WORLD if place is None else None}
        for members in planner.fixed_groups():
            if members == self.world and place is None:
                continue
            self.fixed[members] = self._new(members)
        self.cached: dict[tuple[int, ...], object] = {}
        # evicted this round: still usable by the round's ops, destroyed by ``retire``
        self._retiring: dict[tuple[int, ...], object] = {}
        self._retired: list[object] = []
        self.created_s = 0.0  # seconds spent creating cached groups (all of them)
        self.created_bytes = 0  # device bytes their communicators took (CUDA; 0 on CPU)

    def _new(self, members: tuple[int, ...]):
        if self.place is None:
            return dist.new_group(list(members), **self.eager)
        mine = None
        for stage in range(self.place.stages):  # every stage's copy, in stage order, on every rank
            pg = dist.new_group([self.place.global_rank(m, stage) for m in members], **self.eager)
            mine = pg if stage == self.place.stage else mine
        return mine

    def get(self, members: tuple[int, ...], cached: bool = False):
        members = tuple(members)
        if not cached:
            return self.fixed[members]
        return self.cached[members] if members in self.cached else self._retiring[members]

    def apply(self, events: CacheEvents) -> float:
        """Mirror one round of the cache's lookups: create the groups it missed on and set
        aside the ones it evicted, in the order the cache did (once the cache is full every
        miss evicts, so the evictions go with the last misses). A round that needs more
        groups than the cache holds evicts a group before its own op runs (one that hit
        earlier in the round, or one created in it), so set-aside groups stay usable until
        ``retire`` destroys them after the round's ops. Returns the seconds the creation
        took."""
        t0, free0 = time.perf_counter(), free_device_bytes(self.device)
        first_evicting = len(events.created) - len(events.evicted)
        for k, members in enumerate(events.created):
            if k >= first_evicting:
                old = events.evicted[k - first_evicting]
                if old in self.cached:
                    pg = self.cached.pop(old)
                    self._retiring[old] = pg
                    self._retired.append(pg)
            if members not in self.cached:
                self.cached[members] = self._new(members)
        seconds = time.perf_counter() - t0
        self.created_s += seconds
        if events.created:
            self.created_bytes += max(free0 - free_device_bytes(self.device), 0)
        return seconds

    def held(self) -> list[tuple[int, ...]]:
        """Member sets of the groups this rank's process holds now: the fixed ones and the
        group cache's (M10)."""
        return [m for m, pg in self.fixed.items() if pg is not None and len(m) > 1] + list(self.cached)

    def restore(self, cache: GroupCache) -> None:
        """After a resume (M23): one communicator per group of a restored cache, created
        in the cache's LRU order, which every rank's restored controller shares."""
        for pg in self.cached.values():
            self._retired.append(pg)
        self.cached = {}
        self.retire()
        for members in cache.groups():  # least recently used first
            self.cached[members] = self._new(members)

    def retire(self) -> None:
        """Destroy groups evicted this round, after the round's ops ran."""
        self._retiring = {}
        for pg in self._retired:
            if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(pg)
        self._retired = []
