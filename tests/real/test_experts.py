"""The two expert kernels compute the same thing: the grouped GEMM (``torch._grouped_mm``,
forward and backward, groups padded to aligned rows) and the per-expert loop. On CUDA
the grouped one runs in bf16; torch's CPU fallback lets its plumbing be checked here."""

import pytest
import torch

from real.experts import ExpertTimer, FlatWeights, PagedExpertFFN, expert_ffn, grouped_supported

H, F = 16, 24

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")


def run(counts, grouped, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = {10 + i: torch.randn(2 * H * F, generator=g) / 4 for i in range(len(counts))}
    x = torch.randn(sum(counts), H, generator=g, requires_grad=True)
    dy = torch.randn(sum(counts), H, generator=g)
    grads, timer = {}, ExpertTimer(cuda=False)

    y = PagedExpertFFN.apply(x, FlatWeights(weights), list(weights), counts, H, F, grads, timer, grouped)
    y.backward(dy)
    return y.detach(), x.grad, grads, timer.collect()


@pytest.mark.parametrize("counts", [[16, 32, 0, 16], [5, 0, 17, 3], [0, 0, 7, 0]])
def test_grouped_matches_the_loop(counts):
    y0, dx0, g0, t0 = run(counts, grouped=False)
    y1, dx1, g1, t1 = run(counts, grouped=True)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g0.keys() == {10 + i for i, n in enumerate(counts) if n}
    for inst in g0:
        torch.testing.assert_close(g1[inst], g0[inst], rtol=1e-5, atol=1e-5)
    for timed in (t0, t1):  # measured compute heat (M18): every expert that ran
        assert set(timed) == set(g0) and all(s > 0 for s in timed.values())


def test_expert_ffn_without_autograd():
    counts = [3, 0, 18]
    flats = [torch.randn(2 * H * F) for _ in counts]
    x = torch.randn(sum(counts), H)
    torch.testing.assert_close(expert_ffn(x, counts, flats, H, F, grouped=True),
                               expert_ffn(x, counts, flats, H, F, grouped=False), rtol=1e-5, atol=1e-5)


def test_grouped_only_where_it_is_fast():
    assert not grouped_supported(torch.device("cpu"), torch.bfloat16, 64, 128)
    assert not grouped_supported(torch.device("cuda", 0), torch.float32, 64, 128)
    assert not grouped_supported(torch.device("cuda", 0), torch.bfloat16, 60, 128)
