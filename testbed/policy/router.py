"""The token router (M1-M3), in torch so that the real backend trains it.

Tensor suffixes: T tokens, H hidden size, E experts, K top-k slots.

Training (M1): logits = x W^T + b; Gumbel noise is added and the result divided by the
temperature of the step (linear schedule from ``temperature_start`` to
``temperature_end``); the gate scores of that (softmax, or sigmoid with ``router.score``);
the top-k experts - inside the token's groups with group-limited routing, by the scores
plus the balancing bias with auxiliary-loss-free balancing - and their gating weights
(the k scores renormalised to sum to 1, times ``router.routed_scaling_factor``):
``testbed.policy.expert_choice``. Inference: the same without noise, at temperature 1.
Capacity (M2): each expert keeps at most ``capacity`` of this rank's slots; the drop
policy picks the kept ones by gating weight (highest first) or by position (earliest
token first). Balance losses (``testbed.policy.balance_losses``): M3's Switch aux loss,
alpha E sum_i f_i P_i, and DeepSeek-V3's sequence-wise loss (``router.seq_aux_loss_coef``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testbed.policy.balance_losses import sequence_balance_loss, switch_aux_loss
from testbed.policy.expert_choice import choose_experts, gate_scores, gating_weights
from testbed.scenario.sections import RouterConfig


@dataclass
class Routing:
    """The router's decision for T tokens."""

    experts_TK: torch.Tensor  # int64 expert of each slot
    probs_TK: torch.Tensor  # gating weight of each slot (differentiable; expert_choice.gating_weights)
    keep_TK: torch.Tensor  # bool: the slot survived capacity
    aux_loss: torch.Tensor  # scalar: both balance losses, each already multiplied by its coefficient
    routed_E: torch.Tensor  # int64 slots routed per expert (before capacity)
    kept_E: torch.Tensor  # int64 slots kept per expert
    seq_aux_loss: torch.Tensor  # scalar: the sequence-wise part of aux_loss (0 when off)


def temperature(cfg: RouterConfig, step: int) -> float:
    """Softmax temperature of ``step`` under the linear schedule of M1."""
    frac = min(1.0, step / cfg.temperature_steps)
    return cfg.temperature_start + frac * (cfg.temperature_end - cfg.temperature_start)


def init_router_params(hidden: int, experts: int, cfg: RouterConfig, generator: torch.Generator):
    """(weight [E, H], bias [E]) in fp32: weight ~ N(0, weight_std), bias ~ N(0, bias_std)."""
    w = torch.randn(experts, hidden, generator=generator) * cfg.weight_std
    b = torch.randn(experts, generator=generator) * cfg.bias_std
    return w, b


def route(x_TH: torch.Tensor, weight_EH: torch.Tensor, bias_E: torch.Tensor, cfg: RouterConfig,
          top_k: int, capacity: int | None, step: int, noise: torch.Generator | None,
          training: bool = True, local_bias_E: torch.Tensor | None = None,
          balance_bias_E: torch.Tensor | None = None, sequence_tokens: int | None = None) -> Routing:
    """Route ``x_TH``. ``noise`` seeds the Gumbel noise (required when training with noise).
    ``local_bias_E``: M22's local-first bias, added to the logits (``router.local_bias``
    on this rank's local experts, 0 elsewhere; not learnt). ``balance_bias_E``: the
    auxiliary-loss-free balancing bias of this rank's EP group (``BiasBalance``), added
    to the scores for the choice only (None: off). ``sequence_tokens``: tokens per
    sequence of the sequence-wise loss (default: all of ``x_TH``)."""
    num_experts = weight_EH.shape[0]
    logits_TE = x_TH.float() @ weight_EH.t() + bias_E
    if local_bias_E is not None:
        logits_TE = logits_TE + local_bias_E
    if training:
        if cfg.noise == "gumbel":
            # drawn where the generator lives: the rank's device, so that the hot path does not
            # wait for a host-to-device copy (a CPU and a CUDA generator of one seed differ)
            u = torch.rand(logits_TE.shape, generator=noise, device=noise.device)
            u = u.clamp(1e-9, 1 - 1e-9)
            logits_TE = logits_TE - torch.log(-torch.log(u))
        logits_TE = logits_TE / temperature(cfg, step)
    scores_TE = gate_scores(logits_TE, cfg.score)
    experts_TK = choose_experts(scores_TE, top_k, cfg, balance_bias_E)
    probs_TK = gating_weights(scores_TE, experts_TK, cfg)
    routed_E = _count(experts_TK, None, num_experts)
    aux = switch_aux_loss(scores_TE, routed_E, experts_TK.numel(), cfg.aux_loss_coef, cfg.score)
    seq_aux = torch.zeros((), device=aux.device)
    if cfg.seq_aux_loss_coef > 0:
        seq_aux = sequence_balance_loss(scores_TE, top_k, cfg.seq_aux_loss_coef, sequence_tokens or x_TH.shape[0])
        aux = aux + seq_aux
    keep_TK = capacity_mask(experts_TK, probs_TK.detach(), capacity, cfg.drop_policy, num_experts)
    kept_E = _count(experts_TK, keep_TK, num_experts)
    return Routing(experts_TK, probs_TK, keep_TK, aux, routed_E, kept_E, seq_aux)


def _count(experts_TK: torch.Tensor, keep_TK: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """int64 [E] slots per expert (those of ``keep_TK`` only, if given), without reading
    anything back from the device (``bincount`` and boolean masks size their output from
    the data, which on CUDA waits for it)."""
    flat = experts_TK.reshape(-1)
    ones = torch.ones_like(flat) if keep_TK is None else keep_TK.reshape(-1).to(flat.dtype)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, ones)


def capacity_mask(experts_TK: torch.Tensor, probs_TK: torch.Tensor, capacity: int | None,
                  policy: str, num_experts: int) -> torch.Tensor:
    """bool [T, K]: slots kept when every expert takes at most ``capacity`` of them (M2).

    ``probs``: an expert keeps its highest-probability slots (ties: earlier slot first);
    ``position``: its earliest slots in (token, slot) order. None keeps everything.
    """
    if capacity is None:
        return torch.ones_like(experts_TK, dtype=torch.bool)
    flat_e = experts_TK.reshape(-1)
    n = flat_e.numel()
    if policy == "probs":
        order = torch.argsort(-probs_TK.reshape(-1), stable=True)
    else:
        order = torch.arange(n, device=flat_e.device)
    order = order[torch.argsort(flat_e[order], stable=True)]  # grouped by expert, policy order inside
    sorted_e = flat_e[order]
    first = torch.searchsorted(sorted_e, torch.arange(num_experts, device=flat_e.device))
    rank_in_expert = torch.arange(n, device=flat_e.device) - first[sorted_e]
    keep = torch.zeros(n, dtype=torch.bool, device=flat_e.device)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(experts_TK)
