"""The single-process reference: every rank's tokens through one unsharded model.

What the distributed run must reproduce within float tolerance, step after step: each
rank's layer-stack output, the loss, the summed expert and router gradients, and the
weights after each SGD step. One copy of every expert and plain autograd; no EP groups,
replicas, pages or collectives.

Routing and capacity are written here from the mechanisms' formulas
(``docs/mechanisms.md``), not with the router and capacity code the run uses, so that a
mistake there is not made twice:

- M1: logits = x W^T + b (+ M22's local-first bias on the rank's local experts), plus Gumbel noise -log(-log u) (u drawn from the run's
  per-(step, layer, rank) generator on the ranks' device, clamped to [1e-9, 1 - 1e-9]); divided by the
  temperature t(step) = start + min(1, step / steps) (end - start); scores s = softmax of that, or
  sigmoid of each (``router.score``, DeepSeek-V3 eq. 15).
- The choice, token by token: the biased scores s_i + b_i (b: the balancing bias, one for every
  rank, DeepSeek-V3 eq. 16; 0 without it); with groups, the token's M best groups of E/G contiguous
  experts by the sum of their two highest biased scores (``top2_sum``) or their highest
  (``max``); its k experts of highest biased score among those groups' experts.
- Gating weights: the chosen experts' s_i (unbiased), divided by their sum when
  ``normalize_top_k``, times ``routed_scaling_factor``.
- M2: an expert takes at most C = max(1, ceil(T k / E x capacity_factor)) of one rank's
  slots (rounded up to a multiple of the EP size when the scenario pads), its highest
  weight slots first, an earlier (token, slot) first among equals; factor 0 keeps all.
- M3: aux = alpha E sum_i f_i P_i, f_i the share of the rank's slots routed to i (before
  capacity), P_i the mean of s_i / sum_j s_j over the rank's tokens.
- Sequence-wise balance loss (DeepSeek-V3 eq. 17-20), per sequence of T' tokens (``transformer.seq_len``,
  else the rank's T): alpha sum_i f_i P_i, f_i = E / (k T') x the sequence's tokens whose k highest
  *unbiased* scores (over all experts) include i, P_i = the mean of s_i / sum_j s_j; the mean over the
  rank's sequences, added to the aux loss.
- Bias balancing (DeepSeek-V3 §2.1.2): after each step, the bias of expert i in layer l moves by
  gamma x sign(mean_j load_j - load_i), load = the slots the whole batch (every rank) routed there.
- The layer: h = x + sum over the token's kept slots of p_k FFN_e(x) (gelu or SwiGLU), plus
  the shared experts' output (``model.shared_experts``).
- With the whole transformer, the embedding, attention, dense FFNs, head and MTP modules
  around the MoE layers: ``real.rank.reference_model``, which writes them out too.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from real.kernels.experts import split_flat
from real.kernels.task import SyntheticTask, TokenTask
from real.rank.layer import noise_generator
from real.rank.rank_state import TORCH_DTYPES, initial_expert_flat
from real.rank.reference_model import ReferenceModel, ffn_by_formula
from testbed.model.mtp_layers import controller_scenario
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


def capacity_of(scenario: Scenario) -> int | None:
    """M2's C for one rank's tokens; None: dropless."""
    s, m = scenario, scenario.model
    if s.router.capacity_factor == 0:
        return None
    c = max(1, math.ceil(s.workload.tokens_per_rank * m.top_k / m.num_experts * s.router.capacity_factor))
    ep = s.parallelism.ep_size
    return math.ceil(c / ep) * ep if s.router.pad_capacity_to_ep and ep > 1 else c


def route_by_formula(x_TH, w_EH, b_E, scenario: Scenario, step: int, noise: torch.Generator, local_bias=0.0,
                     balance_bias=None):
    """The routing above for one rank's tokens: ([(token, slot, expert, weight)] of the
    kept slots, aux loss (M3 + sequence-wise), [E] slots routed to each expert).
    ``local_bias``: M22's local-first bias per expert (a tensor), or 0. ``balance_bias``:
    the layer's balancing bias [E] (float32), or None."""
    r, k = scenario.router, scenario.model.top_k
    tokens, experts = x_TH.shape[0], w_EH.shape[0]
    logits = x_TH.float() @ w_EH.t() + b_E + local_bias
    if r.noise == "gumbel":  # drawn where the run draws it (its ranks' device), computed here
        u = torch.rand((tokens, experts), generator=noise, device=noise.device).cpu().clamp(1e-9, 1 - 1e-9)
        logits = logits - torch.log(-torch.log(u))
    t = r.temperature_start + min(1.0, step / r.temperature_steps) * (r.temperature_end - r.temperature_start)
    z = logits / t
    s_TE = torch.softmax(z, dim=-1) if r.score == "softmax" else torch.sigmoid(z)
    biased = (s_TE.detach() if balance_bias is None else s_TE.detach() + balance_bias).tolist()
    groups = r.expert_groups
    per_group = experts // groups if groups else experts
    chosen = []
    for row in biased:
        allowed = list(range(experts))
        if groups:
            tops = [sorted(row[g * per_group:(g + 1) * per_group], reverse=True) for g in range(groups)]
            rank = [top[0] + top[1] if r.group_score == "top2_sum" else top[0] for top in tops]
            best = sorted(range(groups), key=lambda g: -rank[g])[:r.groups_per_token]
            allowed = [e for g in best for e in range(g * per_group, (g + 1) * per_group)]
        chosen.append(sorted(allowed, key=lambda e: -row[e])[:k])
    p_TK = s_TE.gather(1, torch.tensor(chosen, dtype=torch.long))
    if r.normalize_top_k:
        p_TK = p_TK / p_TK.sum(-1, keepdim=True)
    p_TK = p_TK * r.routed_scaling_factor
    routed = [0] * experts
    for row in chosen:
        for e in row:
            routed[e] += 1
    f = torch.tensor(routed, dtype=torch.float32) / (tokens * k)
    share_TE = s_TE / s_TE.sum(-1, keepdim=True)  # s' (eq. 19); a softmax's already sums to 1
    aux = r.aux_loss_coef * experts * (f * (s_TE if r.score == "softmax" else share_TE).mean(0)).sum()
    if r.seq_aux_loss_coef > 0:
        aux = aux + sequence_loss_by_formula(s_TE, share_TE, scenario)
    cap = capacity_of(scenario)
    by_expert: dict[int, list[tuple[float, int, int]]] = {}
    weights = p_TK.detach().tolist()
    for tok in range(tokens):
        for slot in range(k):
            by_expert.setdefault(chosen[tok][slot], []).append((-weights[tok][slot], tok * k + slot, slot))
    kept = []
    for e, slots in by_expert.items():
        slots.sort(key=lambda s: (s[0], s[1]) if r.drop_policy == "probs" else s[1])
        for _, flat, slot in slots[:cap] if cap is not None else slots:
            tok = flat // k
            kept.append((tok, slot, e, p_TK[tok, slot]))
    return kept, aux, routed


