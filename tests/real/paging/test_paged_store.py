"""The paged store keeps expert weights bit-identical to an unpaged copy whatever the
pager does (M12-M17): loads, evictions with write-back, cold migration, wake-up,
updates of pages on either side, invalidation, refresh from a peer and compaction."""

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from real.paging.paged_store import PagedExpertStore
from testbed.policy.heat import COLD, WARM
from testbed.policy.pager import RankPager
from testbed.scenario.sections import PagerConfig

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


class FakeCuda:
    """CUDA streams and events as a log, for the store's CUDA paths on CPU tensors:
    ``("record", event, stream)`` and ``("wait", stream, event)``; every event pair is
    2 ms apart (``elapsed_time``)."""

    def __init__(self, monkeypatch):
        self.log, self.events = [], 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                fake.events += 1
                self.id, self.timed = fake.events, enable_timing

            def record(self, stream=None):
                fake.log.append(("record", self.id, getattr(stream, "name", "compute")))

            def elapsed_time(self, other):
                assert self.timed and other.timed, "elapsed_time needs two timed events"
                return 2.0

            def query(self):
                return True

            def synchronize(self):
                pass

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_event(self, ev):
                fake.log.append(("wait", self.name, ev.id))

            def wait_stream(self, other):
                pass

            def synchronize(self):
                pass

        self.compute = Stream("compute")
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.compute)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        self.copy = Stream("copy")

    def attach(self, store) -> None:
        """Make ``store`` (built on CPU) take its CUDA paths, M14 page events on."""
        store.cuda, store.copy_stream, store.page_events = True, self.copy, True

    def waited(self) -> list[int]:
        return [e[2] for e in self.log if e[0] == "wait" and e[1] == "compute"]


def test_page_by_page_waits_are_timed(monkeypatch):
    """M14: compute waiting page by page for pages still in flight is stall, timed as an
    expert-granular wait is: one timed event pair per page waited for, summed by settle."""
    cuda = FakeCuda(monkeypatch)
    pager, store, shadow = make(budget_pages=12)
    cuda.attach(store)
    store.execute(pager.heat_update(np.ones(5, bool), np.full(5, COLD), np.zeros(5, bool), 0))  # all to the host
    store.settle()
    cuda.log.clear()
    store.execute(pager.access([3], 1))
    assert [torch.equal(w, shadow[3][start:start + len(w)]) for start, w in store.segments(3)] == [True] * 3
    assert len(cuda.waited()) == 3  # one wait per page, each on its own load's event
    assert store.settle() == pytest.approx(3 * 2e-3)
    assert store.settle() == 0.0  # counted once


def test_a_page_granular_read_from_the_host_waits_for_the_dirty_write_back(monkeypatch):
    """An expert updated on the device and evicted is written back to the host on the copy
    stream (M15); reading it page by page from the host (M14) copies each page over from
    the host pool, so compute first waits for an event recorded after that write-back."""
    cuda = FakeCuda(monkeypatch)
    pager, store, shadow = make(budget_pages=3)
    cuda.attach(store)
    store.execute(pager.access([3], 0))
    pager.end_step()
    store.update(3, torch.ones(ELEMS), 0.5)
    store.execute(pager.apply_update([3]))
    store.settle()  # the loads' page events are gone: only what comes next can be waited for
    cuda.log.clear()
    evict = pager.access([5], 1)
    written_back = int(((evict.expert == 3) & (evict.nbytes > 0)).sum())
    assert written_back == 3  # every page of 3 was dirty
    store.execute(evict)
    after_write_back = {e[1] for e in cuda.log if e[0] == "record" and e[2] == "copy"}
    got = torch.cat([w for _, w in store.segments(3)])
    assert torch.equal(got, shadow[3] - 0.5)
    waits = cuda.waited()
    assert len(waits) == 3 and set(waits) <= after_write_back
