"""The page table and its migration policies (M12-M16)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.policy import heat
from testbed.policy.page_table import ACTIVE, COLD, EVICTED
from testbed.policy.pager import GPU, HOST, NONE, PEER, REASONS, PageMoves, RankPager
from testbed.scenario.sections import PagerConfig

A, B, C = 10, 20, 30  # expert instance ids


def rows(moves: PageMoves) -> list[tuple]:
    """(expert, page, slot, src, dst, nbytes, reason) per row, for exact comparison."""
    assert np.all(moves.rank == 0)
    return [(int(e), int(p), int(s), "gpu host none peer".split()[src], "gpu host none peer".split()[dst],
             int(b), REASONS[r])
            for e, p, s, src, dst, b, r in zip(moves.expert, moves.page, moves.slot, moves.src,
                                                moves.dst, moves.nbytes, moves.reason)]


def pager(experts=(A, B, C), expert_bytes=20, page=10, budget=0, free=0.2, **cfg):
    config = PagerConfig(page_size_bytes=page, gpu_budget_bytes=budget, emergency_free_fraction=free, **cfg)
    return RankPager(0, list(experts), expert_bytes, config)


def small():
    """3 experts x 2 pages of 10 bytes, 5 slots with 1 kept free: A, B resident, C on host."""
    p = pager(budget=50)
    assert (p.capacity_slots, p.reserve_slots, p.used_slots) == (5, 1, 4)
    return p


def loc(p, expert):
    return p.location[p.pages_of(expert)].tolist()


# ---- M12 page table --------------------------------------------------------------------
def test_pages_and_last_page_bytes():
    p = pager(experts=[3, 1], expert_bytes=35)
    assert p.pages_per_expert == 4
    np.testing.assert_array_equal(p.page_nbytes, [10, 10, 10, 5] * 2)
    assert p.pages_of(1) == slice(4, 8)
    q = pager(experts=[3], expert_bytes=40)
    np.testing.assert_array_equal(q.page_nbytes, [10, 10, 10, 10])
    with pytest.raises(ValueError):
        p.access([2], 0)


def test_initial_placement_with_budget():
    p = pager(experts=[5, 7, 9, 11], expert_bytes=35, budget=100, free=0.1)
    assert (p.capacity_slots, p.reserve_slots) == (10, 1)
    np.testing.assert_array_equal(p.location, [GPU] * 9 + [HOST] * 7)
    np.testing.assert_array_equal(p.state, [ACTIVE] * 9 + [EVICTED] * 7)
    np.testing.assert_array_equal(p.slot, list(range(9)) + [-1] * 7)
    assert (p.used_slots, p.free_slots, p.resident_bytes) == (9, 1, 90)
    assert not p.dirty.any() and p.host_valid.all()
    p.check_invariants()


def test_unlimited_budget_holds_everything_and_keeps_no_reserve():
    p = pager(experts=[5, 7], expert_bytes=35)
    assert (p.capacity_slots, p.reserve_slots, p.used_slots) == (8, 0, 8)
    assert len(p.access([5, 7], 0)) == 0


def test_reserve_rounds_up_without_float_noise():
    assert pager(experts=range(50), expert_bytes=20, budget=1000, free=0.07).reserve_slots == 7
    assert pager(experts=range(50), expert_bytes=20, budget=1000, free=0.071).reserve_slots == 8


# ---- access and M15 emergency ----------------------------------------------------------
def test_access_evicts_clean_first_keeps_reserve_and_never_evicts_pinned():
    p = small()
    assert len(p.apply_update([B])) == 0  # B's pages are dirty on the GPU now
    np.testing.assert_array_equal(p.dirty[p.pages_of(B)], [True, True])

    # C needs 2 slots, 1 is free: the clean A pages go first, the highest page first;
    # then one more eviction restores the reserve.
    m = p.access([C], step=1)
    assert rows(m) == [(A, 1, 1, "gpu", "host", 0, "emergency"),
                       (C, 0, 1, "host", "gpu", 10, "demand"),
                       (C, 1, 4, "host", "gpu", 10, "demand"),
                       (A, 0, 0, "gpu", "host", 0, "emergency")]
    assert (m.pcie_bytes, m.peer_bytes, p.free_slots) == (20, 0, 1)
    p.check_invariants()

    # C is pinned: the dirty B pages are written back instead.
    m = p.access([A], step=2)
    assert rows(m) == [(B, 1, 3, "gpu", "host", 10, "emergency"),
                       (A, 0, 0, "host", "gpu", 10, "demand"),
                       (A, 1, 3, "host", "gpu", 10, "demand"),
                       (B, 0, 2, "gpu", "host", 10, "emergency")]
    assert loc(p, C) == [GPU, GPU]
    assert not p.dirty.any() and p.host_valid.all()
    assert m.count_by_reason() == dict.fromkeys(REASONS, 0) | {"emergency": 2, "demand": 2}
    p.check_invariants()

    # Everything resident is pinned: the second page overflows past the budget.
    m = p.access([B], step=3)
    assert rows(m) == [(B, 0, 2, "host", "gpu", 10, "demand"), (B, 1, 5, "host", "gpu", 10, "demand")]
    assert (p.used_slots, p.overflow_peak_slots, p.peak_resident_bytes) == (6, 1, 60)
    p.check_invariants()

    # Unpinned again: the least recent clean page (C, step 1) makes room for the reserve.
    p.end_step()
    m = p.access([A], step=4)
    assert rows(m) == [(C, 1, 4, "gpu", "host", 0, "emergency")]
    assert p.free_slots == 1 and p.used_slots == 5
    np.testing.assert_array_equal(p.accesses, [4, 2, 2])  # A accessed twice x 2 pages
    p.check_invariants()


def test_overflow_slots_are_given_back_and_reused():
    p = pager(budget=20, free=0.0)  # 2 slots, A resident
    p.access([A], 0)
    p.access([B], 0)  # all pinned: overflow slots 2, 3
    assert p.slot[p.pages_of(B)].tolist() == [2, 3] and p.overflow_peak_slots == 2
    p.end_step()
    p.invalidate([B])
    assert p.used_slots == 2
    p.check_invariants()  # includes: no free overflow slot is kept at the tail
    # Back from a peer into the budget: the clean A pages make room.
    m = p.refresh([B], 1)
    assert rows(m) == [(A, 1, 1, "gpu", "host", 0, "emergency"), (A, 0, 0, "gpu", "host", 0, "emergency"),
                       (B, 0, 0, "peer", "gpu", 10, "refresh"), (B, 1, 1, "peer", "gpu", 10, "refresh")]
    # Refreshed pages are dirty: evicting them writes them back.
    m = p.access([C], 2)
    assert rows(m) == [(B, 1, 1, "gpu", "host", 10, "emergency"), (B, 0, 0, "gpu", "host", 10, "emergency"),
                       (C, 0, 0, "host", "gpu", 10, "demand"), (C, 1, 1, "host", "gpu", 10, "demand")]
    p.access([A], 2)
    assert p.slot[p.pages_of(A)].tolist() == [2, 3] and p.overflow_peak_slots == 2
    p.check_invariants()


# ---- M13 cold migration and M14 prefetch -----------------------------------------------
def heat_args(n, cold=(), hot=(), below=(), woken=()):
    states = np.full(n, heat.WARM, dtype=np.int8)
    states[list(cold)] = heat.COLD
    states[list(hot)] = heat.HOT
    mask = np.zeros(n, dtype=bool)
    mask[list(below)] = True
    wake = np.zeros(n, dtype=bool)
    wake[list(woken)] = True
    return mask, states, wake


def test_cold_migration_needs_cold_state_and_a_streak():
    p = pager(experts=[A, B], expert_bytes=40, cold_consecutive_updates=3)
    p.apply_update([A])
    # Below the cold percentile but not Cold: the streak grows, nothing moves.
    for step in range(3):
        assert len(p.heat_update(*heat_args(2, below=[0]), step=step)) == 0
    # Streak interrupted, then Cold: 3 more updates are needed.
    assert len(p.heat_update(*heat_args(2), step=3)) == 0
    assert len(p.heat_update(*heat_args(2, cold=[0], below=[0]), step=4)) == 0
    assert len(p.heat_update(*heat_args(2, cold=[0], below=[0]), step=5)) == 0
    p.access([A], 6)  # pending work blocks the migration ...
    assert len(p.heat_update(*heat_args(2, cold=[0], below=[0]), step=6)) == 0
    p.end_step()      # ... until the step is over
    m = p.heat_update(*heat_args(2, cold=[0], below=[0]), step=7)
    assert rows(m) == [(A, i, i, "gpu", "host", 10, "cold") for i in range(4)]
    assert p.frozen_experts().tolist() == [A]
    np.testing.assert_array_equal(p.state[p.pages_of(A)], [COLD] * 4)
    assert p.host_valid.all()
    # Frozen experts are not migrated again; B (clean) drops its pages at no cost.
    m = p.heat_update(*heat_args(2, cold=[0, 1], below=[0, 1]), step=8)
    assert len(m) == 0
    for step in (9, 10):
        m = p.heat_update(*heat_args(2, cold=[0, 1], below=[0, 1]), step=step)
    assert rows(m) == [(B, i, 4 + i, "gpu", "host", 0, "cold") for i in range(4)]
    assert p.used_slots == 0
    p.check_invariants()


def test_a_cold_expert_comes_back_with_its_first_pages_ahead_and_the_rest_on_demand():
    """M14: prefetch loads the predicted-first 3 of A's 4 pages (A was cold-migrated);
    the access then loads only the 4th, on demand, and the prefetched ones are hits."""
    p = pager(experts=[A, B], expert_bytes=40, cold_consecutive_updates=1, prefetch_pages=3)
    p.heat_update(*heat_args(2, cold=[0], below=[0]), step=0)
    assert p.frozen_experts().tolist() == [A]
    m = p.prefetch([A, B], step=1)  # B is resident: nothing to fetch for it
    assert rows(m) == [(A, i, i, "host", "gpu", 10, "prefetch") for i in range(3)]
    assert len(p.frozen_experts()) == 0
    p.check_invariants()
    m = p.access([B, A], step=1)
    assert rows(m) == [(A, 3, 3, "host", "gpu", 10, "demand")]
    np.testing.assert_array_equal(p.state, [ACTIVE] * 8)
    p.end_step()
    p.check_invariants()


def test_prefetch_takes_free_slots_above_the_reserve_and_never_evicts():
    """5 slots, 1 kept free (M15): A and B resident (4 slots), C on the host. No slot is
    free above the reserve: prefetching C does nothing. Without a reserve, and C
    cold-migrated (one slot free), C's first page takes that slot, and nothing is evicted."""
    p = small()
    assert len(p.prefetch([C], step=1)) == 0
    p = pager(budget=50, free=0.0, cold_consecutive_updates=1)
    p.heat_update(*heat_args(3, cold=[2], below=[2]), step=0)
    assert p.frozen_experts().tolist() == [C] and p.free_slots == 1
    m = p.prefetch([C], step=1)
    assert rows(m) == [(C, 0, 4, "host", "gpu", 10, "prefetch")]  # the prefetch cut at the room there is
    assert loc(p, A) == [GPU, GPU] and loc(p, B) == [GPU, GPU]
    p.check_invariants()


