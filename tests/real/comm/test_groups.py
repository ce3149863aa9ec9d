"""The real backend's cached communicators mirror the group cache (M10) exactly: groups
evicted in a round stay usable by that round's ops and are destroyed after it; none leaks."""

from __future__ import annotations

import itertools

import pytest
import torch

from real.comm import groups as groups_mod
from testbed.policy.group_cache import GroupCache


class FakeDist:
    """new_group / destroy_process_group that count what exists."""

    def __init__(self):
        self.live: set[int] = set()
        self.ids = itertools.count()

    def new_group(self, members):
        pg = ("pg", next(self.ids), tuple(members))
        self.live.add(pg[1])
        return pg

    def destroy_process_group(self, pg):
        self.live.remove(pg[1])


@pytest.fixture
def fake(monkeypatch):
    f = FakeDist()
    monkeypatch.setattr(groups_mod.dist, "new_group", f.new_group)
    monkeypatch.setattr(groups_mod.dist, "destroy_process_group", f.destroy_process_group)
    monkeypatch.setattr(groups_mod.dist.GroupMember, "NON_GROUP_MEMBER", object(), raising=False)
    return f


def bare_groups() -> groups_mod.Groups:
    g = groups_mod.Groups.__new__(groups_mod.Groups)  # no fixed groups: only the cache's
    g.fixed, g.cached, g._retiring, g._retired, g.created_s = {}, {}, {}, [], 0.0
    g.eager, g.device, g.created_bytes, g.place = {}, None, 0, None
    return g


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_every_group_of_a_round_is_usable_until_retired_and_none_leaks(fake, capacity):
    cache, groups = GroupCache(capacity), bare_groups()
    rounds = [[(0, 1), (0, 2), (1, 2), (0, 1)], [(0, 2)], [(0, 1), (1, 3), (2, 3), (0, 3), (1, 3)], [(2, 3)]]
    for needed in rounds:
        events = cache.lookup(needed)
        groups.apply(events)
        for members in needed:  # the round's ops: a group hit early may have been evicted by now
            assert groups.get(members, cached=True)[2] == members
        groups.retire()
        # after the round: exactly the cache's groups exist, one communicator each
        assert set(groups.cached) == set(cache.groups())
        assert len(fake.live) == len(cache) <= capacity


def test_the_old_order_lost_a_group_hit_earlier_in_the_round(fake):
    """Capacity 1, round (a, b, a): a is created, evicted by b, created again. The cache
    ends with a; so must the communicators."""
    cache, groups = GroupCache(1), bare_groups()
    events = cache.lookup([(0, 1), (0, 2), (0, 1)])
    assert events.created == [(0, 1), (0, 2), (0, 1)] and events.evicted == [(0, 1), (0, 2)]
    groups.apply(events)
    assert groups.get((0, 2), cached=True)[2] == (0, 2)  # evicted in the round, still usable
    groups.retire()
    assert list(groups.cached) == [(0, 1)] and len(fake.live) == 1


def test_nccl_communicators_are_created_with_the_group_on_cuda_only():
    """On CUDA every group is made with device_id, so NCCL creates its communicator with
    the group (its cost measured there, not in the first collective); gloo takes none."""
    cuda = torch.device("cuda", 3)
    assert groups_mod.eager_device(cuda) == {"device_id": cuda}
    assert groups_mod.eager_device(torch.device("cpu")) == {} and groups_mod.eager_device(None) == {}
    assert groups_mod.free_device_bytes(torch.device("cpu")) == 0
