"""Auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2): a routing bias per expert,
moved after every step against the sign of the expert's load error.

"At the end of each step, we will decrease the bias term by gamma if its corresponding
expert is overloaded, and increase it by gamma if its corresponding expert is
underloaded" (gamma = ``router.bias_update_rate``; DeepSeek-V3: 0.001). As Megatron-LM's
``get_updated_expert_bias``: b_i += gamma sign(mean_j load_j - load_i), so an expert at
exactly the mean load keeps its bias. The load is the slots routed to the expert (before
capacity: what the router asked of it) in the step. The bias only steers the top-k
choice (``testbed.policy.expert_choice.choose_experts``), never the gating weights.

Whose load: the whole batch's. DeepSeek-V3 "keep[s] monitoring the expert load on the
whole batch of each training step", and Megatron-LM all-reduces the counts over the
data-parallel ranks for it; so there is one bias per layer, the same on every rank of
every EP group. A rank's route all-gather tells it only its EP group's counts
(``Planner.route_ops``); with several replicas the planner adds one all-reduce per step
that sums them over the replicas (``Planner.balance_ops``), and the controller moves the
bias by that sum (``Controller.end_step``). With one replica the EP group is the world
and the route all-gather already gave every rank the whole batch.

The state is float64 and moves by exact steps of +-gamma from integer comparisons, so
every controller that is told the same counts (the simulator's for the whole cluster, a
real rank's after the all-reduce, a trace replay) holds the same bits.
"""

from __future__ import annotations

import numpy as np


class BiasBalance:
    """The routing bias of every MoE layer and expert, one for the whole run: ``bias`` [L, E]."""

    def __init__(self, rate: float, layers: int, experts: int):
        self.rate = float(rate)
        self.bias = np.zeros((layers, experts))

    def update(self, load_LE: np.ndarray) -> None:
        """After a step: ``load_LE`` [L, E] slots the whole batch (every rank) routed to
        each expert of each layer."""
        load = np.asarray(load_LE, dtype=np.int64)
        experts = load.shape[-1]
        # sign(mean - load) without a division: mean - load = (total - E load) / E
        error_sign = np.sign(load.sum(-1, keepdims=True) - experts * load)
        self.bias += self.rate * error_sign
