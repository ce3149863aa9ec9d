"""The synthetic training task: clustered inputs, one cluster per expert, teacher targets.

Rank r's tokens at step s come from clusters drawn with the workload's popularity for
(layer 0, rank r, step s) (M4: skewed, drifting, per-rank locality), so routing is
skewed and learnable. Input x = center[c] + noise; target y = tanh(x A_c) with a
random teacher matrix per cluster; the model must learn to send each cluster to an
expert that imitates its teacher. Deterministic in (workload.seed, step, rank).

Memory: the teachers are [C, H, H] fp32 per rank (``testbed.run.guards.task_bytes`` counts
them); a batch needs O(T x H) more, never a teacher per token (a [T, H, H] gather of
them would take 69 GB at H 2048 and 4,096 tokens).
"""

from __future__ import annotations

import torch

from testbed.policy.workload import SyntheticWorkload
from testbed.scenario.scenario import Scenario


class SyntheticTask:
    def __init__(self, scenario: Scenario):
        m, w = scenario.model, scenario.workload
        self.tokens, self.hidden, self.clusters = w.tokens_per_rank, m.hidden_size, m.num_experts
        self.seed = w.seed
        g = torch.Generator().manual_seed(w.seed * 1000003 + 17)
        self.centers_CH = torch.randn(self.clusters, self.hidden, generator=g)
        self.teachers_CHH = torch.randn(self.clusters, self.hidden, self.hidden, generator=g) / self.hidden ** 0.5
        self.workload = SyntheticWorkload(scenario)

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_TH, y_TH) in fp32 for ``rank`` at ``step``."""
        c_T, x_TH = self.inputs(step, rank)
        return x_TH, self.targets(x_TH, c_T)

    def inputs(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(each token's cluster c_T, x_TH) for ``rank`` at ``step``."""
        p = torch.from_numpy(self.workload.popularity(step)[0, rank]).float()
        g = torch.Generator().manual_seed((self.seed * 7919 + step) * 104729 + rank)
        c_T = torch.multinomial(p, self.tokens, replacement=True, generator=g)
        return c_T, self.centers_CH[c_T] + 0.5 * torch.randn(self.tokens, self.hidden, generator=g)

    def targets(self, x_TH: torch.Tensor, c_T: torch.Tensor) -> torch.Tensor:
        """y_TH = tanh(x_t A_c(t)), teacher by teacher: each teacher's tokens go through one
        bmm of [n, 1, H] rows by the teacher broadcast over them (an expanded view, no copy),
        the same per-row products as a bmm over a [T, H, H] gather of teachers, without the
        gather."""
        y_TH = torch.empty_like(x_TH)
        order = torch.argsort(c_T, stable=True)
        clusters, counts = torch.unique_consecutive(c_T[order], return_counts=True)
        for c, idx in zip(clusters.tolist(), torch.split(order, counts.tolist())):
            teacher = self.teachers_CHH[c].expand(len(idx), self.hidden, self.hidden)
            y_TH[idx] = torch.tanh(torch.bmm(x_TH[idx].unsqueeze(1), teacher).squeeze(1))
        return y_TH


class TokenTask:
    """The whole transformer's task (``transformer.enabled``): token ids in, target ids
    out. Rank r's tokens at step s come from the vocabulary's clusters (token v is in
    cluster v mod E) drawn with the workload's popularity for (layer 0, rank r, step s),
    each uniform within its cluster; the target of token v is a fixed random permutation
    of v, so the next-token map is learnable. Deterministic in (workload.seed, step, rank)."""

    def __init__(self, scenario: Scenario):
        self.tokens, self.vocab = scenario.workload.tokens_per_rank, scenario.transformer.vocab_size
        self.clusters = scenario.model.num_experts
        self.seed = scenario.workload.seed
        g = torch.Generator().manual_seed(self.seed * 1000003 + 29)
        self.target_of = torch.randperm(self.vocab, generator=g)
        self.workload = SyntheticWorkload(scenario)

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [T], target ids [T]), int64."""
        p = torch.from_numpy(self.workload.popularity(step)[0, rank]).float()
        g = torch.Generator().manual_seed((self.seed * 7919 + step) * 104729 + rank + 31)
        c_T = torch.multinomial(p, self.tokens, replacement=True, generator=g)
        per_cluster = -(-self.vocab // self.clusters)
        offset = torch.randint(0, per_cluster, (self.tokens,), generator=g)
        ids = offset * self.clusters + c_T
        ids = torch.where(ids < self.vocab, ids, c_T % self.vocab)  # the last row of clusters is short
        return ids, self.target_of[ids]
