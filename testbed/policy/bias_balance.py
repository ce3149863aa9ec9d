"""Auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2): a routing bias per expert,
moved after every step against the sign of the expert's load error.

"At the end of each step, we will decrease the bias term by gamma if its corresponding
expert is overloaded, and increase it by gamma if its corresponding expert is
underloaded" (gamma = ``router.bias_update_rate``; DeepSeek-V3: 0.001). As Megatron-LM's
``get_updated_expert_bias``: b_i += gamma sign(mean_j load_j - load_i), so an expert at
exactly the mean load keeps its bias. The load is the slots routed to the expert (before
capacity: what the router asked of it) in the step. The bias only steers the top-k
choice (``testbed.policy.expert_choice.choose_experts``), never the gating weights.

Whose load: each EP group's. DeepSeek-V3 "keep[s] monitoring the expert load on the
whole batch of each training step", and Megatron-LM all-reduces the counts over the
data-parallel ranks for it; here the counts every rank of an EP group already shares
are its group's (the route all-gather, ``Planner.route_ops``), so each EP group keeps
its own bias, updated from its own tokens' load - the load its own replicas of the
experts compute. Every rank of a group holds the same bias; with one replica (EP = the
world) that is the whole batch's, DeepSeek-V3's rule exactly. With several replicas the
groups' biases differ (a global bias would need one more all-reduce of L x E counts per
step over the replica groups, which the planner does not plan).

The state is float64 and moves by exact steps of +-gamma from integer comparisons, so
every controller that is told the same counts (the simulator's for the whole cluster, a
real rank's for its group, a trace replay) holds the same bits.
"""

from __future__ import annotations

import numpy as np


class BiasBalance:
    """The routing bias of every EP group, MoE layer and expert: ``bias`` [R, L, E]."""

    def __init__(self, rate: float, rank_of: np.ndarray, layers: int, experts: int):
        self.rate = float(rate)
        self.rank_of = np.asarray(rank_of)  # [R, P]: the ranks of each EP group
        self.bias = np.zeros((self.rank_of.shape[0], layers, experts))

    def of_group(self, group: int) -> np.ndarray:
        """[L, E] the bias of EP group ``group``."""
        return self.bias[group]

    def update(self, routed_LWE: np.ndarray) -> None:
        """After a step: ``routed_LWE`` [L, W, E] slots each rank routed to each expert
        (a rank's controller: its group's rows, the others zero - a group told nothing
        keeps its bias)."""
        routed = np.asarray(routed_LWE, dtype=np.int64)
        load_RLE = routed[:, self.rank_of, :].sum(axis=2).transpose(1, 0, 2)  # [L, R, P, E] -> [R, L, E]
        experts = load_RLE.shape[-1]
        # sign(mean - load) without a division: mean - load = (total - E load) / E
        error_sign = np.sign(load_RLE.sum(-1, keepdims=True) - experts * load_RLE)
        self.bias += self.rate * error_sign