# ---- M20 wake and M19 hot prefetch -----------------------------------------------------
def test_wake_loads_first_pages_only_into_free_slots_above_reserve():
    # 4 experts x 4 pages, 10 slots, 2 kept free.
    p = pager(experts=[A, B, C, 40], expert_bytes=40, budget=100, free=0.2,
              cold_consecutive_updates=1, prefetch_pages=3)
    assert (p.used_slots, p.reserve_slots) == (8, 2)
    m = p.heat_update(*heat_args(4, cold=[0, 1], below=[0, 1]), step=0)
    assert p.frozen_experts().tolist() == [A, B] and p.used_slots == 0
    p.access([C, 40], 1)  # 8 slots used again, 2 free = the reserve
    assert p.free_slots == 2
    # Woken, but no slot above the reserve: nothing loads and nothing is evicted.
    m = p.heat_update(*heat_args(4, woken=[0]), step=2)
    assert len(m) == 0 and p.frozen_experts().tolist() == [B]
    p.end_step()
    p.invalidate([40])  # frees 4 slots: 6 free, 4 above the reserve
    m = p.heat_update(*heat_args(4, woken=[1, 2]), step=3)  # C is not frozen: no-op for it
    assert rows(m) == [(B, 0, 4, "host", "gpu", 10, "wake"), (B, 1, 5, "host", "gpu", 10, "wake"),
                       (B, 2, 6, "host", "gpu", 10, "wake")]
    assert len(p.frozen_experts()) == 0
    # A is hot now: its pages fill the one slot left above the reserve.
    m = p.heat_update(*heat_args(4, hot=[0]), step=4)
    assert rows(m) == [(A, 0, 7, "host", "gpu", 10, "prefetch")]
    assert p.free_slots == p.reserve_slots
    p.check_invariants()


