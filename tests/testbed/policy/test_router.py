"""The router (M1-M3) and capacity (M2)."""

import numpy as np
import pytest
import torch

from testbed.policy.capacity import expert_capacity, kept_counts
from testbed.policy.router import capacity_mask, init_router_params, route, temperature
from testbed.scenario.sections import RouterConfig


def test_capacity_formula():
    assert expert_capacity(256, 2, 8, 1.25) == 80  # ceil(256*2/8*1.25)
    assert expert_capacity(10, 1, 64, 1.0) == 1  # at least one slot
    assert expert_capacity(256, 2, 8, 1.25, ep_size=3, pad_to_ep=True) == 81
    assert expert_capacity(256, 2, 8, 0) is None  # dropless
    assert kept_counts(np.array([[5, 90]]), 80).tolist() == [[5, 80]]


def test_temperature_schedule():
    cfg = RouterConfig(temperature_start=1.2, temperature_end=0.8, temperature_steps=100)
    assert temperature(cfg, 0) == pytest.approx(1.2)
    assert temperature(cfg, 50) == pytest.approx(1.0)
    assert temperature(cfg, 500) == pytest.approx(0.8)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_mask_keeps_exactly_min_of_routed_and_capacity(policy):
    g = torch.Generator().manual_seed(1)
    experts = torch.randint(0, 4, (50, 2), generator=g)
    probs = torch.rand(50, 2, generator=g)
    keep = capacity_mask(experts, probs, 7, policy, 4)
    routed = torch.bincount(experts.reshape(-1), minlength=4)
    kept = torch.bincount(experts[keep], minlength=4)
    assert kept.tolist() == torch.clamp(routed, max=7).tolist()


def test_probs_policy_keeps_the_most_probable_and_position_the_earliest():
    experts = torch.tensor([[0], [0], [0], [0]])
    probs = torch.tensor([[0.1], [0.9], [0.5], [0.7]])
    assert capacity_mask(experts, probs, 2, "probs", 1).reshape(-1).tolist() == [False, True, False, True]
    assert capacity_mask(experts, probs, 2, "position", 1).reshape(-1).tolist() == [True, True, False, False]


def test_route_renormalises_top_k_and_computes_switch_aux_loss():
    cfg = RouterConfig(noise="none", aux_loss_coef=0.01)
    w, b = init_router_params(16, 8, cfg, torch.Generator().manual_seed(0))
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    r = route(x, w, b, cfg, top_k=2, capacity=None, step=0, noise=None)
    assert torch.allclose(r.probs_TK.sum(-1), torch.ones(64))
    probs_TE = torch.softmax((x @ w.t() + b) / temperature(cfg, 0), -1)
    f = torch.bincount(r.experts_TK.reshape(-1), minlength=8).float() / 128
    assert r.aux_loss.item() == pytest.approx(0.01 * 8 * float((f * probs_TE.mean(0)).sum()), rel=1e-5)
    assert r.routed_E.sum() == 128 and torch.equal(r.routed_E, r.kept_E)


def test_gumbel_noise_is_seeded():
    cfg = RouterConfig()
    w, b = init_router_params(16, 8, cfg, torch.Generator().manual_seed(0))
    x = torch.randn(64, 16)
    a = route(x, w, b, cfg, 2, None, 0, torch.Generator().manual_seed(5))
    c = route(x, w, b, cfg, 2, None, 0, torch.Generator().manual_seed(5))
    d = route(x, w, b, cfg, 2, None, 0, torch.Generator().manual_seed(6))
    assert torch.equal(a.experts_TK, c.experts_TK) and not torch.equal(a.experts_TK, d.experts_TK)
