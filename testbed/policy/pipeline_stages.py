"""Pipeline stages (``parallelism.pp_size`` p, issue 13): which GPUs and layers each
stage holds, and the scenario one stage is on its own. Both backends place stages so:
the simulator simulates one stage and schedules the pipeline (``sim.pipeline.run``),
the real backend runs each stage's ranks as that scenario (``real.rank.worker``).

The cluster's GPUs form p stages of consecutive micro-clusters (or nodes of one);
stage k holds MoE layers k L/p .. (k+1) L/p - 1 with their blocks, laid out inside its
GPUs as the scenario lays out a whole cluster without pipelining (EP groups, replicas,
TP). Stage 0 holds the embedding, the last stage the output head.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.scenario.scenario import Scenario


def pipelined(s: Scenario) -> bool:
    return s.parallelism.pp_size > 1 or s.parallelism.pp_chunks > 1 or s.transformer.micro_batches > 1


def stage_scenario(s: Scenario) -> Scenario:
    """One pipeline stage as a scenario: its GPUs (1/p of the micro-clusters, or of the
    nodes of one), its L/p layers, one micro-batch of tokens, no pipeline."""
    p, c = s.parallelism.pp_size, s.cluster
    cluster = ({"microclusters": c.microclusters // p} if c.microclusters % p == 0
               else {"nodes_per_microcluster": c.nodes_per_microcluster // p})
    return s.replace(cluster=cluster, model={"num_layers": s.model.num_layers // p},
                     workload={"tokens_per_rank": s.workload.tokens_per_rank // s.transformer.micro_batches},
                     parallelism={"pp_size": 1, "pp_chunks": 1}, transformer={"micro_batches": 1})


@dataclass(frozen=True)
class StagePlace:
    """Where global rank ``rank`` sits: stage ``stage`` of ``stages``, whose ``ranks``
    GPUs start at global rank ``first``; its layers start at global layer ``first_layer``
    of ``layers``. Inside a stage ranks and layers are numbered from 0 (its scenario's)."""

    stages: int
    stage: int
    ranks: int
    first: int
    first_layer: int
    layers: int

    @property
    def local_rank(self) -> int:
        return self.rank - self.first

    rank: int = 0

    def global_rank(self, local: int, stage: int | None = None) -> int:
        """The global rank of local rank ``local`` of ``stage`` (default: this one)."""
        return (self.stage if stage is None else stage) * self.ranks + local

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.stages - 1


def stage_place(s: Scenario, rank: int) -> StagePlace:
    """Global rank ``rank``'s stage (module doc)."""
    p = s.parallelism.pp_size
    per = s.world_size // p
    stage = rank // per
    return StagePlace(p, stage, per, stage * per, stage * (s.model.num_layers // p), s.model.num_layers, rank)