def test_wake_of_a_frozen_expert_with_enough_room():
    p = pager(experts=[A, B], expert_bytes=40, cold_consecutive_updates=1, prefetch_pages=2)
    p.heat_update(*heat_args(2, cold=[0], below=[0]), step=0)
    m = p.heat_update(*heat_args(2, woken=[0], below=[0]), step=1)
    assert rows(m) == [(A, 0, 0, "host", "gpu", 10, "wake"), (A, 1, 1, "host", "gpu", 10, "wake")]
    # The woken expert starts a new streak: one more cold update migrates it again.
    m = p.heat_update(*heat_args(2, cold=[0], below=[0]), step=2)
    assert [r[-1] for r in rows(m)] == ["cold", "cold"]


# ---- updates, invalidation, refresh (M9, M16) ------------------------------------------
def test_apply_update_ships_gradients_to_host_only_pages():
    p = small()
    m = p.apply_update([C, A])
    assert rows(m) == [(C, 0, -1, "gpu", "host", 10, "update"), (C, 1, -1, "gpu", "host", 10, "update")]
    assert m.pcie_bytes == 20
    np.testing.assert_array_equal(p.dirty, [True, True, False, False, False, False])
    assert loc(p, C) == [HOST, HOST] and p.host_valid[p.pages_of(C)].all()
    p.check_invariants()


