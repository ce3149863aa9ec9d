"""Pipeline stages (``parallelism.pp_size`` p, issues 13 and 25): which GPUs and layers each
stage holds, and the scenario a stage is on its own. Both backends place stages so: the
simulator simulates each distinct stage and schedules the pipeline (``sim.pipeline.run``),
the real backend runs each stage's ranks as that scenario (``real.rank.worker``, even
stages only: ``stage_scenario``, ``stage_place``).

GPUs: the cluster's nodes form p stages of consecutive, whole nodes (``stage_cluster``): a
stage is whole micro-clusters, or whole nodes of one micro-cluster; inside its GPUs it is
laid out as the scenario lays out a whole cluster without pipelining (EP groups, replicas,
TP).

Layers (``pipeline_layout``): Megatron-Core's layout (``testbed.layout.pipeline_layout``)
over the transformer's layers - ``transformer.first_dense_layers`` dense-first layers, then
``model.num_layers`` blocks of ``transformer.moe_every`` layers each ending in its MoE
layer, then the ``transformer.mtp_layers`` MTP modules - from ``parallelism.pipeline_layout``,
or ``decoder_first`` / ``decoder_last_pipeline_num_layers`` (Megatron's split with uneven
ends), or else the testbed's split since issue 13: each of the p x v chunks
(``parallelism.pp_chunks`` v) takes L / (p v) blocks, the dense-first layers go with the
first chunk, the MTP modules and the loss with the last (Megatron's even split when there
are no dense-first layers). The embedding is on the first chunk, the output head and the
loss on the last, and nowhere else. A chunk holds whole blocks (its MoE layer with the
``moe_every - 1`` dense layers before it), and every pipeline rank at least one MoE layer:
the simulator times a stage through its MoE layers.

What a pipeline rank runs (``RankStages``): its chunks in the order the schedule names
them - chunk c of v for 1F1B and the interleaved schedule (model-order stage c p + r);
with DualPipe (``parallelism.pipeline_schedule = "dualpipe"``, DeepSeek-V3 §3.2.1) the
model's chunk r for the direction fed in at stage 0 and chunk p-1-r for the other, so each
rank holds two chunks' weights (``sim.pipeline.dualpipe.PARAMETER_COPIES``). Ranks that hold
the same layers (``RankStages.mix``: dense-first, MoE and MTP layers) are one simulated
stage (``PipelineStages``), whatever their embedding, head or split into chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.core.errors import ScenarioError
from testbed.layout.pipeline_layout import (
    LAYOUT_FIELD,
    PipelineLayout,
    default_pipeline_layout,
    parse_pipeline_layout,
)
from testbed.scenario.scenario import Scenario

FIRST_FIELD = "parallelism.decoder_first_pipeline_num_layers"
LAST_FIELD = "parallelism.decoder_last_pipeline_num_layers"
SCHEDULE_FIELD = "parallelism.pipeline_schedule"


def pipelined(s: Scenario) -> bool:
    return s.parallelism.pp_size > 1 or s.parallelism.pp_chunks > 1 or s.transformer.micro_batches > 1


def dualpipe(s: Scenario) -> bool:
    return s.parallelism.pipeline_schedule == "dualpipe"


def layout_fields_used(s: Scenario) -> bool:
    """Whether the scenario names its layers' split (a layout string or uneven first / last stages)."""
    p = s.parallelism
    return bool(p.pipeline_layout) or p.decoder_first_pipeline_num_layers > 0 or p.decoder_last_pipeline_num_layers > 0


