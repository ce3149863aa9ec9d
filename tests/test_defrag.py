"""M17 defragmentation of a GPU's page pool: triggered by fragmentation or a period, it
compacts the resident pages (each expert's in consecutive slots, in page order) without
losing any, and costs copy-stream time in the simulator and a measured device copy on
real ranks; both backends make the same moves."""

import numpy as np
import pytest

from testbed.policy.page_moves import DEFRAG, GPU
from testbed.policy.pager import RankPager
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.sections import PagerConfig


def scattered_pager():
    """5 experts of 3 pages, room for 9: accesses in this order scatter expert 8."""
    cfg = PagerConfig(page_size_bytes=16, gpu_budget_bytes=16 * 9, prefetch_pages=1, cold_consecutive_updates=1)
    p = RankPager(0, [3, 5, 8, 13, 21], 40, cfg)
    for step, experts in enumerate(([21], [3], [13, 8])):
        p.access(experts, step)
        p.end_step()
    return p


def test_compaction_puts_each_experts_pages_in_consecutive_slots():
    p = scattered_pager()
    assert p.fragmentation > 0
    before = {int(e): p.location[p.pages_of(e)].copy() for e in p.experts}
    dirty = p.dirty.copy()
    moves = p.defragment()
    p.check_invariants()
    assert p.fragmentation == 0.0
    assert len(moves) and (moves.reason == DEFRAG).all() and (moves.src == GPU).all() and (moves.dst == GPU).all()
    assert (moves.nbytes == 0).all()  # nothing crosses a link
    assert np.array_equal(p.dirty, dirty)
    for e, loc in before.items():
        assert np.array_equal(p.location[p.pages_of(e)], loc)  # every page where it was, GPU or host
    on_gpu = np.flatnonzero(p.location == GPU)
    assert sorted(p.slot[on_gpu].tolist()) == list(range(len(on_gpu)))  # packed from slot 0
    assert len(p.defragment()) == 0  # compact already: nothing moves


def drifting(repo_root, tmp_path, steps=40, **pager):
    """configs/heat-drift.toml: cold migration, wake-ups and prefetches every few steps
    leave experts partly resident and the pool scattered."""
    s = load_scenario(repo_root / "configs" / "heat-drift.toml")
    return s.replace(pager=pager, run={"steps": steps, "output_dir": str(tmp_path)})


@pytest.mark.slow
def test_both_backends_compact_alike_and_keep_the_weights(repo_root, tmp_path):
    s = drifting(repo_root, tmp_path, steps=16, defrag_interval=1).replace(real={"check_weights": True})
    real = run_scenario(s, "real")  # every rank checks its pages against an unpaged copy each step
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    defrags = (real["moves_by_reason"] or {}).get("defrag", 0)
    assert defrags > 0
    assert defrags == (replay["moves_by_reason"] or {}).get("defrag", 0)
    assert real["bytes_by_level"] == replay["bytes_by_level"]


@pytest.mark.slow
def test_the_threshold_triggers_only_above_it_and_compaction_costs_copy_time(repo_root, tmp_path):
    never = run_scenario(drifting(repo_root, tmp_path), "sim")
    always = run_scenario(drifting(repo_root, tmp_path, defrag_interval=1), "sim")
    above = run_scenario(drifting(repo_root, tmp_path, defrag_threshold=0.2), "sim")
    lax = run_scenario(drifting(repo_root, tmp_path, defrag_threshold=1.0), "sim")
    count = lambda r: (r["moves_by_reason"] or {}).get("defrag", 0)  # noqa: E731
    assert count(never) == count(lax) == 0  # no pool is more than 100% fragmented
    assert 0 < count(above) < count(always)
    assert always["stage_time_s"]["paging"] > never["stage_time_s"]["paging"]


def test_after_compaction_an_expert_is_read_in_place():
    """Pages in consecutive pool slots are one piece: the store hands them to compute as a
    view of the pool (no copy); scattered pages are copied."""
    import torch

    from real.paging.paged_store import PagedExpertStore

    p = scattered_pager()
    store = PagedExpertStore(p, 10, torch.float32, torch.device("cpu"),
                             lambda i: torch.arange(10, dtype=torch.float32) + 100 * i)
    scattered = [int(e) for e in p.experts
                 if (p.location[p.pages_of(e)] == GPU).all() and not (np.diff(p.slot[p.pages_of(e)]) == 1).all()]
    assert scattered and all(store.view(e) is None for e in scattered)
    store.execute(p.defragment())
    for e in scattered:
        v = store.view(e)
        assert v is not None and v.untyped_storage().data_ptr() == store.pool.untyped_storage().data_ptr()
        assert torch.equal(v, torch.arange(10, dtype=torch.float32) + 100 * e)