def test_invalidate_then_refresh_from_a_peer():
    p = small()
    p.apply_update([A])
    m = p.invalidate([A, C])
    assert rows(m) == [(A, 0, 0, "gpu", "none", 0, "stale"), (A, 1, 1, "gpu", "none", 0, "stale"),
                       (C, 0, -1, "host", "none", 0, "stale"), (C, 1, -1, "host", "none", 0, "stale")]
    assert loc(p, A) == [NONE, NONE] and p.free_slots == 3
    assert len(p.apply_update([A])) == 0  # stale pages are skipped
    with pytest.raises(ValueError, match="refresh"):
        p.access([B, C], 1)
    assert p.refcount.sum() == 0  # the failed access changed nothing
    m = p.refresh([C, B], 1)
    assert rows(m) == [(C, 0, 0, "peer", "gpu", 10, "refresh"), (C, 1, 1, "peer", "gpu", 10, "refresh")]
    assert (m.peer_bytes, m.pcie_bytes) == (20, 0)
    np.testing.assert_array_equal(p.dirty[p.pages_of(C)], [True, True])
    p.access([C], 1)
    with pytest.raises(ValueError, match="pinned"):
        p.invalidate([C])
    p.check_invariants()


def test_page_moves_helpers():
    assert len(PageMoves.empty()) == 0 and len(PageMoves.concat([])) == 0
    p = small()
    a, b = p.apply_update([C]), p.invalidate([C])
    both = PageMoves.concat([a, PageMoves.empty(), b])
    assert len(both) == 4 and both.count_by_reason()["stale"] == 2
    assert both.nbytes.dtype == np.int64 and both.src.dtype == np.int8 and both.slot.dtype == np.int32


# ---- property: no page is ever lost ----------------------------------------------------
class Shadow:
    """Executes the moves on version numbers: which copy of each page is current."""

    def __init__(self, p: RankPager):
        self.p = p
        self.latest = np.zeros(len(p.experts), dtype=np.int64)
        self.gpu = np.where(p.location == GPU, 0, -1)   # version on the GPU, -1 none
        self.host = np.zeros(len(p.location), dtype=np.int64)  # version on host, -1 none
        self.slots = {int(s): i for i, s in enumerate(p.slot) if s >= 0}

    def index(self, expert, page):
        return int(np.flatnonzero(self.p.experts == expert)[0]) * self.p.pages_per_expert + int(page)

    def execute(self, moves: PageMoves):
        for e, pg, slot, src, dst, nbytes, reason in zip(moves.expert, moves.page, moves.slot, moves.src,
                                                        moves.dst, moves.nbytes, moves.reason):
            i, slot, e_local = self.index(e, pg), int(slot), int(np.flatnonzero(self.p.experts == e)[0])
            assert nbytes in (0, self.p.page_nbytes[i])
            if REASONS[reason] == "update":
                assert (src, dst, slot, self.gpu[i]) == (GPU, HOST, -1, -1)
                self.host[i] = self.latest[e_local]
            elif dst == GPU:
                assert slot not in self.slots and self.gpu[i] < 0 and nbytes > 0
                self.slots[slot] = i
                self.gpu[i] = self.latest[e_local] if src == PEER else self.host[i]
                assert self.gpu[i] >= 0
            elif src == GPU:
                assert self.slots.pop(slot) == i
                if dst == HOST:
                    if nbytes:
                        self.host[i] = self.gpu[i]
                    else:
                        assert self.host[i] == self.gpu[i], "dropped the only current copy"
                self.gpu[i] = -1
                if dst == NONE:
                    self.host[i] = -1
            else:
                assert (src, dst, nbytes) == (HOST, NONE, 0)
                self.host[i] = -1

    def update(self, local):
        self.latest[local] += 1
        pages = (local[:, None] * self.p.pages_per_expert + np.arange(self.p.pages_per_expert)).ravel()
        on_gpu = pages[self.gpu[pages] >= 0]
        self.gpu[on_gpu] = np.repeat(self.latest, self.p.pages_per_expert)[on_gpu]

    def check(self):
        self.p.check_invariants()
        latest = np.repeat(self.latest, self.p.pages_per_expert)
        np.testing.assert_array_equal(self.p.location == GPU, self.gpu >= 0)
        np.testing.assert_array_equal(self.p.slot[self.gpu >= 0], [k for k in sorted(self.slots, key=self.slots.get)])
        live = self.p.location != NONE
        # No version is ever lost: a live page's freshest copy is the latest.
        assert np.all(np.maximum(self.gpu, self.host)[live] == latest[live])
        assert np.all(self.gpu[self.gpu >= 0] == latest[self.gpu >= 0])
        np.testing.assert_array_equal(self.p.host_valid, self.host == latest)


