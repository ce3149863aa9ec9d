"""The router features of today's MoE models against hand-worked cases: sigmoid scores,
group-limited routing (top2_sum and max), the balancing bias (choice, not weights; its
update's sign rule and rate), normalisation and scaling of the gating weights, and the
sequence-wise balance loss (DeepSeek-V3 §2.1.2, eq. 13-20)."""

import numpy as np
import pytest
import torch

from testbed.core.errors import ScenarioError
from testbed.policy.balance_losses import sequence_balance_loss, sequence_tokens, switch_aux_loss
from testbed.policy.bias_balance import BiasBalance
from testbed.policy.expert_choice import allowed_groups, choose_experts, gate_scores, gating_weights
from testbed.policy.router import init_router_params, route
from testbed.scenario.router_checks import check_router
from testbed.scenario.scenario import Scenario
from testbed.scenario.sections import RouterConfig

# one token, 6 experts in 3 groups of 2: group sums 1.0, 1.1, 0.4; group maxima 0.9, 0.6, 0.2
ROW = torch.tensor([[0.9, 0.1, 0.6, 0.5, 0.2, 0.2]])


def groups(score="top2_sum", m=1, g=3, **kw):
    return RouterConfig(expert_groups=g, groups_per_token=m, group_score=score, **kw)


def test_top2_sum_ranks_groups_by_their_two_best_and_max_by_their_best():
    assert allowed_groups(ROW, groups("top2_sum")).tolist() == [[False, True, False]]
    assert allowed_groups(ROW, groups("max")).tolist() == [[True, False, False]]
    # the top-2 experts of the token: inside the chosen group only
    assert sorted(choose_experts(ROW, 2, groups("top2_sum"))[0].tolist()) == [2, 3]
    assert sorted(choose_experts(ROW, 2, groups("max"))[0].tolist()) == [0, 1]
    assert sorted(choose_experts(ROW, 2, RouterConfig())[0].tolist()) == [0, 2]  # no groups: the best two


def test_a_token_never_leaves_its_groups():
    """Random scores: every token's k experts lie in at most M groups, and they are the k
    best of the experts of its M best groups (brute force)."""
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(500, 16, generator=g, dtype=torch.float64)
    bias = (torch.rand(16, generator=g, dtype=torch.float64) - 0.5) * 0.3
    for score in ("top2_sum", "max"):
        cfg = groups(score, m=2, g=4)
        experts = choose_experts(scores, 3, cfg, bias)
        biased = (scores + bias).tolist()
        for row, chosen in zip(biased, experts.tolist()):
            by_group = [sorted(row[4 * i:4 * i + 4], reverse=True) for i in range(4)]
            rank = [b[0] + b[1] if score == "top2_sum" else b[0] for b in by_group]
            best = sorted(range(4), key=lambda i: -rank[i])[:2]
            assert {e // 4 for e in chosen} <= set(best)
            inside = [e for i in best for e in range(4 * i, 4 * i + 4)]
            assert sorted(chosen) == sorted(sorted(inside, key=lambda e: -row[e])[:3])


def test_a_negative_biased_score_in_an_allowed_group_still_beats_the_other_groups():
    """Masked experts are -inf, not 0 (which a negative biased score would lose to)."""
    scores = torch.tensor([[0.1, 0.1, 0.9, 0.8]])
    bias = torch.tensor([-0.5, -0.5, 0.0, 0.0])  # group 0 biased to -0.4: below 0
    cfg = groups("max", m=1, g=2)
    assert allowed_groups(scores + bias, cfg).tolist() == [[False, True]]
    assert sorted(choose_experts(scores, 2, cfg, bias)[0].tolist()) == [2, 3]
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.1]])
    assert sorted(choose_experts(scores, 2, cfg, bias)[0].tolist()) == [0, 1]  # -0.4 and -0.5 kept


def test_the_bias_changes_the_choice_but_not_the_weights():
    scores = torch.tensor([[0.5, 0.4, 0.3]])
    cfg = RouterConfig()
    plain = choose_experts(scores, 2, cfg)
    assert plain.tolist() == [[0, 1]]
    assert gating_weights(scores, plain, cfg)[0].tolist() == pytest.approx([0.5 / 0.9, 0.4 / 0.9])
    biased = choose_experts(scores, 2, cfg, torch.tensor([0.0, 0.0, 0.25]))  # 0.55 now beats 0.5 and 0.4
    assert biased.tolist() == [[2, 0]]
    # the weights are the unbiased scores 0.3 and 0.5, normalised: never 0.55
    assert gating_weights(scores, biased, cfg)[0].tolist() == pytest.approx([0.3 / 0.8, 0.5 / 0.8])


def test_normalisation_and_the_routed_scaling_factor():
    scores = torch.tensor([[0.8, 0.1, 0.6]])
    chosen = torch.tensor([[0, 2]])
    assert gating_weights(scores, chosen, RouterConfig())[0].tolist() == pytest.approx([0.8 / 1.4, 0.6 / 1.4])
    raw = RouterConfig(normalize_top_k=False)
    assert gating_weights(scores, chosen, raw)[0].tolist() == pytest.approx([0.8, 0.6])
    scaled = RouterConfig(routed_scaling_factor=2.5)
    assert gating_weights(scores, chosen, scaled)[0].tolist() == pytest.approx([2.5 * 0.8 / 1.4, 2.5 * 0.6 / 1.4])


def test_sigmoid_scores_are_each_experts_own():
    z = torch.tensor([[0.0, 2.0, -1.0]])
    assert gate_scores(z, "sigmoid")[0].tolist() == pytest.approx([0.5, 1 / (1 + np.exp(-2)), 1 / (1 + np.exp(1))])
    assert gate_scores(z, "softmax").sum().item() == pytest.approx(1.0)


