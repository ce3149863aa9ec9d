"""The grouped expert GEMM reads its weights in place where the pages lie so, and with
M14 page pipelining contracts block by block as the pages arrive:

- ``row_blocks`` cuts a matrix where pages complete rows, on aligned rows;
- the block-by-block grouped FFN is the whole grouped FFN, whatever the page size;
- after M17's compaction the experts' pages are one strided tensor: no weight is copied
  to compute on them; scattered pages are staged and counted;
- a distributed run on the grouped kernel (torch's CPU fallback), pipelined or not,
  computes what the single-process reference computes.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from real.backend import RealBackend
from real.kernels.experts import GroupLayout, grouped_forward, split_stacked
from real.kernels.page_pipeline import BLOCK_ALIGN_ROWS, grouped_blocked, row_blocks
from real.kernels.stacked_weights import strided_rows
from real.paging.paged_store import PagedExpertStore
from real.rank.reference import reference_step
from testbed.policy.heat import COLD
from testbed.policy.pager import RankPager
from testbed.scenario.scenario import Scenario
from testbed.scenario.sections import PagerConfig

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")

H, FF = 32, 48  # hidden, ffn


@pytest.mark.parametrize("page", [7, 48 * 16, 1000, 48 * 32 + 5, 10**6])
def test_row_blocks_end_where_pages_complete_rows(page):
    for base, rows, width in ((0, H, FF), (H * FF, FF, H)):
        blocks = row_blocks(base, rows, width, page)
        assert blocks[0][0] == 0 and blocks[-1][1] == rows
        assert all(r0 < r1 for r0, r1 in blocks) and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        for r0, r1 in blocks[:-1]:
            assert r1 % BLOCK_ALIGN_ROWS == 0
            # the page holding the block's last element arrives: it completes the block's rows
            last_page = (base + r1 * width - 1) // page
            assert ((last_page + 1) * page - base) // width >= r1
    assert row_blocks(0, H, FF, 10**6) == [(0, H)]  # one page: one block


@pytest.mark.parametrize("page", [7, 48 * 16, 1000, 10**6])
def test_block_by_block_grouped_ffn_is_the_whole_one(page, float_bound):
    g = torch.Generator().manual_seed(1)
    counts = [5, 0, 21, 16]
    w = torch.randn(len(counts), 2 * H * FF, generator=g) / 4
    x = torch.randn(sum(counts), H, generator=g)
    layout = GroupLayout(counts, x.device)
    asked = []
    w1, w2 = split_stacked(w, H, FF)
    y, a = grouped_blocked(layout.pad(x), w1, w2, layout.offs, page, asked.append)
    y0, _, a0 = grouped_forward(x, w, layout, H, FF)
    n = H + FF  # fp32 sums in another order: a row's H-long and F-long dot products
    float_bound.assert_close(layout.unpad(y), y0, n)
    float_bound.assert_close(a, a0, n)
    assert asked == sorted(asked) and asked[-1] == 2 * H * FF  # every element waited for, in order
    for k, n in enumerate(counts):  # and the loop's numbers
        rows = x[sum(counts[:k]):sum(counts[:k + 1])]
        float_bound.assert_close(layout.unpad(y)[sum(counts[:k]):sum(counts[:k]) + n],
                                 F.gelu(rows @ w1[k]) @ w2[k], H + FF)


def test_strided_rows_views_evenly_spaced_rows_only():
    base = torch.arange(100.0)
    v = strided_rows(base, [10, 30, 50], 15)
    assert v.shape == (3, 15) and v.data_ptr() == base[10:].data_ptr()
    assert torch.equal(v[2], base[50:65])
    assert strided_rows(base, [10, 30, 45], 15) is None  # uneven
    assert strided_rows(base, [10, 20], 15) is None  # overlapping
    assert strided_rows(base, [80, 90], 15) is None  # past the end


def paged(budget_pages=40):
    elems = 2 * H * FF  # 3072 fp32 elements: pages of 4,000 bytes hold 1,000 (4 pages, the last short)
    cfg = PagerConfig(page_size_bytes=4000, gpu_budget_bytes=4000 * budget_pages, prefetch_pages=1,
                      cold_consecutive_updates=1)
    experts = [0, 1, 2, 3, 4]
    pager = RankPager(0, experts, elems * 4, cfg)
    init = lambda i: torch.arange(elems, dtype=torch.float32) / elems + i  # noqa: E731
    return pager, PagedExpertStore(pager, elems, torch.float32, torch.device("cpu"), init), init


def test_after_compaction_the_grouped_gemm_reads_the_pool_in_place():
    pager, store, init = paged()
    store.execute(pager.heat_update(np.ones(5, bool), np.full(5, COLD), np.zeros(5, bool), 0))  # all to host
    store.execute(pager.access([4, 2, 0, 3, 1], 1))  # back in that order: slots out of expert order
    pager.end_step()
    counts = [3, 0, 5, 0, 2]
    scattered = store.stacked([0, 1, 2, 3, 4], counts, pipelined=False)
    assert scattered.copied_bytes == 3 * 2 * H * FF * 4  # the three experts with rows, staged
    store.execute(pager.defragment())
    inplace = store.stacked([0, 1, 2, 3, 4], counts, pipelined=False)
    assert inplace.copied_bytes == 0 and inplace.w_GX.data_ptr() == store.pool.data_ptr()
    assert [i for i, _ in inplace.members] == [0, 1, 2, 3, 4]  # zero-row experts keep the stride
    for (i, _), row in zip(inplace.members, inplace.w_GX):
        assert torch.equal(row, init(i))
    piped = store.stacked([0, 1, 2, 3, 4], counts, pipelined=True)
    assert piped.pipelined and piped.copied_bytes == 0
    before = store.page_reads.copy()
    piped.ready(1500)  # the first two page indices of the experts with rows
    assert (store.page_reads - before).sum() == 2 * 3


def scenario(tmp_path, **pager):
    return Scenario.from_dict({
        "model": {"hidden_size": H, "ffn_hidden_size": FF, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": 4000, "gpu_budget_bytes": 80000, **pager},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)},
    })


@pytest.mark.parametrize("pager", [{"enabled": False}, {"pipeline_pages": True}, {"defrag_interval": 1},
                                   {"gpu_budget_bytes": 40000, "pipeline_pages": True}])
@pytest.mark.slow
def test_a_run_on_the_grouped_kernel_matches_the_reference(tmp_path, pager, float_bound):
    """Unpaged (rows of one tensor), paged and pipelined block by block (forced: on CPU
    nothing is in flight), paged with compaction, paged into too few slots; outputs and
    gradients as the reference's, and weights copied to be computed on only where the
    pages are scattered."""
    s = scenario(tmp_path, **pager)
    debug = {"capture": True, "grouped_kernel": True, "blocked_pages": bool(pager.get("pipeline_pages"))}
    result = RealBackend().run(s, debug=debug)
    ref = reference_step(s)
    n = float_bound.chain(s)
    for rank, cap in enumerate(result.captured):
        float_bound.assert_close(cap["output"], ref["outputs"][rank], n)
        for inst, grad in cap["expert_grads"].items():
            float_bound.assert_close(grad, ref["expert_grads"][inst], n)
    if pager.get("pipeline_pages"):
        assert all(cap["blocked_experts"] > 0 for cap in result.captured)
    # every expert fits, in expert order: the weights are read in place, forward and backward;
    # 10 slots for 16 pages: some experts are scattered or partly on the host, and staged
    tight = pager.get("gpu_budget_bytes") == 40000
    assert all((cap["weight_copy_bytes"] > 0) == tight for cap in result.captured)
