"""The simulator's synthetic routing token by token, for router features that change
*which* experts a token picks: group-limited routing and bias balancing.

M4's counts (``SyntheticWorkload.routed_counts``) are drawn from each rank's expert
popularity p without scores; a group limit or a bias acts on scores, so with
``router.expert_groups`` or ``router.bias_update_rate`` on, each token gets scores and
goes through the real router's choice (``testbed.policy.expert_choice``), as follows:

- each token t of rank w in layer l has logits z_{t,e} = log p_{l,w,e} + G_{t,e}, G iid
  standard Gumbel. Top-k of z is k draws without replacement from p (the Gumbel-top-k
  trick: Kool, van Hoof and Welling, ICML 2019), so without groups and bias a token picks
  its experts as M4's workload says - the same law as M4's counts (not the same numbers:
  those come from multinomial draws).
- its scores are ``router.score`` of z (softmax over the experts, or sigmoid); its
  experts are ``choose_experts`` of them with the balancing bias (one for every rank,
  moved by the whole batch's load: ``testbed.policy.bias_balance``), inside its allowed
  groups. Assumed: the spread of a trained router's scores is that of this
  Gumbel (scale 1 on the logits); how fast a bias of a given size moves tokens is a
  consequence of that assumption, not a measured property of a router.
- the bias starts at 0 and, after each step, moves as the controller's does
  (``BiasBalance.update``) by the counts just drawn, summed over every rank: the counts of step s depend on those
  of steps 0 .. s-1, so asking for an earlier step than the last replays from step 0.

The Gumbel noise of one rank's tokens in one layer and step comes from a generator seeded
by (workload.seed, step, layer, rank), so a scenario and seed give the same counts
whatever the chunking. The cost is O(L x W x T x E) per step: 0.45-0.6 s per layer
for 64 ranks x 4,096 tokens x 128 experts (top-2 inside 4 of 8 groups, sigmoid, bias;
``SyntheticWorkload.routed_counts`` timed over 5 steps on a 2-core machine), so about
6 minutes a step at paper scale (1,440 ranks, 32 layers; linear in each), against M4's
multinomial counts' 0.7 s (sim.backend); a trace replay does none of it.

The fast evaluation of a layout (``sim.representative_slice``, issue 27 item 2): where every
layer and every rank follows the same popularity (checked on the popularity itself, each step:
``workload.skew`` = 0 makes it so, and no ``router.local_bias``) and the EP groups are contiguous
(``parallelism.placement = topology``), one layer of one block of ranks is routed - layer 0's
noise, the first ``routing_block`` ranks (whole TP x CP and ETP x EP groups) - and its counts
stand for every layer and every block (``representative``), layer l's with its experts moved by l whole expert
groups (modulo the groups; without groups by l GPUs' experts of the EP group), so that layers
load different GPUs most as their own draws would (the fullest GPU's memory adds the layers'),
the groups a token may use kept whole. Each layer's bias then moves as layer 0's, moved alike
(it moves by the sign of each expert's error only, ``BiasBalance.update``, so the copies' sums
move it as the block's would). Different numbers from the full routing, the
same law per EP group; the same scenario and seed give the same counts. The routed block of a
step is cached for the process (``_BLOCK_CACHE``, keyed by everything it depends on): the
simulated pipeline stages of one scenario share it, and so do layouts with the same block,
tokens a GPU and router.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from testbed.policy.bias_balance import BiasBalance
from testbed.policy.expert_choice import choose_experts, gate_scores
from testbed.scenario.scenario import Scenario

CHUNK_ELEMENTS = 2**22  # token x expert scores routed at once (16 MiB of float32)
#: (the routed block's inputs, hashed) -> its [B, E] counts: the representative routing's (module doc)
_BLOCK_CACHE: dict[str, np.ndarray] = {}
_BLOCK_CACHE_SIZE = 64  # blocks kept (each B x E int32: at most a few MiB)


def routing_block(scenario: Scenario) -> int:
    """Ranks of the representative routing's block: whole TP x CP and ETP x EP groups, the
    first ranks in Megatron-Core's order (module doc)."""
    p = scenario.parallelism
    return math.lcm(p.tp_size * p.cp_size, p.ep_size * p.etp_size)