def test_the_bias_moves_by_the_rate_against_the_sign_of_the_load_error():
    # layer 0: the whole batch's load 5, 3, 5, 7 (mean 5); layer 1: 1, 1, 1, 5 (mean 2)
    balance = BiasBalance(0.001, layers=2, experts=4)
    load = np.array([[5, 3, 5, 7], [1, 1, 1, 5]], dtype=np.int32)
    balance.update(load)
    assert balance.bias.tolist() == [[0.0, 0.001, 0.0, -0.001], [0.001, 0.001, 0.001, -0.001]]  # at the mean: kept
    balance.update(load)
    assert balance.bias.tolist() == [[0.0, 0.002, 0.0, -0.002], [0.002, 0.002, 0.002, -0.002]]
    quiet = BiasBalance(0.001, layers=2, experts=4)
    quiet.update(np.zeros((2, 4)))  # no load at all: every expert at the mean
    assert not quiet.bias.any()


def test_sequence_wise_loss_on_a_hand_made_case():
    """E = 4, k = 1, two tokens: top-1 experts 0 and 1, f = E / (k T) x hits = (2, 2, 0, 0),
    P = mean of the normalised scores = (0.35, 0.45, 0.1, 0.1): L = alpha (2 x 0.35 + 2 x 0.45)."""
    s = torch.tensor([[0.6, 0.2, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1]])
    assert sequence_balance_loss(s, 1, 0.01, 2).item() == pytest.approx(0.01 * 1.6)
    # sigmoid-like scores that do not sum to 1 are normalised first (eq. 19): twice the scores, same loss
    assert sequence_balance_loss(2 * s, 1, 0.01, 2).item() == pytest.approx(0.01 * 1.6)
    # two sequences of one token each: f = 4 x one-hot; P = that token's scores; the mean of 2.4 and 2.8
    assert sequence_balance_loss(s, 1, 0.01, 1).item() == pytest.approx(0.01 * (4 * 0.6 + 4 * 0.7) / 2)
    # perfectly balanced in each sequence: f_i = 1, sum P_i = 1 -> alpha
    flat = torch.full((4, 4), 0.25) + torch.eye(4) * 1e-3
    assert sequence_balance_loss(flat, 1, 0.01, 4).item() == pytest.approx(0.01, rel=1e-3)


def test_switch_loss_normalises_sigmoid_scores():
    s = torch.tensor([[0.6, 0.2], [0.2, 0.6]])
    routed = torch.tensor([1, 1])
    # P = (0.5, 0.5) after normalising; f = (0.5, 0.5): E sum f P = 2 x 0.5 = 1
    assert switch_aux_loss(s, routed, 2, 0.1, "sigmoid").item() == pytest.approx(0.1)
    assert switch_aux_loss(s, routed, 2, 0.1, "softmax").item() == pytest.approx(0.1 * 2 * 0.4)  # taken as given


def test_route_with_every_feature_on():
    cfg = RouterConfig(noise="none", score="sigmoid", routed_scaling_factor=2.5, expert_groups=4,
                       groups_per_token=2, seq_aux_loss_coef=0.01, aux_loss_coef=0.0)
    w, b = init_router_params(16, 8, cfg, torch.Generator().manual_seed(0))
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    r = route(x, w, b, cfg, 3, None, 0, None, sequence_tokens=16)
    assert torch.allclose(r.probs_TK.sum(-1), torch.full((64,), 2.5))
    assert all(len(set(row)) == 2 for row in (r.experts_TK // 2).tolist())  # 3 slots need 2 groups of 2; M = 2
    scores = torch.sigmoid((x @ w.t() + b) / 1.2)  # temperature_start
    assert r.aux_loss.item() == pytest.approx(sequence_balance_loss(scores, 3, 0.01, 16).item())
    assert r.aux_loss.item() == r.seq_aux_loss.item() > 0
    bias = torch.zeros(8)
    bias[0] = 1.0  # far above every score: expert 0 in every token's choice
    biased = route(x, w, b, cfg, 3, None, 0, None, balance_bias_E=bias)
    assert (biased.experts_TK == 0).any(-1).all() and not (r.experts_TK == 0).any(-1).all()
    assert biased.routed_E[0] == 64


@pytest.mark.parametrize("router, field", [
    ({"expert_groups": 3}, "router.expert_groups"),  # 8 experts
    ({"expert_groups": 4, "groups_per_token": 0}, "router.groups_per_token"),
    ({"expert_groups": 4, "groups_per_token": 5}, "router.groups_per_token"),
    ({"groups_per_token": 2}, "router.groups_per_token"),
    ({"expert_groups": 8, "groups_per_token": 4}, "router.group_score"),  # top2_sum of one expert
])
def test_group_fields_that_do_not_fit_are_refused(router, field):
    with pytest.raises(ScenarioError, match=field):
        check_router(RouterConfig(**router), 8, 2)
    with pytest.raises(ScenarioError, match="fewer than model.top_k = 4"):
        check_router(RouterConfig(expert_groups=4, groups_per_token=1), 8, 4)
    check_router(RouterConfig(expert_groups=8, groups_per_token=4, group_score="max"), 8, 4)


def test_a_sequence_is_the_transformers_or_the_ranks_tokens():
    s = Scenario.from_dict({"workload": {"tokens_per_rank": 512}})
    assert sequence_tokens(s) == 512
    assert sequence_tokens(s.replace(transformer={"enabled": True, "seq_len": 128})) == 128