# ---- GPUs -----------------------------------------------------------------------------------
def stage_cluster(s: Scenario) -> dict:
    """The ``[cluster]`` of one stage: 1/p of the nodes, whole micro-clusters or whole nodes of
    one (module doc); a ScenarioError on ``parallelism.pp_size`` where the nodes do not split so."""
    p, c = s.parallelism.pp_size, s.cluster
    nodes = c.microclusters * c.nodes_per_microcluster
    if nodes % p:
        raise ScenarioError("parallelism.pp_size", p, f"stages are whole nodes: it must divide the cluster's "
                            f"{nodes} nodes (cluster.microclusters x nodes_per_microcluster)")
    per = nodes // p
    if per % c.nodes_per_microcluster == 0:
        return {"microclusters": per // c.nodes_per_microcluster}
    if c.nodes_per_microcluster % per == 0:
        return {"microclusters": 1, "nodes_per_microcluster": per}
    raise ScenarioError("parallelism.pp_size", p, f"a stage of {per} nodes would hold parts of two micro-clusters "
                        f"of cluster.nodes_per_microcluster = {c.nodes_per_microcluster}: a stage is whole "
                        f"micro-clusters or whole nodes of one")


def stage_scenario(s: Scenario) -> Scenario:
    """One pipeline stage of an even split as a scenario (the real backend's): its GPUs
    (``stage_cluster``), its L/p layers, one micro-batch of tokens, no pipeline."""
    return s.replace(cluster=stage_cluster(s), model={"num_layers": s.model.num_layers // s.parallelism.pp_size},
                     workload={"tokens_per_rank": s.workload.tokens_per_rank // s.transformer.micro_batches},
                     parallelism={"pp_size": 1, "pp_chunks": 1}, transformer={"micro_batches": 1})


# ---- layers ---------------------------------------------------------------------------------
def transformer_layers(s: Scenario) -> int:
    """The transformer's layers as Megatron counts them (``t`` in a layout): the dense-first ones
    and ``moe_every`` per MoE layer (DeepSeek-V3: 3 + 58 = 61), the MTP modules aside."""
    t = s.transformer
    return t.first_dense_layers + s.model.num_layers * t.moe_every


def _mtp(s: Scenario) -> int:
    return s.transformer.mtp_layers if s.transformer.enabled else 0


def _block_split(s: Scenario) -> PipelineLayout:
    """The testbed's split (module doc): L / (p v) blocks a chunk, dense-first ones on the first."""
    p, t = s.parallelism, s.transformer
    chunks = p.pp_size * p.pp_chunks
    if s.model.num_layers % chunks:
        raise ScenarioError("model.num_layers", s.model.num_layers,
                            f"is not a multiple of parallelism.pp_size x pp_chunks = {chunks} (or give "
                            f"{LAYOUT_FIELD} or {FIRST_FIELD} / {LAST_FIELD})")
    stages = ["t" * (s.model.num_layers // chunks * t.moe_every)] * chunks
    stages[0] = "E" + "t" * t.first_dense_layers + stages[0]
    stages[-1] += "m" * _mtp(s) + "L"
    source = f"{s.model.num_layers // chunks} MoE layers a chunk over {p.pp_size} x {p.pp_chunks}" + \
        (f", the {t.first_dense_layers} dense-first layers on the first" if t.first_dense_layers else "")
    lay = parse_pipeline_layout("|".join(stages), p.pp_size, transformer_layers(s), _mtp(s))
    return PipelineLayout(lay.pp_size, lay.vpp_size, lay.stages, source)


def pipeline_layout(s: Scenario) -> PipelineLayout:
    """Which layers each (pipeline rank, virtual chunk) holds (module doc); a ScenarioError naming
    the field where the layout cannot be run."""
    p = s.parallelism
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if p.pipeline_layout:
        if first or last:
            field, value = (FIRST_FIELD, first) if first else (LAST_FIELD, last)
            raise ScenarioError(field, value, f"a layout string ({LAYOUT_FIELD}) already says each stage's layers")
        lay = parse_pipeline_layout(p.pipeline_layout, p.pp_size, transformer_layers(s), _mtp(s))
        if lay.vpp_size != p.pp_chunks:
            raise ScenarioError("parallelism.pp_chunks", p.pp_chunks,
                                f"{LAYOUT_FIELD} = {p.pipeline_layout!r} has {len(lay.stages)} stages over pp_size "
                                f"{p.pp_size}: {lay.vpp_size} virtual chunks per rank")
        return lay
    if first or last:
        return default_pipeline_layout(transformer_layers(s), p.pp_size, p.pp_chunks, _mtp(s),
                                       first or None, last or None)
    return _block_split(s)


@dataclass(frozen=True)
class ChunkStage:
    """One model chunk's share of the transformer: ``dense_first`` of the dense-first layers,
    ``moe`` MoE layers with their blocks (the global ids of its first: ``first_moe``), ``mtp``
    MTP modules, the input ``embedding``, the output head and ``loss``; ``layers`` its
    transformer layers (``t`` in a layout)."""

    dense_first: int = 0
    moe: int = 0
    first_moe: int = 0
    mtp: int = 0
    embedding: bool = False
    loss: bool = False
    layers: int = 0


@dataclass(frozen=True)
class RankStages:
    """What pipeline rank ``rank`` runs: its chunks (``ChunkStage``) in the schedule's order
    (module doc)."""

    rank: int
    chunks: tuple[ChunkStage, ...]

    @property
    def mix(self) -> tuple[int, int, int]:
        """(dense-first, MoE, MTP) layers it holds: ranks with the same are one simulated stage."""
        return (sum(c.dense_first for c in self.chunks), sum(c.moe for c in self.chunks),
                sum(c.mtp for c in self.chunks))

    @property
    def layers(self) -> int:
        """Its transformer layers (Megatron's count, the MTP modules aside)."""
        return sum(c.layers for c in self.chunks)

    @property
    def embedding(self) -> bool:
        return any(c.embedding for c in self.chunks)

    @property
    def loss(self) -> bool:
        return any(c.loss for c in self.chunks)


def _chunk_stage(s: Scenario, lay: PipelineLayout, index: int, field: str, value) -> ChunkStage:
    """Model-order stage ``index`` of ``lay`` as a ``ChunkStage``; a ScenarioError on ``field``
    when it splits a block."""
    t = s.transformer
    items = lay.stages[index]
    ids = [it.index for it in items if it.kind == "decoder"]
    dense = [i for i in ids if i < t.first_dense_layers]
    rest = [i - t.first_dense_layers for i in ids if i >= t.first_dense_layers]
    if rest and (rest[0] % t.moe_every or (rest[-1] + 1) % t.moe_every):
        rank, chunk = lay.placement(index)
        raise ScenarioError(field, value, f"stage {index} (pipeline rank {rank}, chunk {chunk}) holds transformer "
                            f"layers {ids[0]} .. {ids[-1]}: with transformer.moe_every = {t.moe_every} a stage "
                            f"holds whole blocks (an MoE layer and the {t.moe_every - 1} dense layers before it)")
    kinds = {it.kind for it in items}
    return ChunkStage(dense_first=len(dense), moe=len(rest) // t.moe_every,
                      first_moe=rest[0] // t.moe_every if rest else 0,
                      mtp=sum(it.kind == "mtp" for it in items), embedding="embedding" in kinds,
                      loss="loss" in kinds, layers=len(ids))


def _layout_field(s: Scenario) -> tuple[str, object]:
    p = s.parallelism
    if p.pipeline_layout:
        return LAYOUT_FIELD, p.pipeline_layout
    if p.decoder_first_pipeline_num_layers:
        return FIRST_FIELD, p.decoder_first_pipeline_num_layers
    if p.decoder_last_pipeline_num_layers:
        return LAST_FIELD, p.decoder_last_pipeline_num_layers
    return "parallelism.pp_size", p.pp_size


def pipeline_ranks(s: Scenario) -> tuple[RankStages, ...]:
    """Every pipeline rank's chunks (module doc), checked."""
    check_dualpipe(s)
    lay = pipeline_layout(s)
    field, value = _layout_field(s)
    p = lay.pp_size
    if dualpipe(s):
        order = [(r, p - 1 - r) for r in range(p)]  # model chunk r forward-fed, p - 1 - r the other way
    else:
        order = [tuple(lay.stage_index(r, c) for c in range(lay.vpp_size)) for r in range(p)]
    ranks = tuple(RankStages(r, tuple(_chunk_stage(s, lay, i, field, value) for i in idx))
                  for r, idx in enumerate(order))
    for r in ranks:
        if not r.mix[1]:
            raise ScenarioError(field, value, f"pipeline rank {r.rank} holds no MoE layer: the simulator times a "
                                "stage through its MoE layers")
    return ranks


def check_dualpipe(s: Scenario) -> None:
    """DualPipe's refusals (``DualPipe.step``'s asserts, DeepSeek-V3 §3.2.1), naming the fields."""
    if not dualpipe(s):
        return
    p, m = s.parallelism.pp_size, s.transformer.micro_batches
    if p % 2:
        raise ScenarioError("parallelism.pp_size", p, f"{SCHEDULE_FIELD} = 'dualpipe' feeds micro-batches in "
                            "from both ends: it needs an even number of stages")
    if s.parallelism.pp_chunks > 1:
        raise ScenarioError("parallelism.pp_chunks", s.parallelism.pp_chunks, f"{SCHEDULE_FIELD} = 'dualpipe' runs "
                            "one chunk per direction on each stage (two in all): leave pp_chunks = 1")
    if m % 2 or m < 2 * p:
        raise ScenarioError("transformer.micro_batches", m, f"{SCHEDULE_FIELD} = 'dualpipe' needs an even "
                            f"number of micro-batches, at least 2 x parallelism.pp_size = {2 * p}")


def check_pipeline(s: Scenario) -> None:
    """Every refusal of a pipelined scenario's stages (GPUs, layout, schedule), or of a layout
    field given without a pipeline; nothing for a scenario that names none."""
    if not (pipelined(s) or layout_fields_used(s) or dualpipe(s)):
        return
    if not s.transformer.enabled:  # the scenario itself refuses pipelines without it
        field, value = _layout_field(s) if layout_fields_used(s) else (SCHEDULE_FIELD, "dualpipe")
        raise ScenarioError(field, value, "pipeline layouts and schedules are the whole transformer's: "
                            "set transformer.enabled = true")
    pipeline_ranks(s)
    if pipelined(s):
        stage_cluster(s)


@dataclass(frozen=True)
class PipelineStages:
    """The stages the simulator simulates for scenario ``whole`` (module doc): ``ranks`` every
    pipeline rank's chunks; ``scenarios`` one stage scenario per distinct layer mix, rank 0's
    first; ``simulated[r]`` the one rank r runs."""

    whole: Scenario
    layout: PipelineLayout
    ranks: tuple[RankStages, ...]
    scenarios: tuple[Scenario, ...]
    simulated: tuple[int, ...]

    @classmethod
    def of(cls, whole: Scenario) -> PipelineStages:
        ranks = pipeline_ranks(whole)
        mixes: list[tuple[int, int, int]] = []
        for r in ranks:
            if r.mix not in mixes:
                mixes.append(r.mix)
        scenarios = tuple(rank_scenario(whole, mix) for mix in mixes)
        return cls(whole, pipeline_layout(whole), ranks, scenarios, tuple(mixes.index(r.mix) for r in ranks))

    def ranks_of(self, k: int) -> list[int]:
        """The pipeline ranks simulated as ``scenarios[k]``."""
        return [r for r, i in enumerate(self.simulated) if i == k]


def rank_scenario(s: Scenario, mix: tuple[int, int, int]) -> Scenario:
    """The stage scenario of a pipeline rank holding ``mix`` = (dense-first, MoE, MTP) layers: its
    GPUs (``stage_cluster``), those layers, one micro-batch of tokens, no pipeline. Its layers
    are numbered from 0: the dense-first ones before its first MoE layer, the MTP modules after
    its last."""
    dense_first, moe, mtp = mix
    return s.replace(cluster=stage_cluster(s), model={"num_layers": moe},
                     workload={"tokens_per_rank": s.workload.tokens_per_rank // s.transformer.micro_batches},
                     parallelism={"pp_size": 1, "pp_chunks": 1, "pipeline_layout": "",
                                  "decoder_first_pipeline_num_layers": 0, "decoder_last_pipeline_num_layers": 0,
                                  "pipeline_schedule": "1f1b"},
                     transformer={"micro_batches": 1, "first_dense_layers": dense_first, "mtp_layers": mtp})


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
    """Global rank ``rank``'s stage in an even split (module doc)."""
    p = s.parallelism.pp_size
    per = s.world_size // p
    stage = rank // per
    return StagePlace(p, stage, per, stage * per, stage * (s.model.num_layers // p), s.model.num_layers, rank)
