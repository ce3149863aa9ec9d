"""SwiGLU experts (``model.ffn_activation = "swiglu"``, ``real.kernels.ffn_activation``): the
gate and up matrices side by side in w1 [H, 2F], the down matrix w2 [F, H]. Every path an
expert's FFN takes computes (silu(x W_gate) * x W_up) W_down: the per-expert loop and the
grouped GEMM (forward and backward), page by page as the pages arrive (M14's
``blocked_ffn``, rows split across pages and the gate / up / down boundaries included) and
the grouped GEMM block by block; the activation's hand-written backward is autograd's."""

import pytest
import torch
import torch.nn.functional as F

from real.kernels.experts import FlatWeights, GroupLayout, PagedExpertFFN, grouped_forward, split_stacked
from real.kernels.ffn_activation import activation, activation_backward, input_width, split_ffn
from real.kernels.page_pipeline import blocked_ffn, grouped_blocked

H, FF = 16, 24  # hidden, ffn


def by_formula(x, flat):
    """(silu(x W_gate) * (x W_up)) W_down from the flat weights' three matrices (float64)."""
    w1, w2 = flat[:H * 2 * FF].view(H, 2 * FF), flat[H * 2 * FF:].view(FF, H)
    gate, up = x @ w1[:, :FF], x @ w1[:, FF:]
    return (gate * torch.sigmoid(gate) * up) @ w2


def test_swiglu_flat_weights_hold_three_matrices():
    assert input_width(FF, True) == 2 * FF and input_width(FF, False) == FF
    flat = torch.arange(3 * H * FF, dtype=torch.float32)
    w1, w2 = split_ffn(flat, H, FF, swiglu=True)
    assert w1.shape == (H, 2 * FF) and w2.shape == (FF, H) and w1.numel() + w2.numel() == 3 * H * FF
    assert float(w2[0, 0]) == 2 * H * FF  # the down matrix starts after the gate and up's columns


def test_activation_backward_is_autograds():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 2 * FF, generator=g, dtype=torch.float64, requires_grad=True)
    dh = torch.randn(7, FF, generator=g, dtype=torch.float64)
    activation(a, True).backward(dh)
    torch.testing.assert_close(activation_backward(dh, a.detach(), True), a.grad)
    gate, up = a.detach().chunk(2, dim=-1)
    torch.testing.assert_close(activation(a.detach(), True), F.silu(gate) * up)


def run(counts, grouped, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = {10 + i: torch.randn(3 * H * FF, generator=g) / 4 for i in range(len(counts))}
    x = torch.randn(sum(counts), H, generator=g, requires_grad=True)
    dy = torch.randn(sum(counts), H, generator=g)
    grads = {}
    y = PagedExpertFFN.apply(x, FlatWeights(weights), list(weights), counts, H, FF, grads, None, grouped, True)
    y.backward(dy)
    return weights, x, dy, y.detach(), x.grad, grads


@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm"))])
@pytest.mark.parametrize("counts", [[16, 32, 0, 16], [5, 0, 17, 3]])
def test_swiglu_experts_forward_and_backward_are_the_formulas(counts, grouped, float_bound):
    """Outputs, input and weight gradients of both kernels against the formula through
    autograd in float64 (rounded to float32)."""
    weights, x, dy, y, dx, grads = run(counts, grouped)
    x64 = x.detach().double().requires_grad_()
    flats = {i: w.double().requires_grad_() for i, w in weights.items()}
    rows, start = [], 0
    for (inst, flat), n in zip(flats.items(), counts):
        rows.append(by_formula(x64[start:start + n], flat))
        start += n
    want = torch.cat(rows)
    want.backward(dy.double())
    n = H + 2 * FF  # a row's H-long and F-long dot products
    float_bound.assert_close(y, want.detach().float(), n)
    float_bound.assert_close(dx, x64.grad.float(), n)
    assert set(grads) == {10 + i for i, c in enumerate(counts) if c}
    for inst in grads:
        float_bound.assert_close(grads[inst], flats[inst].grad.float(), n * max(counts))


@pytest.mark.parametrize("page", [7, 2 * FF, 100, H * 2 * FF - 5, H * 2 * FF + 7, 10**6])
def test_swiglu_page_by_page_is_the_whole_ffn(page):
    """Pages of 7 split rows everywhere, 2F end on w1's rows, H 2F - 5 straddles w1's end,
    H 2F + 7 ends inside w2, 10**6 is one page."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, H, generator=g, dtype=torch.float64)
    flat = torch.randn(3 * H * FF, generator=g, dtype=torch.float64)
    segments = [(s, flat[s:s + page]) for s in range(0, flat.numel(), page)]
    y, a = blocked_ffn(x, segments, H, FF, swiglu=True)
    torch.testing.assert_close(a, x @ flat[:H * 2 * FF].view(H, 2 * FF))
    torch.testing.assert_close(y, by_formula(x, flat))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("page", [7, 2 * FF * 16, 1000, 10**6])
def test_swiglu_grouped_block_by_block_is_the_whole_grouped_ffn(page, float_bound):
    g = torch.Generator().manual_seed(2)
    counts = [5, 0, 21, 16]
    w = torch.randn(len(counts), 3 * H * FF, generator=g) / 4
    x = torch.randn(sum(counts), H, generator=g)
    layout = GroupLayout(counts, x.device)
    asked = []
    w1, w2 = split_stacked(w, H, FF, swiglu=True)
    assert w1.shape == (4, H, 2 * FF) and w2.shape == (4, FF, H)
    y, a = grouped_blocked(layout.pad(x), w1, w2, layout.offs, page, asked.append, swiglu=True)
    y0, _, a0 = grouped_forward(x, w, layout, H, FF, swiglu=True)
    n = H + 2 * FF
    float_bound.assert_close(layout.unpad(y), y0, n)
    float_bound.assert_close(a, a0, n)
    assert asked == sorted(asked) and asked[-1] == 3 * H * FF  # waited for the pages in order, to the last
