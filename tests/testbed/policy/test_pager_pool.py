"""The pager pool answers exactly what one pager per GPU would, while sharing pagers
between GPUs in the same state."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.policy.heat import COLD, WARM
from testbed.policy.pager import RankPager
from testbed.policy.pager_pool import PagerPool
from testbed.scenario.sections import PagerConfig

RANKS = [0, 3, 5, 6]
N = 6  # expert replicas per GPU
CFG = PagerConfig(page_size_bytes=16, gpu_budget_bytes=16 * 9, cold_consecutive_updates=1, prefetch_pages=1)


def local_of(rank):
    return np.arange(N) * 10 + rank  # different ids per GPU, same positions


call = st.one_of(
    st.tuples(st.just("access"), st.lists(st.lists(st.integers(0, N - 1), max_size=3), min_size=4, max_size=4)),
    st.tuples(st.just("apply_update"), st.lists(st.lists(st.integers(0, N - 1), max_size=4), min_size=4, max_size=4)),
    st.tuples(st.just("heat_update"), st.lists(st.lists(st.booleans(), min_size=N, max_size=N), min_size=4, max_size=4)),
)


@settings(max_examples=80, deadline=None)
@given(history=st.lists(call, max_size=20), shared=st.booleans())
def test_pool_equals_one_pager_per_gpu(history, shared):
    local = np.stack([local_of(r) for r in RANKS])
    pool = PagerPool(RANKS, local, 40, CFG)
    alone = {r: RankPager(r, local_of(r), 40, CFG) for r in RANKS}
    for step, (method, per_rank) in enumerate(history):
        if shared:  # everyone told the same thing: one pager must serve all
            per_rank = [per_rank[0]] * 4
        if method == "heat_update":
            args = {r: (np.array(b), np.where(b, COLD, WARM), np.zeros(N, bool)) for r, b in zip(RANKS, per_rank)}
        else:
            args = {r: (local_of(r)[sorted(set(x))],) for r, x in zip(RANKS, per_rank)}
        common = () if method == "apply_update" else (step,)
        got = pool.call(method, args, *common)
        for r in RANKS:
            want = getattr(alone[r], method)(*args[r], *common)
            have = got[r]
            for name in ("rank", "expert", "page", "slot", "src", "dst", "nbytes", "reason"):
                assert np.array_equal(getattr(have, name), getattr(want, name)), (method, r, name)
        if method == "access":
            pool.call_all("end_step")
            for p in alone.values():
                p.end_step()
        for r in RANKS:
            assert pool.pager_of(r).used_slots == alone[r].used_slots
    if shared:
        assert pool.classes == 1


@settings(max_examples=60, deadline=None)
@given(lists=st.lists(st.lists(st.integers(0, 70), max_size=5), min_size=4, max_size=4), order=st.permutations(RANKS))
def test_expert_lists_are_translated_for_all_gpus_at_once_as_one_by_one(lists, order):
    """The one-searchsorted translation of many GPUs' expert lists (ids they hold or not,
    empty lists, any length, GPUs in any order) gives each GPU's own translation."""
    local = np.stack([local_of(r) for r in RANKS])
    pool = PagerPool(RANKS, local, 40, CFG)
    rows = [pool.row_of[r] for r in order]
    args = [(np.array(sorted(set(x)), dtype=np.int64),) for x in lists]
    keys, local_args = pool._expert_list_keys(rows, args)
    for i, (row, a) in enumerate(zip(rows, args)):
        want = pool._to_local("access", row, a)
        assert keys[i] == b"|".join(np.ascontiguousarray(x).tobytes() for x in want)
        assert np.array_equal(local_args(i)[0], want[0]) and local_args(i)[0].dtype == want[0].dtype


def test_rows_not_in_order_and_other_arguments_take_the_gpu_by_gpu_path():
    local = np.stack([local_of(r)[::-1] for r in RANKS])  # not ascending: one searchsorted cannot serve
    assert not PagerPool(RANKS, local, 40, CFG)._sorted_rows
    pool = PagerPool(RANKS, np.stack([local_of(r) for r in RANKS]), 40, CFG)
    assert pool._expert_list_keys([0], [(np.array([3]), 7)]) is None
    assert pool._expert_list_keys([0], [(np.array([[3]]),)]) is None


def test_a_concatenation_of_concatenations_keeps_every_row():
    """The step's end concatenates the heat update's moves with M17's compaction, and the
    simulator concatenates that with the sync's moves: nothing nested may be lost."""
    from testbed.policy.pager_pool import MovesByRank, PagerPool
    from testbed.scenario.sections import PagerConfig

    pool = PagerPool([0, 1], np.array([[0, 1], [2, 3]]), 20, PagerConfig(page_size_bytes=10, gpu_budget_bytes=20))
    a = pool.call("access", {0: ([1],)}, 0)
    b = pool.call("access", {1: ([3],)}, 0)
    c = pool.call("access", {0: ([0],), 1: ([2],)}, 1)
    assert not any(m.empty for m in (a, b, c))
    inner = MovesByRank.concat([a, b])
    outer = MovesByRank.concat([MovesByRank(), inner, c])
    rows = lambda m: sum(len(moves) * len(ranks) for ranks, moves in m.groups())  # noqa: E731
    assert not outer.empty and rows(outer) == rows(a) + rows(b) + rows(c) > 0
    assert len(outer.get(0)) == len(a.get(0)) + len(c.get(0))
    assert MovesByRank.concat([MovesByRank(), MovesByRank()]).empty
