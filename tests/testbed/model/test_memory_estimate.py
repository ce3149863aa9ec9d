"""The closed-form lower bound of a layout's memory (``testbed.model.memory_estimate``): by hand
on a tiny model, and below the simulator's peak on the published runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.model.memory_estimate import (
    ACTIVATIONS,
    WEIGHTS,
    MemoryEstimate,
    in_flight,
    kept_rows_lower_bound,
    memory_lower_bound,
)
from testbed.model.whole_model import layer_activation_bytes, shape_of
from testbed.policy.pipeline_stages import pipeline_ranks, pipelined
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario

PUBLISHED = Path(__file__).resolve().parents[3] / "configs" / "published"


def tiny(**changes) -> Scenario:
    """4 GPUs (2 nodes of 2), 4 MoE layers of 4 gelu experts (H 64, F 128), top-2, dropless; GQA of
    4 heads of 16 (no grouping), vocab 100, untied; 8 sequences of 128 a step, EP 2."""
    d = {"model": {"hidden_size": 64, "ffn_hidden_size": 128, "num_layers": 4, "num_experts": 4, "top_k": 2,
                   "ffn_activation": "gelu", "dtype": "bf16"},
         "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1, "profile": "h100"},
         "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 4, "seq_len": 128, "vocab_size": 100,
                         "tied_embeddings": False, "zero_stage": 0},
         "parallelism": {"ep_size": 2}, "router": {"capacity_factor": 0.0},
         "workload": {"global_batch": 8, "micro_batch_size": 1},
         "pager": {"enabled": False}, "heat": {"enabled": False}, "comm": {"expert_sync": "allreduce"}}
    for key, value in changes.items():
        d[key] = {**d.get(key, {}), **value}
    return Scenario.from_dict(d)


def test_the_bound_of_a_tiny_model_by_hand():
    """Experts: 4 layers x 2 local x (2 x 64 x 128) x 2 B. Other weights: 4 attentions of 4 x 64 x 64,
    the embedding and the head 100 x 64 each, in bf16, and the routers 4 x (64 x 4 + 4) in fp32.
    Adam without ZeRO: 12 B for each of the 78,336 dense, 1,040 router and 131,072 expert parameters.
    Activations: one micro-batch (DP 4: 2 sequences a GPU, micro-batches of 1) of 128 tokens, per MoE
    layer its input (128 x 64 x 2 B), 2 x 128 rows of (64 + 2 x 128) x 2 B, and the layer's own."""
    e = memory_lower_bound(tiny())
    assert e.expert_weights == 4 * 2 * (2 * 64 * 128) * 2 == 262_144
    assert e.other_weights == (4 * 4 * 64 * 64 + 2 * 100 * 64) * 2 + 4 * (64 * 4 + 4) * 4 == 160_832
    assert e.optimizer_state == 12 * (78_336 + 1_040 + 131_072) == 2_525_376
    own = layer_activation_bytes(shape_of(tiny()), 128, 1, moe=True, sequence_parallel=True)
    assert e.in_flight == 1
    assert e.activations == 4 * (128 * 64 * 2 + 256 * 320 * 2 + own)


def test_zero_1_shards_the_state_and_a_pipeline_holds_its_stage():
    """ZeRO-1 on 4 GPUs: the dense state over 4, an expert's over its 2 replicas. PP 2 (a node a
    stage, EP 2 inside it): rank 0 holds 2 MoE layers, the embedding, and 2 micro-batches in flight
    (4 micro-batches: DP 2 x micro-batch 1 of 8 sequences); its state over the stage's 2 GPUs."""
    assert memory_lower_bound(tiny(transformer={"zero_stage": 1})).optimizer_state == \
        12 * ((78_336 + 1_040) / 4 + 131_072 / 2)
    s = tiny(parallelism={"pp_size": 2}, transformer={"zero_stage": 1})
    e = memory_lower_bound(s, pipeline_ranks(s))
    assert (e.rank, e.in_flight) == (0, 2)
    assert e.expert_weights == 2 * 2 * (2 * 64 * 128) * 2
    dense = 2 * 4 * 64 * 64 + 100 * 64
    assert e.other_weights == dense * 2 + 2 * 260 * 4
    assert e.optimizer_state == 12 * ((dense + 2 * 260) / 2 + 2 * 2 * 16_384 / 1)


def test_the_rows_are_counted_at_their_fewest():
    """128 tokens, top-2 of 4 experts at capacity factor 1: an expert keeps at most 64, so at
    least 2 x 64 kept (two experts taking every token); dropless keeps all 256; a capacity past
    the tokens keeps all too."""
    assert kept_rows_lower_bound(128, 2, 4, 1.0) == 128
    assert kept_rows_lower_bound(128, 2, 4, 0.0) == 256
    assert kept_rows_lower_bound(128, 2, 4, 4.0) == 256


def test_the_micro_batches_in_flight():
    """1F1B: rank r of 2 holds min(2 - r, m); interleaved (4 chunks on 2 ranks)
    (v - 1) min(p, m) + 1 = 7 chunk-micro-batches."""
    s = tiny(parallelism={"pp_size": 2})
    assert [in_flight(s, r) for r in (0, 1)] == [2, 1]
    v = tiny(parallelism={"pp_size": 2, "pp_chunks": 2}, model={"num_layers": 4})
    assert in_flight(v, 0) == (2 - 1) * 2 + 1


def test_the_overflowing_part_is_named():
    e = MemoryEstimate(0, 40e9, 10e9, 20e9, 30e9, 1)
    assert e.overflow(60e9) == WEIGHTS and e.overflow(80e9) == ACTIVATIONS and e.overflow(100e9) is None


FAST = sorted(p.name for p in PUBLISHED.glob("*.toml") if not p.name.startswith("deepseek-v3"))


@pytest.mark.parametrize("config", FAST)
def test_the_bound_is_below_the_simulated_peak_of_a_published_run(config, tmp_path):
    """The bound never prunes what the simulator says fits: on each published run (DeepSeek-V3's
    left out: tens of seconds each), one simulated step."""
    s = load_scenario(PUBLISHED / config, ["run.steps=1", "run.warmup_steps=0", f"run.output_dir={tmp_path}"])
    bound = memory_lower_bound(s, pipeline_ranks(s) if pipelined(s) else None)
    peak = run_scenario(s, "sim")["peak_memory_bytes"]
    assert 0 < bound.total <= peak