class ScoredRouting:
    """Routed counts [L, W, E] of every step from per-token scores (module doc);
    ``popularity(step)`` gives the [L, W, E] law each rank's tokens follow."""

    def __init__(self, scenario: Scenario, popularity):
        self.cfg = scenario.router
        self.popularity = popularity
        self.seed = scenario.workload.seed
        self.tokens = scenario.workload.tokens_per_rank
        self.top_k = scenario.model.top_k
        self.layers, self.experts = scenario.model.num_layers, scenario.model.num_experts
        self.rate = self.cfg.bias_update_rate
        #: one layer of one block of ranks stands for all (module doc); decided on the law per step
        self.representative = scenario.sim.representative_slice and scenario.parallelism.placement == "topology"
        self.block = routing_block(scenario)
        #: layer l's counts are the block's with the experts moved by l whole groups (mod groups)
        self.groups = self.cfg.expert_groups or scenario.parallelism.ep_size
        #: ranks of the block the last draw routed for every layer and block (0: it routed every one)
        self.routed_block = 0
        self._reset()

    def _reset(self) -> None:
        self.balance = BiasBalance(self.rate, self.layers, self.experts) if self.rate > 0 else None
        self._next = 0  # the step whose bias ``balance`` holds

    def routed_counts(self, step: int) -> np.ndarray:
        """[L, W, E] int32 token slots routed to each expert at ``step`` (before capacity)."""
        if self.balance is None:
            return self.draw(step, None)
        if step < self._next:
            self._reset()
        while True:
            counts = self.draw(self._next, self.balance.bias)
            self.balance.update(counts.sum(axis=1))  # the whole batch's load
            self._next += 1
            if self._next > step:
                return counts

    def draw(self, step: int, bias_LE: np.ndarray | None) -> np.ndarray:
        """The counts of ``step`` routed with the bias ``bias_LE`` [L, E] (None: none)."""
        log_p = self._log_popularity(step)
        world, e = log_p.shape[1], self.experts
        self.routed_block = 0
        if self.representative and (log_p == log_p[:1, :1]).all():
            return self._representative(step, bias_LE, log_p)
        counts = np.zeros((self.layers, world, e), dtype=np.int32)
        chunk = max(1, CHUNK_ELEMENTS // (self.tokens * e))
        for layer in range(self.layers):
            for lo in range(0, world, chunk):
                ranks = list(range(lo, min(world, lo + chunk)))
                experts = self.experts_of(step, layer, ranks, bias_LE, log_p).flatten(1)  # [c, T*K]
                per_rank = torch.zeros((len(ranks), e), dtype=torch.int64).scatter_add_(
                    1, experts, torch.ones_like(experts))
                counts[layer, lo:lo + len(ranks)] = per_rank.numpy()
        return counts

    def _representative(self, step: int, bias_LE: np.ndarray | None, log_p: np.ndarray) -> np.ndarray:
        """[L, W, E] counts of ``step`` from one routed layer of one block (module doc): every layer
        and rank alike in ``log_p``, every layer's bias alike (it moves alike)."""
        world = log_p.shape[1]
        block = self.block if world % self.block == 0 else world
        self.routed_block = block
        bias = None if bias_LE is None else bias_LE[:1]
        key = hashlib.sha1(repr((self.seed, step, self.tokens, self.top_k, self.experts, block, self.cfg)).encode()
                           + log_p[0, 0].tobytes() + (b"" if bias is None else bias.tobytes())).hexdigest()
        got = _BLOCK_CACHE.get(key)
        if got is None:
            got = np.zeros((block, self.experts), dtype=np.int32)
            chunk = max(1, CHUNK_ELEMENTS // (self.tokens * self.experts))
            for lo in range(0, block, chunk):
                ranks = list(range(lo, min(block, lo + chunk)))
                experts = self.experts_of(step, 0, ranks, bias, log_p[:1]).flatten(1)
                got[lo:lo + len(ranks)] = torch.zeros((len(ranks), self.experts), dtype=torch.int64).scatter_add_(
                    1, experts, torch.ones_like(experts)).numpy()
            if len(_BLOCK_CACHE) >= _BLOCK_CACHE_SIZE:
                _BLOCK_CACHE.pop(next(iter(_BLOCK_CACHE)))
            _BLOCK_CACHE[key] = got
        tiled = np.tile(got, (world // block, 1))
        unit = self.experts // self.groups  # one expert group's (one GPU's without groups) experts
        return np.stack([np.roll(tiled, (layer % self.groups) * unit, axis=1) for layer in range(self.layers)])

    def experts_of(self, step: int, layer: int, ranks: list[int], bias_LE: np.ndarray | None,
                   log_p: np.ndarray | None = None) -> torch.Tensor:
        """int64 [len(ranks), T, K]: the experts each token of ``ranks`` picks in ``layer``
        at ``step`` under the bias ``bias_LE`` [L, E] (None: none)."""
        log_p = self._log_popularity(step) if log_p is None else log_p
        u = torch.from_numpy(np.stack([self._uniform(step, layer, w) for w in ranks]))  # [c, T, E]
        gumbel = -torch.log(-torch.log(u.clamp_min_(np.finfo(np.float32).tiny)))
        z = torch.from_numpy(log_p[layer, ranks].astype(np.float32))[:, None, :] + gumbel
        scores = gate_scores(z, self.cfg.score)
        bias = None
        if bias_LE is not None:
            bias = torch.from_numpy(bias_LE[layer][None, None, :])  # [1, 1, E]: the same for every rank
        return choose_experts(scores, self.top_k, self.cfg, bias)

    def _log_popularity(self, step: int) -> np.ndarray:
        return np.log(np.maximum(self.popularity(step), np.finfo(np.float32).tiny))  # [L, W, E]

    def _uniform(self, step: int, layer: int, rank: int) -> np.ndarray:
        """[T, E] float32 uniforms on [0, 1) for one rank's tokens in one layer and step
        (their Gumbel noise is -log(-log u): in torch, which is faster at it than numpy)."""
        rng = np.random.default_rng([self.seed, step, layer, rank, 0x5C0E])
        return rng.random((self.tokens, self.experts), dtype=np.float32)
