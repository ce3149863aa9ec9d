"""The scenario: everything one run needs, as one TOML file with a default for every field.

A scenario is its sections (``testbed.scenario.sections``: model, cluster, parallelism,
router, pager, heat, comm, overlap, workload, run, checkpoint, sim, real, transformer),
its faults and its notes. Validation of a single field sits next to the field; the checks
across fields are ``Scenario.validate``. Every error is a ``ScenarioError`` naming the
dotted field and the value.

**The batch.** Each GPU routes ``workload.tokens_per_rank`` tokens per step and MoE layer in
``transformer.micro_batches`` micro-batches. With ``workload.global_batch`` > 0 both are
derived from the batch as Megatron-Core defines it (``testbed.layout.batch.megatron_batch``:
``global_batch`` sequences of ``transformer.seq_len`` a step, ``workload.micro_batch_size``
of them a micro-batch of each data-parallel rank) when the scenario is built
(``resolve_batch``), so the resolved scenario states them and everything downstream reads
them as it always has.

**Sequences.** Attention spans whole sequences of ``transformer.seq_len``. Without tensor
parallelism, or with it but without sequence parallelism, each GPU's tokens of a
micro-batch are whole sequences of its own. With ``parallelism.tp_size`` t > 1 and
``sequence_parallel`` a TP group shares its micro-batch (Megatron-Core): its t x
tokens_per_rank / micro_batches tokens must be whole sequences, each GPU holding the
next 1/t of them in member order (rank 0 of the group the first), all-gathered in that
order before every attention. Megatron-Core splits each sequence of a micro-batch by
position over the t GPUs instead (``[s, b, h]`` along s): with one sequence a micro-batch
the rows are the same; with more, each GPU holds as many of the micro-batch's tokens either
way (what the simulator counts), other positions of them. With ``parallelism.cp_size`` c > 1
a CP rank's rows (its TP group's) hold chunks r and 2c - 1 - r of each of its CP group's
sequences, seq_len / c rows a sequence (``_check_context_parallel``;
``testbed.policy.context_parallel``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from testbed.core.errors import ScenarioError
from testbed.layout.batch import megatron_batch
from testbed.scenario.fields import build_section, unknown
from testbed.scenario.presets import fill_model_tables
from testbed.scenario.router_checks import check_router
from testbed.scenario.sections import (
    SECTIONS,
    CheckpointConfig,
    ClusterConfig,
    CommConfig,
    FaultConfig,
    HeatConfig,
    ModelConfig,
    OverlapConfig,
    PagerConfig,
    ParallelismConfig,
    RealConfig,
    RouterConfig,
    RunConfig,
    SimConfig,
    TransformerConfig,
    WorkloadConfig,
)
from testbed.scenario.topology import Layout


@dataclass
class Scenario:
    """A whole run description. Build with ``Scenario.from_dict`` / ``load_scenario``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    pager: PagerConfig = field(default_factory=PagerConfig)
    heat: HeatConfig = field(default_factory=HeatConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    real: RealConfig = field(default_factory=RealConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    transformer: TransformerConfig = field(default_factory=TransformerConfig)
    faults: list[FaultConfig] = field(default_factory=list)
    notes: str = ""

    # ---- derived sizes -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.cluster.gpus

    @property
    def replicas(self) -> int:
        """EP groups = replicas of every expert."""
        return self.cluster.gpus // self.parallelism.ep_size

    @property
    def experts_per_rank(self) -> int:
        return self.model.num_experts // self.parallelism.ep_size

    # ---- building --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> "Scenario":
        """Build and validate a scenario from a parsed TOML mapping."""
        if not isinstance(data, dict):
            raise ScenarioError("scenario", data, "expected a table of sections")
        data = fill_model_tables(data)  # model.preset / model.config: what the scenario states wins
        sections = {}
        for name, value in data.items():
            if name == "notes":
                if not isinstance(value, str):
                    raise ScenarioError("notes", value, "expected a string")
                continue
            if name == "faults":
                if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                    raise ScenarioError("faults", value, "expected [[faults]] tables")
                sections["faults"] = [build_section(f"faults[{i}]", FaultConfig, v) for i, v in enumerate(value)]
                continue
            if name not in SECTIONS:
                raise ScenarioError(name, value, unknown(name, list(SECTIONS) + ["faults", "notes"], "section"))
            if not isinstance(value, dict):
                raise ScenarioError(name, value, "expected a table [" + name + "]")
            sections[name] = build_section(name, SECTIONS[name], value)
        scenario = cls(**sections, notes=data.get("notes", ""))
        resolve_batch(scenario, data)
        scenario.validate()
        return scenario

    def to_dict(self) -> dict:
        """Plain mapping of every field (the resolved scenario written into a run)."""
        out = dataclasses.asdict(self)
        for optional in ("notes", "faults"):
            if not out[optional]:
                del out[optional]
        return out

    def replace(self, **changes: dict) -> "Scenario":
        """A copy with some fields changed: ``s.replace(comm={"token_strategy": "allgather"})``.

        With ``workload.global_batch`` > 0 the fields it derives (``DERIVED_BY_BATCH``) are
        derived again for the copy (a change of ``parallelism.tp_size`` or ``cluster`` changes
        them), unless the changes give one of them and not ``global_batch``: then the copy
        runs those per-GPU figures, with ``global_batch = 0`` (what a pipeline stage's
        scenario does, ``testbed.policy.pipeline_stages``)."""
        data = self.to_dict()
        if self.workload.global_batch:
            given = any(key in changes.get(section, {}) for section, key in DERIVED_BY_BATCH)
            if given and "global_batch" not in changes.get("workload", {}):
                data["workload"].update(global_batch=0, micro_batch_size=1)
            else:
                for section, key in DERIVED_BY_BATCH:
                    del data[section][key]
        for section, fields in changes.items():
            data.setdefault(section, {}).update(fields)
        return Scenario.from_dict(data)

    # ---- checks across fields --------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ScenarioError`` for the first field whose value cannot be run."""
        m, c, p = self.model, self.cluster, self.parallelism
        if m.top_k > m.num_experts:
            raise ScenarioError("model.top_k", m.top_k, f"exceeds model.num_experts = {m.num_experts}")
        if c.gpus % p.ep_size:
            raise ScenarioError("parallelism.ep_size", p.ep_size, f"does not divide the {c.gpus} GPUs of the cluster")
        if m.num_experts % p.ep_size:
            raise ScenarioError("parallelism.ep_size", p.ep_size, f"does not divide model.num_experts = {m.num_experts}")
        if self.run.warmup_steps >= self.run.steps:
            raise ScenarioError("run.warmup_steps", self.run.warmup_steps, f"leaves no measured step of run.steps = {self.run.steps}")
        h = self.heat
        if h.alpha + h.beta + h.gamma <= 0:
            raise ScenarioError("heat.alpha", h.alpha, "heat weights alpha, beta, gamma are all zero")
        if h.cold_percentile >= h.hot_percentile:
            raise ScenarioError("heat.cold_percentile", h.cold_percentile, f"must be below heat.hot_percentile = {h.hot_percentile}")
        if self.pager.page_size_bytes % m.dtype_bytes:
            raise ScenarioError("pager.page_size_bytes", self.pager.page_size_bytes, f"is not a whole number of {m.dtype} elements")
        if 0 < self.pager.gpu_budget_bytes < self.pager.page_size_bytes:
            raise ScenarioError("pager.gpu_budget_bytes", self.pager.gpu_budget_bytes, "holds less than one page")
        if self.comm.token_strategy in ("hierarchical", "deepep"):  # both see an EP group as nodes x members
            Layout(self).check_node_grid(self.comm.token_strategy)
        check_router(self.router, m.num_experts, m.top_k)
        if self.real.network == "emulated" and self.real.device == "cuda":
            raise ScenarioError("real.network", "emulated", "an emulated cluster carries CPU ranks (gloo); "
                                "set real.device = cpu or auto")
        for i, f in enumerate(self.faults):
            _check_fault(f"faults[{i}]", f, self.world_size)
        t = self.transformer
        if p.tp_size > 1 and not t.enabled:
            raise ScenarioError("parallelism.tp_size", p.tp_size, "tensor parallelism splits the whole transformer's "
                                "dense layers: set transformer.enabled = true")
        if c.gpus_per_node % p.tp_size:
            raise ScenarioError("parallelism.tp_size", p.tp_size, f"does not divide cluster.gpus_per_node = {c.gpus_per_node}")
        if t.enabled and p.tp_size > 1:
            for name, value in (("transformer.num_heads", t.num_heads), ("transformer.num_kv_heads", t.kv_heads),
                                ("transformer.vocab_size", t.vocab_size),
                                ("transformer.dense_ffn_hidden_size", t.dense_ffn_hidden_size or 4 * m.hidden_size)):
                if value % p.tp_size:
                    raise ScenarioError(name, value, f"is not a multiple of parallelism.tp_size = {p.tp_size}")
        if p.cp_size > 1:
            _check_context_parallel(self)
        _check_pipeline(self)
        _check_tp_comm_overlap(self)
        if t.enabled:
            if m.hidden_size % t.num_heads and not t.head_dim:  # a head dimension of its own needs no split of H
                raise ScenarioError("transformer.num_heads", t.num_heads, f"does not divide model.hidden_size = {m.hidden_size}")
            if t.num_heads % t.kv_heads:
                raise ScenarioError("transformer.num_kv_heads", t.num_kv_heads, f"does not divide transformer.num_heads = {t.num_heads}")
            _check_sequences(self)


def _check_pipeline(s: "Scenario") -> None:
    """Pipeline parallelism and micro-batches (simulated: ``sim.pipeline.run``)."""
    p, t, c, m = s.parallelism, s.transformer, s.cluster, s.model
    pipelined = p.pp_size > 1 or p.pp_chunks > 1 or t.micro_batches > 1
    if pipelined and not t.enabled:
        name, value = next((n, v) for n, v in (("parallelism.pp_size", p.pp_size), ("parallelism.pp_chunks", p.pp_chunks),
                                               ("transformer.micro_batches", t.micro_batches)) if v > 1)
        raise ScenarioError(name, value, "pipelines and micro-batches are the whole transformer's: "
                            "set transformer.enabled = true")
    if not pipelined:
        return
    nodes = c.microclusters * c.nodes_per_microcluster
    per = nodes // p.pp_size  # a stage's nodes: whole micro-clusters, or whole nodes of one
    if nodes % p.pp_size or (per % c.nodes_per_microcluster and c.nodes_per_microcluster % per):
        raise ScenarioError("parallelism.pp_size", p.pp_size, f"stages are whole nodes, whole micro-clusters or "
                            f"whole nodes of one: it must divide the cluster's {nodes} nodes so "
                            f"(cluster.microclusters = {c.microclusters} of nodes_per_microcluster = "
                            f"{c.nodes_per_microcluster})")
    # a layout string or uneven first / last stages say each stage's layers (the simulator checks
    # them: testbed.policy.pipeline_stages.check_pipeline)
    uneven = p.pipeline_layout or p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers
    if not uneven and m.num_layers % (p.pp_size * p.pp_chunks):
        raise ScenarioError("model.num_layers", m.num_layers,
                            f"is not a multiple of parallelism.pp_size x pp_chunks = {p.pp_size * p.pp_chunks}")
    if p.pp_chunks > 1 and t.micro_batches % p.pp_size:
        raise ScenarioError("transformer.micro_batches", t.micro_batches,
                            f"the interleaved schedule needs a multiple of parallelism.pp_size = {p.pp_size}")
    tokens = s.workload.tokens_per_rank
    # with context parallelism a CP rank's rows of a micro-batch are checked by _check_context_parallel
    whole_sequences = p.cp_size == 1
    if whole_sequences and shares_sequences(s):  # the TP group's micro-batch, not each GPU's, is whole sequences
        if tokens % t.micro_batches or p.tp_size * (tokens // t.micro_batches) % t.seq_len:
            raise ScenarioError("transformer.micro_batches", t.micro_batches, f"workload.tokens_per_rank = "
                                f"{tokens}: a micro-batch of the tensor-parallel group, parallelism.tp_size x "
                                f"tokens_per_rank / micro_batches = {p.tp_size} x {tokens} / {t.micro_batches}, "
                                f"is not a whole number of transformer.seq_len = {t.seq_len} sequences")
    elif whole_sequences and tokens % (t.micro_batches * t.seq_len):
        raise ScenarioError("transformer.micro_batches", t.micro_batches, f"workload.tokens_per_rank = "
                            f"{tokens} is not a multiple of micro_batches x seq_len")
    # a trace (workload.trace) is replayed micro-batch by micro-batch on each pipeline rank; its
    # shape (a stage's ranks, each micro-batch's counts) is checked where it is read
    # (testbed.run.routing_trace.RoutingTrace.check_fits)
    refused = (("pager.enabled", s.pager.enabled,
                "paging is not modelled there: the pager would need each stage's page accesses, prefetches "
                "and evictions decided micro-batch by micro-batch in that stage's 1F1B order (the simulator "
                "times one micro-batch a stage), a layer's pages kept until every micro-batch in flight that "
                "used them has run its backward, and the page copies timed across the interleaved forwards "
                "and backwards"),
               ("overlap.micro_batches", s.overlap.micro_batches if s.overlap.micro_batches > 1 else 0,
                "M22's micro-batches inside a layer are not combined with the pipeline's"))
    for name, value, why in refused:
        if value:
            raise ScenarioError(name, value, f"with pipeline parallelism or transformer.micro_batches: {why}")


def shares_sequences(s: "Scenario") -> bool:
    """A tensor-parallel group shares its micro-batch's sequences (module doc): the whole
    transformer with ``parallelism.tp_size`` > 1 and ``sequence_parallel``."""
    return s.transformer.enabled and s.parallelism.tp_size > 1 and s.parallelism.sequence_parallel


def holds_part_of_a_sequence(s: "Scenario") -> bool:
    """Each GPU's tokens of a micro-batch are not whole sequences (its TP group's are)."""
    t = s.transformer
    return t.enabled and (s.workload.tokens_per_rank // t.micro_batches) % t.seq_len != 0


def _check_tp_comm_overlap(s: "Scenario") -> None:
    """``overlap.tp_comm`` overlaps sequence parallelism's collectives: Megatron-Core asserts
    "Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is
    enabled" (megatron/training/arguments.py)."""
    if s.overlap.tp_comm and not shares_sequences(s):
        raise ScenarioError("overlap.tp_comm", True, "overlaps sequence parallelism's all-gathers and reduce-"
                            "scatters: it needs transformer.enabled, parallelism.tp_size > 1 and sequence_parallel")


def _check_sequences(s: "Scenario") -> None:
    """Attention's sequences are whole (module doc): each GPU's tokens, or with sequence
    parallelism its tensor-parallel group's; what needs each GPU's own sequences is refused
    where they are not."""
    t, tokens = s.transformer, s.workload.tokens_per_rank
    if s.parallelism.cp_size > 1:
        return  # the CP ranks' chunks of sequences: _check_context_parallel
    share = s.parallelism.tp_size if shares_sequences(s) else 1  # GPUs whose tokens attention sees together
    if share == 1 and tokens % t.seq_len:
        raise ScenarioError("transformer.seq_len", t.seq_len, f"does not divide workload.tokens_per_rank = {tokens}")
    if share * tokens % t.seq_len:
        raise ScenarioError("transformer.seq_len", t.seq_len, f"does not divide the tensor-parallel group's tokens "
                            f"a step, parallelism.tp_size x workload.tokens_per_rank = {share} x {tokens}")


def _check_context_parallel(s: "Scenario") -> None:
    """Context parallelism (``parallelism.cp_size`` > 1, ``testbed.policy.context_parallel``):
    each sequence in 2 cp chunks over the cp GPUs of a group, the CP rank's rows of a
    micro-batch (its TP group's, tp x tokens_per_rank / micro_batches) whole shares of
    seq_len / cp of sequences; what the ring as Megatron-Core and Transformer Engine run it
    (cp_comm_type p2p) does not take, or the testbed does not model with it, is refused."""
    p, t, w = s.parallelism, s.transformer, s.workload
    cp, tp = p.cp_size, p.tp_size
    if not t.enabled:
        raise ScenarioError("parallelism.cp_size", cp, "context parallelism splits sequences, which the MoE stack "
                            "alone has none of: set transformer.enabled = true")
    if s.cluster.gpus % (tp * cp):
        raise ScenarioError("parallelism.cp_size", cp, f"with tp_size = {tp}: tp x cp = {tp * cp} does not divide "
                            f"the {s.cluster.gpus} GPUs of the cluster")
    if t.seq_len % (2 * cp):  # megatron/training/arguments.py asserts it
        raise ScenarioError("transformer.seq_len", t.seq_len, f"is not a multiple of 2 x parallelism.cp_size = "
                            f"{2 * cp} (context parallelism cuts each sequence into 2 x cp_size chunks)")
    if tp > 1 and not p.sequence_parallel:
        raise ScenarioError("parallelism.sequence_parallel", False, f"with parallelism.cp_size = {cp} and tp_size = "
                            f"{tp}: context parallelism is modelled with sequence parallelism (Megatron-Core's MoE "
                            "layers need it)")
    modules = [n.strip() for n in t.recompute_modules.split(",") if n.strip()]
    refused = (
        ("parallelism.pp_size", p.pp_size if p.pp_size > 1 else 0, "pipeline stages are not modelled with it"),
        # transformer_engine attn_forward_func_with_cp: neither with cp_comm_type p2p
        ("transformer.sliding_window", t.sliding_window, "Transformer Engine's p2p ring has no sliding window"),
        ("transformer.attention_sinks", t.attention_sinks, "Transformer Engine's p2p ring has only the vanilla "
         "softmax"),
        ("transformer.mtp_layers", t.mtp_layers, "the tokens an MTP module looks ahead to sit on other CP ranks "
         "(not modelled)"),
        ("transformer.recompute", t.recompute if t.recompute != "none" else 0, "recomputing attention runs the "
         "ring again (not modelled)"),
        ("transformer.recompute_modules", "core_attn" in modules and t.recompute_modules,
         "core_attn's recompute runs the ring again (not modelled)"))
    for name, value, why in refused:
        if value:
            raise ScenarioError(name, value, f"with parallelism.cp_size = {cp}: {why}")
    rows, local = tp * w.tokens_per_rank, t.seq_len // cp
    if w.tokens_per_rank % t.micro_batches or (rows // t.micro_batches) % local:
        raise ScenarioError("workload.tokens_per_rank", w.tokens_per_rank,
                            f"a CP rank's rows of a micro-batch, tp_size x tokens_per_rank / micro_batches = "
                            f"{tp} x {w.tokens_per_rank} / {t.micro_batches}, are not whole shares "
                            f"seq_len / cp_size = {local} of sequences")


#: the fields ``workload.global_batch`` > 0 derives (``resolve_batch``)
DERIVED_BY_BATCH = (("workload", "tokens_per_rank"), ("transformer", "micro_batches"))


def resolve_batch(s: "Scenario", stated: dict) -> None:
    """Derive ``workload.tokens_per_rank`` (the tokens each GPU routes per step and MoE
    layer) and ``transformer.micro_batches`` (micro-batches per step) from
    ``workload.global_batch`` and ``micro_batch_size`` with Megatron-Core's batch
    (``testbed.layout.batch.megatron_batch``: DP = GPUs / (tp x cp x pp) ranks, global /
    (DP x micro) micro-batches, micro x seq_len / (cp x tp) tokens routed a micro-batch).
    ``stated``: the scenario's tables as read; a derived field they state must agree."""
    w, t, p = s.workload, s.transformer, s.parallelism
    if not w.global_batch:
        if w.micro_batch_size != 1:
            raise ScenarioError("workload.micro_batch_size", w.micro_batch_size,
                                "is the batch's (workload.global_batch > 0); without one each GPU routes "
                                "workload.tokens_per_rank in transformer.micro_batches micro-batches")
        return
    if not t.enabled:
        raise ScenarioError("workload.global_batch", w.global_batch, "a batch of sequences is the whole "
                            "transformer's: set transformer.enabled = true (or give workload.tokens_per_rank)")
    batch = megatron_batch(w.global_batch, w.micro_batch_size, t.seq_len, s.cluster.gpus, p.tp_size, p.cp_size,
                           p.pp_size, p.sequence_parallel)
    derived = {"tokens_per_rank": batch.routed_tokens_per_step, "micro_batches": batch.micro_batches}
    for section, key in DERIVED_BY_BATCH:
        table = stated.get(section)
        value = derived[key]
        if isinstance(table, dict) and key in table and getattr(getattr(s, section), key) != value:
            raise ScenarioError(f"{section}.{key}", table[key],
                                f"workload.global_batch = {w.global_batch} sequences in micro-batches of "
                                f"workload.micro_batch_size = {w.micro_batch_size} on DP {batch.dp} gives "
                                f"{section}.{key} = {value}: give one or the other, or the same")
        setattr(getattr(s, section), key, value)


def _check_fault(path: str, f: "FaultConfig", world: int) -> None:
    if f.kind == "link_degraded" and not 0 < f.factor < 1:
        raise ScenarioError(f"{path}.factor", f.factor, "a degraded link keeps between 0 and 1 of its bandwidth")
    kind, _, index = f.target.partition(":")
    if f.kind == "gpu_lost" and kind != "gpu":
        raise ScenarioError(f"{path}.target", f.target, "a lost GPU is named gpu:N")
    if kind in ("gpu", "leaf") and not index.isdigit():
        raise ScenarioError(f"{path}.target", f.target, f"expected {kind}:N with N a number")
    if kind == "gpu" and int(index) >= world:
        raise ScenarioError(f"{path}.target", f.target, f"there are {world} GPUs")
    if kind not in ("gpu", "leaf", "nvlink", "nic", "spine", "pcie"):
        raise ScenarioError(f"{path}.target", f.target, "expected nvlink, nic, spine, pcie, leaf:M or gpu:N")


def field_docs() -> list[tuple[str, Any, str]]:
    """(dotted name, default, doc) for every scenario field, in file order."""
    rows = []
    for section, cls in list(SECTIONS.items()) + [("faults[]", FaultConfig)]:
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{section}.{f.name}", default, f.metadata["doc"]))
    return rows
