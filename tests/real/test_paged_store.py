"""The paged store keeps expert weights bit-identical to an unpaged copy whatever the
pager does (M12-M17): loads, evictions with write-back, cold migration, wake-up,
updates of pages on either side, invalidation, refresh from a peer and compaction."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from real.paged_store import PagedExpertStore
from testbed.heat import COLD, WARM
from testbed.pager import RankPager
from testbed.scenario import PagerConfig

ELEMS = 10  # an expert of 10 fp32 elements = 40 bytes, pages of 16 bytes: 3 pages (last holds 2)
EXPERTS = [3, 5, 8, 13, 21]


def make(budget_pages):
    cfg = PagerConfig(page_size_bytes=16, gpu_budget_bytes=16 * budget_pages, prefetch_pages=1,
                      cold_consecutive_updates=1)
    pager = RankPager(0, EXPERTS, ELEMS * 4, cfg)
    init = lambda i: torch.arange(ELEMS, dtype=torch.float32) + 100 * i  # noqa: E731
    store = PagedExpertStore(pager, ELEMS, torch.float32, torch.device("cpu"), init)
    shadow = {i: init(i).clone() for i in EXPERTS}
    return pager, store, shadow


op = st.one_of(
    st.tuples(st.just("access"), st.lists(st.sampled_from(EXPERTS), min_size=1, max_size=3)),
    st.tuples(st.just("update"), st.lists(st.sampled_from(EXPERTS), min_size=1, max_size=5)),
    st.tuples(st.just("stale"), st.sampled_from(EXPERTS)),
    st.tuples(st.just("cold"), st.lists(st.booleans(), min_size=5, max_size=5)),
    st.tuples(st.just("defrag"), st.just(None)),
)


@settings(max_examples=150, deadline=None)
@given(budget=st.integers(3, 12), ops=st.lists(op, max_size=25), seed=st.integers(0, 2**16))
def test_pages_always_hold_the_reference_weights(budget, ops, seed):
    pager, store, shadow = make(budget)
    stale: set[int] = set()
    g = torch.Generator().manual_seed(seed)
    for step, (kind, arg) in enumerate(ops):
        if kind == "access":
            for i in set(arg) & stale:  # refreshed from a peer that has the latest weights
                store.execute(pager.refresh([i], step), {i: shadow[i].clone()})
                stale.discard(i)
            store.execute(pager.access(arg, step))
            pager.end_step()
            for i in arg:
                assert torch.equal(store.read(i), shadow[i])
        elif kind == "update":
            live = [i for i in dict.fromkeys(arg) if i not in stale]
            moves = pager.apply_update(live)
            for i in live:
                grad = torch.randn(ELEMS, generator=g)
                shipped = store.update(i, grad, 0.1)
                shadow[i] = shadow[i] - 0.1 * grad
                on_host = moves.expert == i
                assert shipped == int(moves.nbytes[on_host].sum())
            store.execute(moves)
        elif kind == "stale" and arg not in stale:
            store.execute(pager.invalidate([arg]))
            stale.add(arg)
        elif kind == "cold":
            below = np.array(arg)
            states = np.where(below, COLD, WARM)
            store.execute(pager.heat_update(below, states, np.zeros(5, bool), step))
        elif kind == "defrag":  # M17: a permutation of the pool, cycles included
            store.execute(pager.defragment())
            assert pager.fragmentation == 0.0
        pager.check_invariants()
        for i in EXPERTS:
            if i not in stale:
                assert torch.equal(store.read(i), shadow[i]), (kind, i)
        live = [i for i in EXPERTS if i not in stale]
        counts = [int(n) for n in torch.randint(0, 3, (len(live),), generator=g)]
        stacked = store.stacked(live, counts, pipelined=bool(step % 2))  # a grouped GEMM's weights
        stacked.ready(ELEMS)
        for (i, n), row in zip(stacked.members, stacked.w_GX):
            if n:
                assert torch.equal(row, shadow[i]), (kind, i)
        assert {i for i, n in stacked.members if n} == {i for i, n in zip(live, counts) if n}
    assert store.device_bytes <= max(pager.used_slots, 0) * 16 + 16


def test_an_experts_whole_pages_into_consecutive_slots_are_one_copy(monkeypatch):
    """Loading an expert into an empty pool: its two whole pages go into consecutive slots
    in one copy (its last, partial page is a copy of its own); the data is the expert's."""
    pager, store, shadow = make(budget_pages=12)
    singles = []
    to_slot = store._to_slot
    monkeypatch.setattr(store, "_to_slot", lambda page, slot, data: singles.append(page) or to_slot(page, slot, data))
    to_host = pager.heat_update(np.ones(5, bool), np.full(5, COLD), np.zeros(5, bool), 0)
    store.execute(to_host)
    moves = pager.access([3], 1)
    loads = len(moves)
    store.execute(moves)
    assert loads == 3 and len(singles) == 1  # pages 0 and 1 together, page 2 alone
    assert torch.equal(store.read(3), shadow[3])
