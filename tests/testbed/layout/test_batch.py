"""The batch in Megatron-Core's terms (testbed/layout/batch.py), with hand-worked numbers
from the published runs of issue 25."""

from __future__ import annotations

import pytest

from testbed.core.errors import ScenarioError
from testbed.layout.batch import equivalent_batch, megatron_batch


def test_megascale_megatron_lm_baseline():
    # MegaScale-MoE's Megatron-LM baseline: 1,440 GPUs, TP 8 + SP, PP 15 -> DP 1440 / 120 = 12;
    # global 720 sequences of 8,192: 720 / (12 x 1) = 60 micro-batches of one sequence
    b = megatron_batch(720, 1, 8192, world=1440, tp=8, pp=15)
    assert (b.dp, b.micro_batches) == (12, 60)
    assert b.tokens_per_micro_batch == 8192  # the TP group shares one sequence
    assert b.routed_tokens_per_micro_batch == 1024  # 8192 / 8 on each GPU between sublayers
    assert b.routed_tokens_per_step == 61_440  # 60 x 1024
    assert b.tokens_per_step == 5_898_240  # 720 x 8192


def test_deepseek_v3_on_2048_gpus():
    # 2,048 GPUs, PP 16, no TP -> DP 128; global 15,360 / 128 = 120 micro-batches of one sequence
    b = megatron_batch(15_360, 1, 4096, world=2048, pp=16)
    assert (b.dp, b.micro_batches) == (128, 120)
    assert b.routed_tokens_per_micro_batch == 4096
    assert b.routed_tokens_per_step == 491_520  # 120 x 4096


def test_qwen3_30b_on_16_gpus():
    # TP 1, PP 2 -> DP 8; global 512 in micro-batches of 2: 512 / 16 = 32
    b = megatron_batch(512, 2, 4096, world=16, pp=2)
    assert (b.dp, b.micro_batches) == (8, 32)
    assert b.tokens_per_micro_batch == 8192


def test_context_parallel_splits_each_sequence():
    # 16 GPUs, TP 2, CP 2, PP 2 -> DP 2; a micro-batch of one 4,096-token sequence:
    # 2,048 tokens on each CP rank, shared by its TP pair, 1,024 on each GPU between sublayers
    b = megatron_batch(8, 1, 4096, world=16, tp=2, cp=2, pp=2)
    assert (b.dp, b.micro_batches) == (2, 4)
    assert b.tokens_per_micro_batch == 2048
    assert b.routed_tokens_per_micro_batch == 1024


@pytest.mark.parametrize("args, kwargs, field, words", [
    ((100, 1, 8192), dict(world=1440, tp=8, pp=15), "workload.global_batch", ["1 x 12", "1440 GPUs"]),
    ((720, 7, 8192), dict(world=1440, tp=8, pp=15), "workload.global_batch", ["7 x 12"]),
    ((720, 0, 8192), dict(world=1440, tp=8, pp=15), "workload.micro_batch_size", ["positive"]),
    ((0, 1, 8192), dict(world=1440, tp=8, pp=15), "workload.global_batch", ["positive"]),
    ((720, 1, 0), dict(world=1440, tp=8, pp=15), "transformer.seq_len", ["positive"]),
    ((8, 1, 4098), dict(world=16, tp=2, cp=2, pp=2), "transformer.seq_len", ["2 x parallelism.cp_size = 4"]),
    ((720, 1, 8196), dict(world=1440, tp=8, pp=15), "transformer.seq_len", ["8196", "tp_size = 8"]),
    ((720, 1, 8192), dict(world=1440, tp=8, pp=15, sequence_parallel=False), "parallelism.sequence_parallel",
     ["tp_size = 8"]),
    ((720, 1, 8192), dict(world=1440, tp=8, pp=16), "parallelism.pp_size", ["128", "1440 GPUs"]),
])
def test_batches_megatron_refuses_name_the_field(args, kwargs, field, words):
    with pytest.raises(ScenarioError) as e:
        megatron_batch(*args, **kwargs)
    assert e.value.field == field
    for word in words:
        assert word in str(e.value)


def test_megascale_tokens_per_rank_converts_to_its_published_batch():
    # today's refused form of the baseline: each GPU routes 61,440 tokens in 60 micro-batches
    # of 8,192-token sequences; in Megatron a TP group of 8 shares one sequence
    c = equivalent_batch(61_440, 60, 8192, world=1440, tp=8, pp=15)
    assert c.converted
    assert (c.global_batch, c.micro_batch) == (720, 1)
    assert "workload.global_batch = 720" in c.message and "workload.micro_batch_size = 1" in c.message


def test_tokens_per_rank_without_tp_keeps_the_sequences_of_each_gpu():
    # 8 GPUs, PP 2 -> DP 4; 4,096 tokens a GPU in 4 micro-batches of 1,024-token sequences:
    # one sequence a micro-batch, global = 4 x 4 x 1 = 16 (= 4096 x 8 / (2 x 1024))
    c = equivalent_batch(4096, 4, 1024, world=8, pp=2)
    assert (c.global_batch, c.micro_batch) == (16, 1)


def test_tokens_per_rank_half_a_sequence_needs_a_tp_pair():
    no = equivalent_batch(256, 1, 512, world=4)
    assert not no.converted and no.global_batch is None and no.micro_batch is None
    assert "workload.tokens_per_rank = 256" in no.message and "whole number of sequences" in no.message
    yes = equivalent_batch(256, 1, 512, world=4, tp=2)  # two GPUs' 256 tokens: one 512-token sequence
    assert (yes.global_batch, yes.micro_batch) == (2, 1)


@pytest.mark.parametrize("args, kwargs, words", [
    ((1000, 3, 100), dict(world=4), ["transformer.micro_batches = 3", "divide"]),
    ((513, 1, 1026), dict(world=8, tp=4), ["transformer.seq_len = 1026"]),
    ((4096, 4, 1024), dict(world=8, tp=2, sequence_parallel=False), ["parallelism.sequence_parallel"]),
])
def test_tokens_per_rank_without_an_equivalent_gives_the_reason(args, kwargs, words):
    c = equivalent_batch(*args, **kwargs)
    assert not c.converted
    for word in words:
        assert word in c.message


def test_conversion_of_a_layout_that_is_not_whole_raises():
    with pytest.raises(ScenarioError) as e:
        equivalent_batch(4096, 4, 1024, world=12, tp=8)
    assert e.value.field == "parallelism.pp_size"
