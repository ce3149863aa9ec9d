"""The two expert kernels compute the same thing: the grouped GEMM (``torch._grouped_mm``,
forward and backward, groups padded to aligned rows) and the per-expert loop. On CUDA
the grouped one runs in bf16; torch's CPU fallback lets its plumbing be checked here."""

import pytest
import torch

from real.kernels.experts import ExpertTimer, FlatWeights, PagedExpertFFN, expert_ffn, grouped_supported

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
def test_grouped_matches_the_loop(counts, float_bound):
    y0, dx0, g0, t0 = run(counts, grouped=False)
    y1, dx1, g1, t1 = run(counts, grouped=True)
    n = H + F  # a row's H-long and F-long dot products; a weight gradient sums its rows too
    float_bound.assert_close(y1, y0, n)
    float_bound.assert_close(dx1, dx0, n)
    assert g1.keys() == g0.keys() == {10 + i for i, n in enumerate(counts) if n}
    for inst in g0:
        float_bound.assert_close(g1[inst], g0[inst], n * max(counts))
    for timed in (t0, t1):  # measured compute heat (M18): every expert that ran
        assert set(timed) == set(g0) and all(s > 0 for s in timed.values())


def test_expert_ffn_without_autograd(float_bound):
    counts = [3, 0, 18]
    flats = [torch.randn(2 * H * F) for _ in counts]
    x = torch.randn(sum(counts), H)
    float_bound.assert_close(expert_ffn(x, counts, flats, H, F, grouped=True),
                             expert_ffn(x, counts, flats, H, F, grouped=False), H + F)


def test_grouped_only_where_it_is_fast():
    assert not grouped_supported(torch.device("cpu"), torch.bfloat16, 64, 128)
    assert not grouped_supported(torch.device("cuda", 0), torch.float32, 64, 128)
    assert not grouped_supported(torch.device("cuda", 0), torch.bfloat16, 60, 128)


@pytest.mark.parametrize("capability, grouped", [((9, 0), True), ((10, 0), True), ((8, 0), False),
                                                 ((8, 9), False), ((12, 0), False)])
def test_grouped_only_on_the_gpus_torch_runs_it_as_one_kernel(monkeypatch, capability, grouped):
    """torch._grouped_mm is one kernel on sm90 and sm100 only (real.kernels.experts.GROUPED_MM_MAJORS);
    an A100, an L40 or an RTX 5090 takes the per-expert loop."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    assert grouped_supported(torch.device("cuda", 0), torch.bfloat16, 64, 128) == grouped
    assert asked == [torch.device("cuda", 0)]
    assert not grouped_supported(torch.device("cpu"), torch.bfloat16, 64, 128) and len(asked) == 1  # CPU: never asked
