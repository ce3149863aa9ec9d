"""M14 page pipelining on the real backend: an expert's FFN computed page by page
(``real.kernels.page_pipeline.blocked_ffn``) is the unblocked FFN, whatever the page size, rows
split across pages included; a training run with ``pager.pipeline_pages`` computes what
the single-process reference computes."""

import pytest
import torch
import torch.nn.functional as F

from real.backend import RealBackend
from real.kernels.page_pipeline import blocked_ffn
from real.rank.reference import reference_step
from testbed.scenario.scenario import Scenario


@pytest.mark.parametrize("page", [7, 48, 100, 333, 48 * 20, 10**6])
def test_page_by_page_is_the_whole_ffn(page):
    """H = 20, F = 48: pages of 7 elements split rows of both matrices, 48 end on w1's
    rows, 333 straddles the w1 / w2 boundary, 10**6 is one page."""
    g = torch.Generator().manual_seed(0)
    h, f = 20, 48
    x = torch.randn(13, h, generator=g, dtype=torch.float64)
    flat = torch.randn(2 * h * f, generator=g, dtype=torch.float64)
    w1, w2 = flat[:h * f].view(h, f), flat[h * f:].view(f, h)
    segments = [(s, flat[s:s + page]) for s in range(0, flat.numel(), page)]
    y, a = blocked_ffn(x, segments, h, f)
    torch.testing.assert_close(a, x @ w1)
    torch.testing.assert_close(y, F.gelu(x @ w1) @ w2)


def test_segments_that_stop_short_are_an_error():
    flat = torch.zeros(2 * 4 * 6)
    with pytest.raises(ValueError, match="do not end"):
        blocked_ffn(torch.zeros(2, 4), [(0, flat[:45])], 4, 6)


@pytest.mark.slow
def test_a_run_with_pipelined_pages_matches_the_reference(tmp_path, float_bound):
    """Pages of 1,000 elements (rows of 48 split across pages), every expert read page by
    page (on CPU nothing is in flight: the blocks are forced), outputs and gradients as
    the reference's."""
    s = Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": 4000, "gpu_budget_bytes": 40000, "pipeline_pages": True},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)},
    })
    result = RealBackend().run(s, debug={"capture": True, "blocked_pages": True})
    ref = reference_step(s)
    n = float_bound.chain(s)
    for rank, cap in enumerate(result.captured):
        float_bound.assert_close(cap["output"], ref["outputs"][rank], n)
        for inst, grad in cap["expert_grads"].items():
            float_bound.assert_close(grad, ref["expert_grads"][inst], n)
    assert all(cap["blocked_experts"] > 0 for cap in result.captured)
