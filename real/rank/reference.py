"""The single-process reference: every rank's tokens through one unsharded model.

What the distributed run must reproduce within float tolerance, step after step: each
rank's layer-stack output, the loss, the summed expert and router gradients, and the
weights after each SGD step. One copy of every expert and plain autograd; no EP groups,
replicas, pages or collectives.

Routing and capacity are written here from the mechanisms' formulas
(``docs/mechanisms.md``), not with the router and capacity code the run uses, so that a
mistake there is not made twice:

- M1: logits = x W^T + b (+ M22's local-first bias on the rank's local experts), plus Gumbel noise -log(-log u) (u drawn from the run's
  per-(step, layer, rank) generator on the ranks' device, clamped to [1e-9, 1 - 1e-9]); softmax at the
  temperature t(step) = start + min(1, step / steps) (end - start); the top-k experts;
  their probabilities renormalised to sum to 1.
- M2: an expert takes at most C = max(1, ceil(T k / E x capacity_factor)) of one rank's
  slots (rounded up to a multiple of the EP size when the scenario pads), its highest
  probability slots first, an earlier (token, slot) first among equals; factor 0 keeps all.
- M3: aux = alpha E sum_i f_i P_i, f_i the share of the rank's slots routed to i (before
  capacity), P_i the mean probability of i over the rank's tokens.
- The layer: h = x + sum over the token's kept slots of p_k gelu(x W1_e) W2_e.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from real.kernels.experts import split_flat
from real.kernels.task import SyntheticTask
from real.rank.layer import noise_generator
from real.rank.rank_state import TORCH_DTYPES, initial_expert_flat, initial_router
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


def route_by_formula(x_TH, w_EH, b_E, scenario: Scenario, step: int, noise: torch.Generator, local_bias=0.0):
    """M1-M3 for one rank's tokens: ([(token, slot, expert, probability)] of the kept
    slots, the aux loss). ``local_bias``: M22's local-first bias per expert (a tensor), or 0."""
    r, k = scenario.router, scenario.model.top_k
    tokens, experts = x_TH.shape[0], w_EH.shape[0]
    logits = x_TH.float() @ w_EH.t() + b_E + local_bias
    if r.noise == "gumbel":  # drawn where the run draws it (its ranks' device), computed here
        u = torch.rand((tokens, experts), generator=noise, device=noise.device).cpu().clamp(1e-9, 1 - 1e-9)
        logits = logits - torch.log(-torch.log(u))
    t = r.temperature_start + min(1.0, step / r.temperature_steps) * (r.temperature_end - r.temperature_start)
    p_TE = torch.softmax(logits / t, dim=-1)
    top_p, top_e = torch.topk(p_TE, k, dim=-1)
    p_TK = top_p / top_p.sum(-1, keepdim=True)
    chosen = top_e.tolist()
    routed = [0] * experts
    for row in chosen:
        for e in row:
            routed[e] += 1
    f = torch.tensor(routed, dtype=torch.float32) / (tokens * k)
    aux = r.aux_loss_coef * experts * (f * p_TE.mean(0)).sum()
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
    return kept, aux


def reference_run(scenario: Scenario, steps: int | None = None, noise_device: str = "cpu") -> list[dict]:
    """``steps`` training steps (default: the scenario's) of the whole cluster in this
    process (CPU); per step the outputs, loss and gradients, and the weights after it.
    ``noise_device``: where the run's ranks drew the router noise (its generators there)."""
    s, m = scenario, scenario.model
    dtype = TORCH_DTYPES[m.dtype]
    world, num_experts = s.world_size, m.num_experts
    routers = [tuple(t.clone().requires_grad_() for t in initial_router(s.run.seed, layer, s))
               for layer in range(m.num_layers)]
    experts = {i: initial_expert_flat(s.run.seed, i, m.hidden_size, m.ffn_hidden_size).to(dtype).requires_grad_()
               for i in range(m.num_layers * num_experts)}
    task = SyntheticTask(s)
    lr = s.run.learning_rate
    # M22: router.local_bias on the logits of the experts local to each rank's node (or micro-cluster)
    local = torch.as_tensor(Layout(s).local_expert_mask(s.router.local_scope) * s.router.local_bias,
                            dtype=torch.float32)
    out = []
    for step in range(s.run.steps if steps is None else steps):
        outputs, losses, total = [], [], torch.zeros(())
        for rank in range(world):
            x_TH, y_TH = task.batch(step, rank)
            h = x_TH.to(dtype)
            aux_total = torch.zeros(())
            for layer in range(m.num_layers):
                w_EH, b_E = routers[layer]
                kept, aux = route_by_formula(h, w_EH, b_E, s, step,
                                              noise_generator(s.run.seed, step, layer, rank, noise_device),
                                              local[rank])
                moe = [torch.zeros(m.hidden_size, dtype=dtype) for _ in range(h.shape[0])]
                for tok, _, e, p in kept:
                    w1, w2 = split_flat(experts[layer * num_experts + e], m.hidden_size, m.ffn_hidden_size)
                    moe[tok] = moe[tok] + p.to(dtype) * (F.gelu(h[tok] @ w1) @ w2)
                h = h + torch.stack(moe)
                aux_total = aux_total + aux
            task_loss = torch.mean((h.float() - y_TH) ** 2)
            total = total + (task_loss + aux_total) / world
            outputs.append(h.detach())
            losses.append(float(task_loss.detach()))
        total.backward()
        expert_grads = {i: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for i, p in experts.items()}
        router_grads = [(w.grad.clone(), b.grad.clone()) for w, b in routers]
        with torch.no_grad():  # plain SGD on every parameter
            for p in [*experts.values(), *(t for pair in routers for t in pair)]:
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None
        out.append({
            "outputs": outputs,
            "loss": sum(losses) / world,
            "expert_grads": expert_grads,
            "router_grads": router_grads,
            "experts_after": {i: p.detach().clone() for i, p in experts.items()},
            "router_after": [(w.detach().clone(), b.detach().clone()) for w, b in routers],
        })
    return out


def reference_step(scenario: Scenario, step: int = 0, noise_device: str = "cpu") -> dict:
    """The first step of ``reference_run`` (``step`` must be 0: the reference trains
    from the initial weights)."""
    if step != 0:
        raise ValueError("reference_step runs the first step; use reference_run for more")
    return reference_run(scenario, steps=1, noise_device=noise_device)[0]