@st.composite
def histories(draw):
    n_experts = draw(st.integers(1, 4))
    pages = draw(st.integers(1, 4))
    page = 8
    expert_bytes = draw(st.integers((pages - 1) * page + 1, pages * page))
    # Mostly a budget smaller than the experts (eviction), sometimes unlimited (0).
    slots = draw(st.just(0) | st.integers(1, max(1, n_experts * pages - 1)))
    config = PagerConfig(page_size_bytes=page, gpu_budget_bytes=slots * page,
                         emergency_free_fraction=draw(st.sampled_from([0.0, 0.2, 0.5])),
                         cold_consecutive_updates=draw(st.integers(1, 3)),
                         prefetch_pages=draw(st.integers(0, 3)),
                         eviction_order=draw(st.sampled_from(["clean_first", "scored"])),
                         free_memory=draw(st.sampled_from(["budget", "device"])))
    subset = st.lists(st.integers(0, n_experts - 1), max_size=n_experts + 1)
    flags = st.lists(st.booleans(), min_size=n_experts, max_size=n_experts)
    access = st.tuples(st.just("access"), subset, st.booleans())
    heat_update = st.tuples(st.just("heat"), flags,
                            st.lists(st.sampled_from([heat.HOT, heat.WARM, heat.COLD, heat.COLD]),
                                     min_size=n_experts, max_size=n_experts), flags)
    end_step = st.tuples(st.just("end_step"))
    # Accesses, heat updates and step ends weigh more: they drive eviction and migration.
    # M15 with free_memory = device: the device's free memory outside the pool changes
    squeeze = st.tuples(st.just("free"), st.integers(0, 12 * page), st.integers(page, 40 * page))
    op = st.one_of(access, access, access, heat_update, heat_update, end_step, end_step, squeeze,
                   st.tuples(st.just("refresh"), subset), st.tuples(st.just("prefetch"), subset),
                   st.tuples(st.just("update"), subset),
                   st.tuples(st.just("invalidate"), subset))
    return n_experts, expert_bytes, config, draw(st.lists(op, max_size=40))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(histories())
