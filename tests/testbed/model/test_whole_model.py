"""Closed forms of a whole transformer's step (testbed/model/whole_model.py): about 6 x
parameters x tokens FLOPs for a dense training step, 16 bytes per parameter for
mixed-precision Adam (and ZeRO's shards of it), the 1F1B bubble (p - 1) / (m + p - 1),
activation bytes per layer as Korthikanti et al. give them, and MFU."""

import pytest

from testbed.model.whole_model import (
    TransformerShape,
    activation_bytes_per_layer,
    bubble_fraction,
    mfu,
    optimizer_bytes_per_param,
)

GPT3 = TransformerShape(layers=96, hidden=12288, heads=96, kv_heads=96, dense_ffn=4 * 12288, vocab=50257,
                        tied_embeddings=True)


def test_a_gpt3_shape_has_175b_parameters():
    # 12 L H^2 for attention and a 4H FFN, plus the embedding: 174.6e9 (GPT-3's "175B")
    assert GPT3.params == 96 * 12 * 12288**2 + 50257 * 12288
    assert GPT3.params == pytest.approx(175e9, rel=0.01)


def test_a_dense_step_is_about_six_flops_per_parameter_and_token():
    tokens = 2048 * 1536  # GPT-3's batch of 1,536 sequences of 2,048
    flops = GPT3.step_flops(tokens, seq_len=2048)
    attention = 3 * tokens * 96 * 2 * 2 * 2048 * 12288 * 0.5  # scores and values, causal, fwd + bwd
    assert flops == pytest.approx(6 * GPT3.params * tokens + attention, rel=1e-12)
    assert flops == pytest.approx(6 * GPT3.params * tokens, rel=0.02)  # attention adds s / 12 H = 1.4 %
    assert GPT3.step_flops(tokens, 2048, recompute=True) == pytest.approx(flops * 4 / 3)


def test_an_moe_token_meets_only_its_top_k_experts():
    moe = TransformerShape(layers=4, hidden=1024, heads=16, kv_heads=4, dense_ffn=4096, vocab=32000,
                           experts=8, expert_ffn=2048, top_k=2, moe_every=2)
    assert (moe.moe_layers, moe.dense_layers) == (2, 2)
    # GQA: K and V of 4 heads of 64
    assert moe.attention_params == 1024 * 1024 + 2 * 1024 * 256 + 1024 * 1024
    expert = 2 * 1024 * 2048
    assert moe.params - moe.active_params == 2 * (8 - 2) * expert  # the experts a token skips
    per_token = moe.forward_flops_per_token(seq_len=1, causal=False)
    assert per_token == 2 * (moe.active_params - 32000 * 1024) + 4 * (2 * 2 * 1 * 1024)  # 4 layers of attention


def test_mixed_precision_adam_is_16_bytes_per_parameter_and_zero_shards_it():
    assert sum(optimizer_bytes_per_param().values()) == 16
    assert sum(optimizer_bytes_per_param(1, dp=8).values()) == pytest.approx(2 + 2 + 12 / 8)
    assert sum(optimizer_bytes_per_param(2, dp=8).values()) == pytest.approx(2 + 2 / 8 + 12 / 8)
    with pytest.raises(ValueError, match="zero_stage"):
        optimizer_bytes_per_param(3)


@pytest.mark.parametrize("p, m, v, expected", [(4, 8, 1, 3 / 11), (1, 8, 1, 0.0), (8, 8, 1, 7 / 15),
                                               (4, 8, 2, 3 / 19)])
def test_the_1f1b_bubble(p, m, v, expected):
    assert bubble_fraction(p, m, v) == pytest.approx(expected)