def sequence_loss_by_formula(s_TE, share_TE, scenario: Scenario):
    """DeepSeek-V3 eq. 17-20 (module doc) over one rank's sequences."""
    r, k = scenario.router, scenario.model.top_k
    tokens, experts = s_TE.shape
    length = scenario.transformer.seq_len if scenario.transformer.enabled else tokens
    scores = s_TE.detach().tolist()
    total = torch.zeros(())
    for first in range(0, tokens, length):
        hits = [0] * experts
        for row in scores[first:first + length]:
            for e in sorted(range(experts), key=lambda e: -row[e])[:k]:
                hits[e] += 1
        f = torch.tensor(hits, dtype=torch.float32) * experts / (k * length)
        total = total + (f * share_TE[first:first + length].mean(0)).sum()
    return r.seq_aux_loss_coef * total / (tokens // length)


def update_balance(bias_LE: np.ndarray, routed_WLE: list, scenario: Scenario) -> None:
    """Bias balancing after a step (module doc), in place: ``routed_WLE`` every rank's
    routed counts per layer and expert."""
    rate = scenario.router.bias_update_rate
    for layer in range(bias_LE.shape[0]):
        load = [sum(per_rank[layer][e] for per_rank in routed_WLE) for e in range(bias_LE.shape[1])]
        mean = sum(load) / len(load)
        for e, n in enumerate(load):
            bias_LE[layer, e] += rate * (1.0 if mean > n else -1.0 if mean < n else 0.0)


def reference_run(scenario: Scenario, steps: int | None = None, noise_device: str = "cpu") -> list[dict]:
    """``steps`` training steps (default: the scenario's) of the whole cluster in this
    process (CPU); per step the outputs, loss and gradients, and the weights after it.
    ``noise_device``: where the run's ranks drew the router noise (its generators there).
    With the whole transformer (``real.rank.reference_model``) the steps are plain SGD at
    ``run.learning_rate`` (``transformer.optimizer = "sgd"``), as the MoE stack's."""
    s, m = scenario, scenario.model
    if s.transformer.enabled and s.transformer.optimizer != "sgd":
        raise ValueError("the reference trains with plain SGD: transformer.optimizer = sgd")
    dtype = TORCH_DTYPES[m.dtype]
    world, num_experts = s.world_size, m.num_experts
    swiglu = m.ffn_activation == "swiglu"
    layers = controller_scenario(s).model.num_layers  # the MoE layers: the model's, then the MTP modules'
    model = ReferenceModel(s, layers, dtype)  # routers, shared experts and the dense weights, by name
    routers = [(model.p[f"router{layer}.w"], model.p[f"router{layer}.b"]) for layer in range(layers)]
    experts = {i: initial_expert_flat(s.run.seed, i, m.hidden_size, m.ffn_hidden_size, swiglu).to(dtype)
               .requires_grad_() for i in range(layers * num_experts)}
    task = TokenTask(s) if s.transformer.enabled else SyntheticTask(s)
    lr = s.run.learning_rate
    # M22: router.local_bias on the logits of the experts local to each rank's node (or micro-cluster)
    layout = Layout(s)
    local = torch.as_tensor(layout.local_expert_mask(s.router.local_scope) * s.router.local_bias,
                            dtype=torch.float32)
    balancing = s.router.bias_update_rate > 0
    bias_LE = np.zeros((layers, num_experts))  # the balancing bias, the same for every rank
    out = []
    for step in range(s.run.steps if steps is None else steps):
        outputs, losses, auxes, mtp_losses, total = [], [], [], [], torch.zeros(())
        routed_WLE = []
        bias_used = bias_LE.copy()
        for rank in range(world):
            x_TH, y_TH = task.batch(step, rank)
            aux_total = [torch.zeros(())]
            routed_WLE.append([None] * layers)

            def moe(layer, h, rank=rank):
                """MoE layer ``layer`` on input h: routed by formula, h + shared + routed."""
                w_EH, b_E = routers[layer]
                bias = torch.tensor(bias_LE[layer], dtype=torch.float32) if balancing else None
                kept, aux, routed = route_by_formula(h, w_EH, b_E, s, step,
                                                     noise_generator(s.run.seed, step, layer, rank, noise_device),
                                                     local[rank], bias)
                routed_WLE[rank][layer] = routed
                moe_T = [torch.zeros(m.hidden_size, dtype=dtype) for _ in range(h.shape[0])]
                for tok, _, e, p in kept:
                    w1, w2 = split_flat(experts[layer * num_experts + e], m.hidden_size, m.ffn_hidden_size, swiglu)
                    moe_T[tok] = moe_T[tok] + p.to(dtype) * ffn_by_formula(h[tok][None], w1, w2, swiglu)[0]
                shared = model.shared(layer, h)
                aux_total[0] = aux_total[0] + aux
                return h + torch.stack(moe_T) if shared is None else h + shared + torch.stack(moe_T)

            if s.transformer.enabled:
                h, objective, mtp = model.forward(x_TH, y_TH, moe)
                task_loss = objective if not mtp else model._cross_entropy(h, y_TH).mean()
                if mtp:
                    mtp_losses.append(float(sum(ce.detach() for ce in mtp)) / len(mtp))
            else:
                h = x_TH.to(dtype)
                for layer in range(layers):
                    h = moe(layer, h)
                task_loss = objective = torch.mean((h.float() - y_TH) ** 2)
            total = total + (objective + aux_total[0]) / world
            outputs.append(h.detach())
            losses.append(float(task_loss.detach()))
            auxes.append(float(aux_total[0].detach()))
        total.backward()
        if balancing:
            update_balance(bias_LE, routed_WLE, s)
        expert_grads = {i: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for i, p in experts.items()}
        router_grads = [(w.grad.clone(), b.grad.clone()) for w, b in routers]
        named_grads = {k: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for k, p in model.p.items()}
        with torch.no_grad():  # plain SGD on every parameter
            for p in [*experts.values(), *model.p.values()]:
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None
        out.append({
            "outputs": outputs,
            "loss": sum(losses) / world,
            "aux": sum(auxes) / world,  # the balance losses, summed over layers, mean over ranks
            "mtp_loss": sum(mtp_losses) / world if mtp_losses else None,  # mean over ranks of the modules' mean
            "expert_grads": expert_grads,
            "router_grads": router_grads,
            "named_grads": named_grads,  # every weight besides the routed experts, as RankState.named_params
            "experts_after": {i: p.detach().clone() for i, p in experts.items()},
            "router_after": [(w.detach().clone(), b.detach().clone()) for w, b in routers],
            "named_after": {k: p.detach().clone() for k, p in model.p.items()},
            "routed": np.array(routed_WLE).transpose(1, 0, 2),  # [L, W, E] slots routed (before capacity)
            "balance_bias": bias_used,  # [L, E] the bias the step routed with
        })
    return out


def reference_step(scenario: Scenario, step: int = 0, noise_device: str = "cpu") -> dict:
    """The first step of ``reference_run`` (``step`` must be 0: the reference trains
    from the initial weights)."""
    if step != 0:
        raise ValueError("reference_step runs the first step; use reference_run for more")
    return reference_run(scenario, steps=1, noise_device=noise_device)[0]
