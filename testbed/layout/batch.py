"""The batch as Megatron-Core defines it (issue 25, item 1): sequences, micro-batches, and
the tokens each GPU holds and routes.

A step trains ``global_batch`` sequences of ``seq_len`` tokens. Each of the DP data-parallel
ranks, DP = world / (TP x CP x PP), takes ``micro_batch`` sequences per micro-batch, so a step
has ``global_batch / (DP x micro_batch)`` micro-batches (NVIDIA/Megatron-LM
``megatron/core/num_microbatches_calculator.py``, ``ConstantNumMicroBatchesCalculator``, which
asserts that this divides; commit d98e8a64ddf34856e74b24714e3bedb2f5a39553, as all the
citations here).

A DP rank is a TP x CP group of GPUs at each pipeline stage: its CP ranks each take 1/CP of
every sequence, and a TP group shares its micro-batch, each TP rank seeing all of its
``micro_batch x seq_len / CP`` tokens inside the tensor-parallel sublayers. With sequence
parallelism each TP rank keeps only 1/TP of them between sublayers, split along the sequence
(``megatron/core/tensor_parallel/mappings.py``, ``_split_along_first_dim``, which needs
``seq_len / CP`` to divide by TP).

**Tokens an MoE layer routes on a GPU.** Megatron-Core's MoE layer takes the GPU's
sequence-parallel share, ``micro_batch x seq_len / (CP x TP)`` tokens, routes them there and
the token dispatcher sends them over the MoE layers' EP group, gathering over expert TP after
the all-to-all (``megatron/core/transformer/moe/token_dispatcher.py``,
``MoEAlltoAllTokenDispatcher``: "token dispatch: A2A(EP)", then "AG(TP)" over
``pg_collection.expt_tp``). That holds in both MoE layouts (the router sees the attention
side's shard whatever ETP and EP are). Without sequence parallelism, TP > 1 and MoE layers,
Megatron-Core refuses to train (``megatron/core/transformer/moe/moe_layer.py``,
``MoELayer.forward`` raises ValueError; ``model_parallel_config.py`` warns "sequence
parallelism must be used"); so does this module.

Today's scenarios give each GPU ``workload.tokens_per_rank`` tokens to route per step and
layer, in ``transformer.micro_batches`` micro-batches of whole sequences of its own
(``equivalent_batch`` converts them).
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.core.errors import ScenarioError
from testbed.layout.process_groups import data_parallel_size


@dataclass(frozen=True)
class MegatronBatch:
    """One step's batch on a layout. ``global_batch`` sequences per step over all DP ranks,
    ``micro_batch`` sequences per micro-batch of one DP rank, ``seq_len`` tokens per sequence,
    ``dp`` data-parallel ranks, ``micro_batches`` micro-batches per step on each DP rank."""

    global_batch: int
    micro_batch: int
    seq_len: int
    dp: int
    tp: int
    cp: int
    micro_batches: int

    @property
    def tokens_per_step(self) -> int:
        """Tokens the whole world trains on per step."""
        return self.global_batch * self.seq_len

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens of one micro-batch on each GPU, ``micro_batch x seq_len / CP``: its CP
        slice, which its TP group shares (each TP rank sees them all inside a sublayer)."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def routed_tokens_per_micro_batch(self) -> int:
        """Tokens of one micro-batch each GPU keeps between sublayers, its sequence-parallel
        share ``micro_batch x seq_len / (CP x TP)``, which are those its router takes per MoE
        layer (token_dispatcher.py)."""
        return self.micro_batch * self.seq_len // (self.cp * self.tp)

    @property
    def routed_tokens_per_step(self) -> int:
        """Tokens each GPU routes per MoE layer and step, all micro-batches together."""
        return self.routed_tokens_per_micro_batch * self.micro_batches


def _positive(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScenarioError(field, value, "must be a positive whole number")
    return value


def megatron_batch(global_batch: int, micro_batch: int, seq_len: int, world: int, tp: int = 1,
                   cp: int = 1, pp: int = 1, sequence_parallel: bool = True) -> MegatronBatch:
    """The batch of ``global_batch`` sequences (``workload.global_batch``) in micro-batches of
    ``micro_batch`` (``workload.micro_batch_size``) of ``seq_len`` tokens (``transformer.seq_len``)
    on ``world`` GPUs with the ``parallelism`` sizes. What Megatron-Core refuses raises a
    ScenarioError naming the field and its value."""
    _positive("workload.global_batch", global_batch)
    _positive("workload.micro_batch_size", micro_batch)
    _positive("transformer.seq_len", seq_len)
    dp = data_parallel_size(world, tp, cp, pp)
    if global_batch % (dp * micro_batch):
        raise ScenarioError("workload.global_batch", global_batch,
                            f"is not a multiple of workload.micro_batch_size x DP = {micro_batch} x {dp} "
                            f"(DP = {world} GPUs / (tp {tp} x cp {cp} x pp {pp}))")
    if cp > 1 and seq_len % (2 * cp):
        # megatron/training/arguments.py: CP cuts each sequence into 2 x CP chunks (load balance)
        raise ScenarioError("transformer.seq_len", seq_len,
                            f"is not a multiple of 2 x parallelism.cp_size = {2 * cp} "
                            "(context parallelism cuts each sequence into 2 x cp_size chunks)")
    if tp > 1 and not sequence_parallel:
        raise ScenarioError("parallelism.sequence_parallel", sequence_parallel,
                            f"Megatron-Core's MoE layers need sequence parallelism with tp_size = {tp} > 1")
    if tp > 1 and (seq_len // cp) % tp:
        raise ScenarioError("transformer.seq_len", seq_len,
                            f"sequence parallelism splits each GPU's seq_len / cp_size = {seq_len // cp} "
                            f"tokens of a sequence over parallelism.tp_size = {tp}, which does not divide them")
    return MegatronBatch(global_batch=global_batch, micro_batch=micro_batch, seq_len=seq_len, dp=dp,
                         tp=tp, cp=cp, micro_batches=global_batch // (dp * micro_batch))


@dataclass(frozen=True)
class BatchConversion:
    """Today's ``workload.tokens_per_rank`` as a Megatron batch: ``global_batch`` and
    ``micro_batch`` (sequences) when there is one, else both None; ``message`` the one line
    that says what it was converted to, or why it cannot be."""

    global_batch: int | None
    micro_batch: int | None
    message: str

    @property
    def converted(self) -> bool:
        return self.global_batch is not None


def equivalent_batch(tokens_per_rank: int, micro_batches: int, seq_len: int, world: int, tp: int = 1,
                     cp: int = 1, pp: int = 1, sequence_parallel: bool = True) -> BatchConversion:
    """The Megatron batch in which every GPU routes the same ``tokens_per_rank`` tokens per
    step and MoE layer in the same ``micro_batches`` micro-batches (``transformer.micro_batches``).

    A GPU routes ``micro x seq_len / (CP x TP)`` tokens a micro-batch, so
    ``micro = tokens_per_rank x CP x TP / (micro_batches x seq_len)`` sequences, and
    ``global = DP x micro_batches x micro = tokens_per_rank x world / (PP x seq_len)``: the
    same tokens per step as today's, where each GPU of a stage routes tokens of its own. A
    layout that is not whole raises (``data_parallel_size``); a batch that has no whole
    equivalent gives the reason in ``message``."""
    _positive("workload.tokens_per_rank", tokens_per_rank)
    _positive("transformer.micro_batches", micro_batches)
    _positive("transformer.seq_len", seq_len)
    dp = data_parallel_size(world, tp, cp, pp)
    given = (f"workload.tokens_per_rank = {tokens_per_rank} in transformer.micro_batches = {micro_batches} "
             f"of transformer.seq_len = {seq_len}")
    if tokens_per_rank % micro_batches:
        return BatchConversion(None, None, f"{given}: micro-batches of equal tokens need micro_batches "
                                           "to divide tokens_per_rank")
    share = tokens_per_rank // micro_batches  # tokens a GPU routes per micro-batch
    if (share * cp * tp) % seq_len:
        return BatchConversion(None, None, f"{given}: a micro-batch's {share} tokens on each GPU x tp {tp} x cp {cp} "
                                           f"is not a whole number of sequences")
    micro = share * cp * tp // seq_len
    try:
        batch = megatron_batch(dp * micro_batches * micro, micro, seq_len, world, tp, cp, pp, sequence_parallel)
    except ScenarioError as e:
        return BatchConversion(None, None, f"{given}: {e}")
    return BatchConversion(batch.global_batch, micro,
                           f"{given} converted to workload.global_batch = {batch.global_batch} and "
                           f"workload.micro_batch_size = {micro} (DP {dp}: each GPU still routes "
                           f"{batch.routed_tokens_per_step} tokens per step and MoE layer)")