def test_any_history_keeps_every_page_and_the_table_consistent(history):
    n_experts, expert_bytes, config, ops = history
    ids = np.arange(n_experts) * 7 + 3
    p = RankPager(0, ids.tolist(), expert_bytes, config)
    shadow = Shadow(p)
    shadow.check()
    for step, (kind, *args) in enumerate(ops):
        if kind == "access":
            local, refresh_first = np.array(args[0], dtype=np.int64), args[1]
            if refresh_first:
                shadow.execute(p.refresh(ids[local], step))
            pages = np.concatenate([np.arange(i * p.pages_per_expert, (i + 1) * p.pages_per_expert)
                                    for i in local] + [np.empty(0, np.int64)])
            if np.any(p.location[pages] == NONE):
                before = (p.location.copy(), p.refcount.copy())
                with pytest.raises(ValueError):
                    p.access(ids[local], step)
                assert np.array_equal(before[0], p.location) and np.array_equal(before[1], p.refcount)
            else:
                shadow.execute(p.access(ids[local], step))
                assert np.all(shadow.gpu[pages] == np.repeat(shadow.latest, p.pages_per_expert)[pages])
                assert np.all(p.refcount[pages] > 0)
        elif kind == "refresh":
            shadow.execute(p.refresh(ids[args[0]], step))
        elif kind == "prefetch":  # M14: never past the budget, never into the M15 reserve
            before = p.used_slots
            shadow.execute(p.prefetch(ids[args[0]], step))
            assert p.used_slots <= max(before, p.capacity_slots - p.reserve_slots)
        elif kind == "update":
            local = np.unique(np.array(args[0], dtype=np.int64))
            moves = p.apply_update(ids[local])
            shadow.update(local)
            shadow.execute(moves)
        elif kind == "invalidate":
            local = np.array(args[0], dtype=np.int64)
            pinned = [i for i in local if p.refcount[p.pages_of(ids[i])].any()]
            if pinned:
                with pytest.raises(ValueError):
                    p.invalidate(ids[local])
            else:
                shadow.execute(p.invalidate(ids[local]))
        elif kind == "end_step":
            p.end_step()
        elif kind == "free":
            if config.free_memory == "device":
                p.set_free_memory(*args)
                assert 0 <= p.reserve_slots <= p.capacity_slots
        else:
            below, states, woken = args
            shadow.execute(p.heat_update(np.array(below), np.array(states, dtype=np.int8),
                                         np.array(woken), step))
        shadow.check()
        assert p.free_slots >= 0 and p.used_slots <= p.capacity_slots + p.overflow_peak_slots


# ---- M15 as the seed describes it ---------------------------------------------------------------
def test_scored_eviction_takes_the_dirtiest_least_referenced_pages_first():
    """A: updated 3 times, read once (last at step 3); B: updated once, read 3 times (last
    at step 2); C on the host needs room. ``scored`` evicts A (score 3/4 - 1/2 = 0.25
    against B's 1/2 - 3/4 < 0) although B is less recent; ``clean_first`` (both dirty)
    evicts the least recent, B."""
    scored = pager(budget=50, eviction_order="scored")
    for step in range(3):
        scored.access([B], step)
        scored.end_step()
    scored.access([A], 3)
    scored.end_step()
    scored.apply_update([A]), scored.apply_update([A]), scored.apply_update([A]), scored.apply_update([B])
    np.testing.assert_allclose(scored.eviction_scores(np.arange(4)), [0.25, 0.25, 0.5 - 0.75, 0.5 - 0.75])
    m = scored.access([C], 4)
    out = [(e, r) for e, _, _, src, dst, _, r in rows(m) if src == "gpu"]
    assert {e for e, _ in out} == {A}  # the dirtiest, least referenced expert, though B is least recent
    assert all(r == "emergency" for _, r in out)
    scored.check_invariants()

    plain = pager(budget=50)  # clean_first: dirty both, so the least recent goes: B (steps 0-2 < A's 3)
    for step in range(3):
        plain.access([B], step)
        plain.end_step()
    plain.access([A], 3)
    plain.end_step()
    plain.apply_update([A]), plain.apply_update([B])
    m = plain.access([C], 4)
    assert {e for e, _, _, src, *_ in rows(m) if src == "gpu"} == {B}


def test_device_free_memory_sets_the_reserve():
    """5% of a 1,000-byte device must stay free: 50 bytes. 30 free outside the pool: the
    pool keeps ceil(20 / 10) = 2 slots free; 60 outside: none; nothing outside: 5."""
    p = pager(budget=100, free=0.05, free_memory="device")  # 10 slots: all 6 pages resident
    assert p.reserve_slots == 1  # the budget rule until the backend tells it
    p.set_free_memory(30, 1000)
    assert p.reserve_slots == 2
    m = p.access([A], 0)  # 4 free already: nothing to evict
    assert m.count_by_reason()["emergency"] == 0
    p.set_free_memory(0, 1000)
    assert p.reserve_slots == 5
    m = p.access([A], 0)  # A pinned: B and C give up one page... 4 free, 5 needed: one eviction
    assert m.count_by_reason()["emergency"] == 1 and p.free_slots == 5
    p.set_free_memory(60, 1000)
    assert p.reserve_slots == 0
    with pytest.raises(ValueError, match="device_bytes"):
        p.set_free_memory(0, 0)
    p.check_invariants()