def test_activation_bytes_per_layer_as_korthikanti_et_al_give_them():
    s, b, h, a = 2048, 1, 12288, 96
    full = activation_bytes_per_layer(s, b, h, a, flash=False)
    assert full == pytest.approx(s * b * h * (34 + 5 * a * s / h))  # eq. 2
    assert activation_bytes_per_layer(s, b, h, a, tp=8, flash=False) == pytest.approx(
        s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))  # eq. 3: tensor parallel only
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True, flash=False) == pytest.approx(
        full / 8)  # eq. 5
    assert activation_bytes_per_layer(s, b, h, a, recompute=True) == 2 * s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == pytest.approx(34 * s * b * h)  # flash: no scores kept


def test_mfu():
    # 6 x 175e9 x 3.1e6 FLOPs in 10 s on 1,024 GPUs of 312 TFLOP/s
    assert mfu(6 * 175e9 * 3.1e6, 10.0, 1024, 312e12) == pytest.approx(6 * 175e9 * 3.1e6 / (10 * 1024 * 312e12))
    with pytest.raises(ValueError, match="step_time_s"):
        mfu(1.0, 0.0, 1, 1.0)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="hidden = 100 is not a multiple of heads = 3"):
        TransformerShape(layers=1, hidden=100, heads=3, kv_heads=3, dense_ffn=4, vocab=10)
    with pytest.raises(ValueError, match="top_k"):
        TransformerShape(layers=1, hidden=8, heads=2, kv_heads=2, dense_ffn=4, vocab=10, experts=4, top_k=5,
                         expert_ffn=8)


def test_a_runs_summary_gives_tokens_per_second_per_gpu_and_mfu(tmp_path):
    """The quick start's summary: tokens per rank over the median step, and the MoE
    stack's FLOPs (kept slots through 4 H F, every token through the router's 2 H E, x 3
    for forward and backward) over step time x GPUs x the profile's peak."""
    from pathlib import Path

    from testbed.run.runner import run_scenario
    from testbed.scenario.file import load_scenario
    from testbed.scenario.profile import load_profile

    s = load_scenario(Path(__file__).resolve().parents[3] / "configs" / "quickstart.toml")
    s = s.replace(run={"output_dir": str(tmp_path), "steps": 3, "warmup_steps": 1})
    out = run_scenario(s, "sim")
    m = s.model
    assert out["tokens_per_s_per_gpu"] == pytest.approx(s.workload.tokens_per_rank / out["step_time_s"])
    kept = (1 - out["dropped_token_fraction"]) * s.world_size * s.workload.tokens_per_rank * m.top_k * m.num_layers
    flops = 3 * (kept * 4 * m.hidden_size * m.ffn_hidden_size
                 + s.world_size * s.workload.tokens_per_rank * m.num_layers * 2 * m.hidden_size * m.num_experts)
    assert out["model_flops_per_step"] == pytest.approx(flops, rel=1e-9)
    peak = load_profile(s.cluster.profile).compute.peak(m.dtype)
    assert out["mfu"] == pytest.approx(flops / (out["step_time_s"] * s.world_size * peak), rel=1e-9)
    assert 0 < out["mfu"] < 1


def test_fixed_groups_are_each_member_set_once():
    """tp 2 x EP 2 on 4 ranks: the tensor-parallel groups are the EP groups and the shards'
    peers the replica groups, so every rank holds 3 communicators (world, its pair, its
    peers), as the real backend creates them; the simulator counts the same."""
    from sim.backend import ClusterSim
    from testbed.scenario.profile import load_profile
    from testbed.scenario.scenario import Scenario

    s = Scenario.from_dict({"model": {"hidden_size": 32, "ffn_hidden_size": 64, "num_experts": 4},
                            "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
                            "parallelism": {"ep_size": 2, "tp_size": 2},
                            "transformer": {"enabled": True, "num_heads": 4, "seq_len": 32, "vocab_size": 64},
                            "workload": {"tokens_per_rank": 64}})
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    assert sim.controller.planner.fixed_groups() == [(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3)]
    assert sim.fixed_groups.tolist() == [3, 3, 3, 3]
