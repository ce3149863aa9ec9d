"""The single-process reference: every rank's tokens through one unsharded model.

It runs the same router, capacity (per rank, as the distributed run applies it), slot
order and combine as the real backend, with one copy of every expert and plain autograd,
and returns what the distributed run must reproduce within float tolerance: each rank's
layer-stack output, the loss, the summed expert and router gradients, and the weights
after one SGD step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from real.experts import combine_slots, source_slots, split_flat
from real.layer import noise_generator
from real.task import SyntheticTask
from real.rank_state import TORCH_DTYPES, initial_expert_flat, initial_router
from testbed.capacity import expert_capacity
from testbed.router import route
from testbed.scenario import Scenario


def reference_step(scenario: Scenario, step: int = 0) -> dict:
    """One training step of the whole cluster in this process (CPU)."""
    s, m = scenario, scenario.model
    dtype = TORCH_DTYPES[m.dtype]
    world, num_experts = s.world_size, m.num_experts
    cap = expert_capacity(s.workload.tokens_per_rank, m.top_k, num_experts, s.router.capacity_factor,
                          s.parallelism.ep_size, s.router.pad_capacity_to_ep)
    routers = [tuple(t.requires_grad_() for t in initial_router(s.run.seed, layer, s)) for layer in range(m.num_layers)]
    experts = {i: initial_expert_flat(s.run.seed, i, m.hidden_size, m.ffn_hidden_size).to(dtype).requires_grad_()
               for i in range(m.num_layers * num_experts)}
    task = SyntheticTask(s)
    outputs, losses, total = [], [], 0.0
    for rank in range(world):
        x_TH, y_TH = task.batch(step, rank)
        h = x_TH.to(dtype)
        aux_total = torch.zeros(())
        for layer in range(m.num_layers):
            w_EH, b_E = routers[layer]
            routing = route(h, w_EH, b_E, s.router, m.top_k, cap, step, noise_generator(s.run.seed, step, layer, rank))
            slot_idx = source_slots(routing.experts_TK, routing.keep_TK)
            rows = h.index_select(0, slot_idx // m.top_k)
            expert_of_row = routing.experts_TK.reshape(-1)[slot_idx]
            pieces = []
            for e in torch.unique_consecutive(expert_of_row).tolist():
                w1, w2 = split_flat(experts[layer * num_experts + e], m.hidden_size, m.ffn_hidden_size)
                pieces.append(F.gelu(rows[expert_of_row == e] @ w1) @ w2)
            y_rows = torch.cat(pieces) if pieces else rows.new_zeros((0, m.hidden_size))
            h = h + combine_slots(y_rows, slot_idx, routing.probs_TK, h.shape[0])
            aux_total = aux_total + routing.aux_loss
        task_loss = torch.mean((h.float() - y_TH) ** 2)
        total = total + (task_loss + aux_total) / world
        outputs.append(h.detach())
        losses.append(float(task_loss.detach()))
    total.backward()
    lr = s.run.learning_rate
    return {
        "outputs": outputs,
        "loss": sum(losses) / world,
        "expert_grads": {i: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for i, p in experts.items()},
        "router_grads": [(w.grad.clone(), b.grad.clone()) for w, b in routers],
        "experts_after": {i: (p - lr * p.grad).detach() if p.grad is not None else p.detach() for i, p in experts.items()},
    }
