"""The synthetic routing workload (M4): skewed, sticky in time, different per rank.

Expert popularity per layer follows a Zipf law with exponent ``skew`` over a random
ranking of the experts (skew 1 with 8 experts gives the hottest ~2.9x the mean load,
the seed's "3x"). ``drift`` is the chance per step that an expert swaps its rank with
another one, so popularity moves slowly (sticky in time). Each rank mixes the global
popularity with a preference of its own (its own Zipf ranking) with weight
``locality``. Everything comes from one seeded generator per (seed, step), so any
process can compute any step and gets the same numbers.

The simulator draws routed counts from this; the real backend draws each rank's token
*clusters* from it (one cluster per expert), so real routing is skewed the same way
once the router has learnt the clusters. With a group limit or bias balancing
(``router.expert_groups``, ``router.bias_update_rate``) the counts come instead from
per-token scores routed by the router's own choice (``testbed.policy.scored_routing``).
"""

from __future__ import annotations

import numpy as np

from testbed.policy.router_config import routes_by_scores
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


class SyntheticWorkload:
    """Expert popularity and routed counts for every step, layer, rank and expert."""

    def __init__(self, scenario: Scenario):
        w = scenario.workload
        self.seed = w.seed
        self.skew, self.drift, self.locality = w.skew, w.drift, w.locality
        self.tokens = w.tokens_per_rank
        self.top_k = scenario.model.top_k
        self.layers = scenario.model.num_layers
        self.experts = scenario.model.num_experts
        self.world = scenario.world_size
        self._zipf = 1.0 / np.arange(1, self.experts + 1) ** self.skew  # weight of rank k
        self._zipf /= self._zipf.sum()
        self.local_bias = scenario.router.local_bias
        #: [W, E] experts local to each rank (M22's local-first bias)
        self.local = Layout(scenario).local_expert_mask(scenario.router.local_scope) if self.local_bias else None
        #: per-token routing, when the router's choice needs scores (module doc)
        self.scored = None
        if routes_by_scores(scenario):
            from testbed.policy.scored_routing import ScoredRouting  # torch, only when needed

            self.scored = ScoredRouting(scenario, self.routing_popularity)
        self._reset()

    def _reset(self) -> None:
        rng = np.random.default_rng([self.seed, 0x5EED])
        e = self.experts
        # ``permuted`` shuffles row after row as ``permutation`` does call after call (the
        # same numbers, tests/testbed/policy/test_workload_and_cache.py), without 46,000 calls
        # at paper scale
        #: _ranking[l, e] = popularity rank of expert e in layer l at step ``_step``
        self._ranking = rng.permuted(np.tile(np.arange(e), (self.layers, 1)), axis=1)
        self._rank_pref = rng.permuted(np.tile(np.arange(e), (self.layers * self.world, 1)),
                                       axis=1).reshape(self.layers, self.world, e)  # [L, W, E]
        self._local_term = self.locality * self._zipf[self._rank_pref]  # [L, W, E]: never drifts
        self._step = 0

    def _advance_to(self, step: int) -> None:
        if step < self._step:  # asked for an earlier step: replay the drift from step 0
            self._reset()
        while self._step < step:
            rng = np.random.default_rng([self.seed, self._step, 0xD21F7])
            for layer in range(self.layers):
                movers = np.flatnonzero(rng.random(self.experts) < self.drift)
                partners = rng.integers(0, self.experts, size=len(movers))
                for a, b in zip(movers, partners):  # swap popularity ranks: sticky drift
                    r = self._ranking[layer]
                    r[a], r[b] = r[b], r[a]
            self._step += 1

    def popularity(self, step: int) -> np.ndarray:
        """[L, W, E] probability that one routed slot of rank w in layer l picks expert e."""
        self._advance_to(step)
        global_p = self._zipf[self._ranking]  # [L, E]
        return (1 - self.locality) * global_p[:, None, :] + self._local_term

    def routing_popularity(self, step: int) -> np.ndarray:
        """[L, W, E] what the router makes of ``popularity``: with M22's local-first bias
        (``router.local_bias`` = b on the logits of rank w's local experts) a top-1 choice
        picks a local expert e^b times as often relative to the others (the Gumbel-max
        trick: argmax of logits + Gumbel noise samples softmax(logits)), so each rank's
        popularity of its local experts is multiplied by e^b and renormalised."""
        p = self.popularity(step)
        if self.local_bias == 0:
            return p
        weighted = p * np.exp(self.local_bias * self.local)[None, :, :]
        return weighted / weighted.sum(axis=2, keepdims=True)

    def routed_counts(self, step: int) -> np.ndarray:
        """[L, W, E] int32 token slots routed to each expert (before capacity).

        Each rank routes ``tokens * top_k`` slots; no expert gets more than ``tokens``
        slots from one rank (a token picks distinct experts): excess slots are
        re-drawn among experts with room. With a group limit or bias balancing: token
        by token (``ScoredRouting``).
        """
        if self.scored is not None:
            return self.scored.routed_counts(step)
        p = self.routing_popularity(step)
        rng = np.random.default_rng([self.seed, step, 0xC0DE])
        counts = rng.multinomial(self.tokens * self.top_k, p)
        for _ in range(64):
            excess = np.clip(counts - self.tokens, 0, None)
            if not excess.any():
                break
            counts -= excess
            room = np.where(counts < self.tokens, p, 0.0)
            room /= room.sum(-1, keepdims=True)
            counts += rng.multinomial(excess.sum(-1), room)
        return counts.astype(np.int32)

