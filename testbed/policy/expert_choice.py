"""Which experts a token goes to and with what weights: gate scores, the group limit, the
biased top-k choice, and the gating weights (M1; DeepSeek-V2/V3's router features).

Tensor suffixes: T tokens (any leading dimensions), E experts, G groups, K top-k slots.

- Scores (``router.score``): ``softmax`` over the E experts (M1), or ``sigmoid`` of each
  expert's logit on its own (DeepSeek-V3 §2.1.2 eq. 15: s_i = Sigmoid(u^T e_i)).
- Group limit (``router.expert_groups`` G, ``groups_per_token`` M): the experts in G
  contiguous groups of E/G; each token ranks the groups by ``group_score`` - the sum of
  the group's two highest choice scores (``top2_sum``, DeepSeek-V3's node-limited
  routing: "the sum of the highest K_r/M affinity scores of the experts distributed on
  each node", K_r/M = 8/4 = 2; HF ``n_group`` / ``topk_group``) or its highest
  (``max``, DeepSeek-V2's device-limited routing) - and chooses its top k experts inside
  its best M groups only. The other groups' experts are masked to -inf, so no slot can
  land outside them (HF's DeepSeek-V3 code masks them to 0.0, which a negative biased
  score in an allowed group would lose to).
- Bias (auxiliary-loss-free balancing, DeepSeek-V3 §2.1.2 eq. 16): a per-expert bias
  b_i added to the scores for the choice (and the group ranking) only; "the gating
  value ... is still derived from the original affinity score s_{i,t}".
- Gating weights: the chosen experts' unbiased scores, divided by their sum when
  ``router.normalize_top_k`` (eq. 13; HF ``norm_topk_prob``), then multiplied by
  ``router.routed_scaling_factor`` (HF ``routed_scaling_factor``; DeepSeek-V3: 2.5).

With softmax scores, no groups, no bias, normalisation and a factor of 1 this is M1's
top-k with renormalised probabilities, bit for bit. One torch implementation serves the
real ranks (their hidden states' scores, on their device) and the simulator's synthetic
routing (``testbed.policy.scored_routing``, on the CPU).
"""

from __future__ import annotations

import torch

from testbed.scenario.sections import RouterConfig


def gate_scores(z_TE: torch.Tensor, score: str) -> torch.Tensor:
    """Scores [..., E] of the (noisy, tempered) logits: ``softmax`` over the last
    dimension or ``sigmoid`` elementwise."""
    return torch.softmax(z_TE, dim=-1) if score == "softmax" else torch.sigmoid(z_TE)


def allowed_groups(choice_TE: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """bool [..., G]: the ``groups_per_token`` groups each token may use, ranked by
    ``group_score`` of its choice scores (biased, if a bias is on)."""
    g = cfg.expert_groups
    grouped = choice_TE.unflatten(-1, (g, choice_TE.shape[-1] // g))  # [..., G, E/G]
    if cfg.group_score == "top2_sum":
        group_TG = grouped.topk(2, dim=-1).values.sum(-1)
    else:
        group_TG = grouped.amax(-1)
    best = group_TG.topk(cfg.groups_per_token, dim=-1).indices
    return torch.zeros_like(group_TG, dtype=torch.bool).scatter_(-1, best, True)


def choose_experts(scores_TE: torch.Tensor, top_k: int, cfg: RouterConfig,
                   bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [..., K]: each token's top-k experts by score (+ ``bias_E``, broadcast on the
    scores), inside its allowed groups when ``router.expert_groups`` is on. Not
    differentiable (a choice)."""
    choice_TE = scores_TE.detach()
    if bias_E is not None:
        choice_TE = choice_TE + bias_E.to(choice_TE.dtype)
    if cfg.expert_groups:
        allowed_TG = allowed_groups(choice_TE, cfg)
        allowed_TE = allowed_TG.repeat_interleave(choice_TE.shape[-1] // cfg.expert_groups, dim=-1)
        choice_TE = choice_TE.masked_fill(~allowed_TE, float("-inf"))
    return torch.topk(choice_TE, top_k, dim=-1).indices


def gating_weights(scores_TE: torch.Tensor, experts_TK: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """[..., K] the weights of the chosen slots' expert outputs (differentiable): their
    unbiased scores, normalised to sum to 1 (``normalize_top_k``), times
    ``routed_scaling_factor``."""
    chosen_TK = scores_TE.gather(-1, experts_TK)
    if cfg.normalize_top_k:
        chosen_TK = chosen_TK / chosen_TK.sum(-1, keepdim=True)
    if cfg.routed_scaling_factor != 1.0:
        chosen_TK = chosen_TK * cfg.routed_scaling_factor
    return chosen_TK
