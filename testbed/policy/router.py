"""The token router (M1-M3), in torch so that the real backend trains it.

Tensor suffixes: T tokens, H hidden size, E experts, K top-k slots.

Training (M1): logits = x W^T + b; Gumbel noise is added and the result divided by the
temperature of the step (linear schedule from ``temperature_start`` to
``temperature_end``); softmax; top-k; the k probabilities renormalised to sum to 1.
Inference: plain top-k on the logits, softmax over the chosen k.
Capacity (M2): each expert keeps at most ``capacity`` of this rank's slots; the drop
policy picks the kept ones by router probability (highest first) or by position
(earliest token first). Aux loss (M3, Switch form): alpha * E * sum_i f_i P_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from testbed.scenario.sections import RouterConfig


@dataclass
class Routing:
    """The router's decision for T tokens."""

    experts_TK: torch.Tensor  # int64 expert of each slot
    probs_TK: torch.Tensor  # renormalised probability of each slot (differentiable)
    keep_TK: torch.Tensor  # bool: the slot survived capacity
    aux_loss: torch.Tensor  # scalar, already multiplied by aux_loss_coef
    routed_E: torch.Tensor  # int64 slots routed per expert (before capacity)
    kept_E: torch.Tensor  # int64 slots kept per expert


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
          training: bool = True, local_bias_E: torch.Tensor | None = None) -> Routing:
    """Route ``x_TH``. ``noise`` seeds the Gumbel noise (required when training with noise).
    ``local_bias_E``: M22's local-first bias, added to the logits (``router.local_bias``
    on this rank's local experts, 0 elsewhere; not learnt)."""
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
        probs_TE = torch.softmax(logits_TE / temperature(cfg, step), dim=-1)
        top_p, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
        probs_TK = top_p / top_p.sum(-1, keepdim=True)
    else:
        top_logits, experts_TK = torch.topk(logits_TE, top_k, dim=-1)
        probs_TK = torch.softmax(top_logits, dim=-1)
        probs_TE = torch.softmax(logits_TE, dim=-1)
    routed_E = _count(experts_TK, None, num_experts)
    # M3: f_i = fraction of (token, slot) pairs on expert i, P_i = mean probability of expert i
    f_E = routed_E.float() / experts_TK.numel()
    aux = cfg.aux_loss_coef * num_experts * (f_E * probs_TE.mean(0)).sum()
    keep_TK = capacity_mask(experts_TK, probs_TK.detach(), capacity, cfg.drop_policy, num_experts)
    kept_E = _count(experts_TK, keep_TK, num_experts)
    return Routing(experts_TK, probs_TK, keep_TK, aux, routed_E, kept_E)


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
