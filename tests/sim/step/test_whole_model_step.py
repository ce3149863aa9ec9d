"""The whole transformer on the simulator (``transformer.enabled``, issue 13): every MoE
layer's block adds its attention and dense layers (stage ``dense``, mirrored in
``dense_backward``), the output head closes the forward, the dense gradients are summed
over all ranks in ``dense_sync``, Adam updates everything and keeps its state, and the
memory breakdown shows where the bytes are. The MoE stack alone is unchanged."""

import pytest

from real.backend import RealBackend
from sim.backend import SimBackend
from sim.hardware.compute import ComputeModel
from testbed.core.errors import ScenarioError
from testbed.model.whole_model import activation_bytes_per_layer, block_grad_bytes, shape_of
from testbed.run.results import summarize
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

H, E, F, T, S, V = 64, 8, 128, 256, 128, 1000


def scenario(**transformer):
    return Scenario.from_dict({
        "model": {"hidden_size": H, "ffn_hidden_size": F, "num_experts": E, "num_layers": 2, "dtype": "bf16"},
        "workload": {"tokens_per_rank": T},
        "pager": {"page_size_bytes": "16KiB"},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": S, "vocab_size": V,
                        "moe_every": 2, **transformer},
        "run": {"steps": 2, "warmup_steps": 1},
    })


def run(s):
    result = SimBackend().run(s)
    return result, summarize(result.records, s.run.warmup_steps)


def test_the_dense_stages_take_the_roofline_time_of_attention_dense_ffns_and_the_head():
    s = scenario()
    _, out = run(s)
    c = ComputeModel(load_profile(s.cluster.profile), "bf16", s.world_size)
    eff = lambda rows, kernel="grouped": c.profile.compute.efficiency_at(kernel, rows)  # noqa: E731
    peak = c.peak * c.scale ** -1
    attention = 2 * T * (H * H + 2 * H * 32 + H * H) / (peak * eff(T))  # Q, K, V (2 KV heads of 16), O
    core = 2 * 2 * T * S * H * 0.5 / (peak * eff(S, "attention"))
    ffn = 2 * T * 2 * H * 4 * H / (peak * eff(T))
    block = 2 * (attention + core) + ffn  # moe_every = 2: two attentions, one dense FFN
    head = 2 * T * H * V / (peak * eff(T))
    # the memory-bound kernels (testbed.model.memory_bound_kernels) at the memory bandwidth, bf16, per
    # token: an attention sublayer's input norm (H read, H written), RoPE ((4 + 2) x 16 read and written)
    # and residual add (2 H read, H written), (5 H + 192) x 2 = 1024 bytes, backward (6 H + 192) x 2 =
    # 1152; the dense FFN's pre-MLP norm, gelu (4 H read and written; backward 3 x 4 H) and residual add,
    # (5 H + 8 H) x 2 = 1664, (6 H + 12 H) x 2 = 2304; the MoE layer's pre-MLP norm and residual add,
    # 5 H x 2 = 640, 6 H x 2 = 768; the loss 10 V (bf16 logits read, fp32 exponentials written and
    # read), 6 V backward
    kernels = lambda nbytes: T * nbytes / c.memory_bw * c.scale  # noqa: E731
    block_f, block_b = kernels(2 * 1024 + 1664 + 640), kernels(2 * 1152 + 2304 + 768)
    loss_f, loss_b = kernels(10 * V), kernels(6 * V)
    assert out["stage_time_s"]["dense"] == pytest.approx(2 * (block + block_f) + head + loss_f, rel=1e-9)
    assert out["stage_time_s"]["dense_backward"] == pytest.approx(
        2 * (2 * block + head) + 2 * block_b + loss_b, rel=1e-9)
    _, again = run(scenario(recompute="full"))  # the blocks' forward once more in the backward
    assert again["stage_time_s"]["dense_backward"] == pytest.approx(
        3 * 2 * block + 2 * head + 2 * (block_f + block_b) + loss_b, rel=1e-9)


def test_the_dense_gradients_are_summed_over_all_ranks():
    s = scenario()
    _, out = run(s)
    shape = shape_of(s)
    router = (H * E + E) * 4  # fp32, per layer
    dense = (2 * 2 * shape.attention_params + 2 * shape.dense_ffn_params + 2 * V * H) * 2  # bf16
    w = s.world_size
    assert out["bytes_by_stage"]["dense_sync"] == 2 * (w - 1) * (2 * router + dense)
    moe_only = summarize(SimBackend().run(s.replace(transformer={"enabled": False})).records, 1)
    assert moe_only["bytes_by_stage"]["dense_sync"] == 2 * (w - 1) * 2 * router
    assert moe_only["stage_time_s"]["dense"] == moe_only["stage_time_s"]["dense_backward"] == 0


def test_adam_state_activations_and_where_memory_peaks():
    s = scenario()
    result, out = run(s)
    shape = shape_of(s)
    local = 2 * (E // s.parallelism.ep_size) * 2 * H * F  # 2 layers' local experts
    routers = 2 * (H * E + E)  # weights and biases, fp32
    dense_params = shape.params - 2 * E * 2 * H * F - 2 * H * E  # attention, dense FFNs, embeddings
    b = result.extra["memory_breakdown_bytes"]
    assert b["optimizer_state"] == (dense_params + routers + local) * 12
    assert b["parameters"] == dense_params * 2 + routers * 4
    per_layer = activation_bytes_per_layer(S, T // S, H, 4)  # 16-bit: bf16 as is
    assert b["activations"] >= 2 * 2 * per_layer + T * V * 2  # the blocks' and the logits, besides the MoE layers'
    assert out["peak_memory_bytes"] <= sum(b.values())
    assert out["peak_memory_bytes"] >= b["optimizer_state"] + b["parameters"] + b["expert_pages"]
    assert result.extra["peak_memory_at"] == "dense, layer 1"  # the logits, at the end of the forward
    sgd = SimBackend().run(s.replace(transformer={"optimizer": "sgd"}))
    assert sgd.extra["memory_breakdown_bytes"]["optimizer_state"] == 0


def test_mfu_counts_the_whole_models_flops(tmp_path):
    s = scenario().replace(run={"output_dir": str(tmp_path)})
    out = run_scenario(s, "sim")
    tokens = s.world_size * T
    assert out["model_flops_per_step"] == pytest.approx(shape_of(s).step_flops(tokens, S))
    peak = load_profile(s.cluster.profile).compute.peak("bf16")
    assert out["mfu"] == pytest.approx(out["model_flops_per_step"] / (out["step_time_s"] * s.world_size * peak))


def test_bad_whole_model_settings_are_named():
    with pytest.raises(ScenarioError, match="transformer.seq_len"):
        scenario(seq_len=100)
    with pytest.raises(ScenarioError, match="transformer.num_kv_heads"):
        scenario(num_kv_heads=3)
    with pytest.raises(ScenarioError, match="transformer.zero_stage"):  # the real backend keeps ZeRO 0
        RealBackend().check(scenario().replace(transformer={"zero_stage": 1}))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_shards_the_optimizer_state_and_at_stage_2_the_gradients(stage):
    """Dense parameters live on all 8 ranks, each expert on its 2 replicas (EP 4): ZeRO
    divides their state by 8 and 2; stage 2 their gradients too. Adam updates the shard."""
    plain, zero = (SimBackend().run(scenario(zero_stage=z)) for z in (0, stage))
    a, b = plain.extra["memory_breakdown_bytes"], zero.extra["memory_breakdown_bytes"]
    s = scenario()
    shape = shape_of(s)
    dense_params = shape.params - 2 * E * 2 * H * F + 2 * E  # with the routers' biases
    local = 2 * (E // s.parallelism.ep_size) * 2 * H * F
    assert b["optimizer_state"] == pytest.approx((dense_params / 8 + local / 2) * 12)
    router = 2 * (H * E + E) * 4
    if stage == 2:
        dense = sum(block_grad_bytes(s, layer) for layer in range(2))
        experts = a["gradients"] - router - dense
        assert experts > 0
        assert b["gradients"] == pytest.approx(router + dense / 8 + experts / 2)
    else:
        assert b["gradients"] == a["gradients"]
    opt = lambda r: summarize(r.records, 1)["stage_time_s"]["optimizer"]  # noqa: E731
    assert opt(zero) < opt(plain)


def test_tensor_parallelism_splits_the_dense_weights_and_adds_its_collectives():
    """tp 2 inside 2-GPU nodes, with sequence parallelism: each GPU holds half the
    attention, dense-FFN and embedding weights (the routers whole) and their gradients;
    each of a layer's 3 parts (2 attentions, 1 dense FFN) all-gathers the pair's tokens
    (2 x T x H bf16 bytes on the wire per pair) and reduce-scatters its output (the same),
    forward and backward; the dense gradients are summed over the 4 GPUs holding the same
    half, the routers' over all 8."""
    one, two = (SimBackend().run(scenario().replace(parallelism={"tp_size": tp})) for tp in (1, 2))
    a, b = one.extra["memory_breakdown_bytes"], two.extra["memory_breakdown_bytes"]
    routers = 2 * (H * E + E) * 4
    assert b["parameters"] - routers == pytest.approx((a["parameters"] - routers) / 2, abs=2 * 2 * H * E)
    rows = T * H * 2
    per_part = 2 * rows + 2 * 2 * rows  # all-gather and reduce-scatter in a pair (gloo: as an all-reduce)
    dense_bytes = 2 * 3 * 4 * per_part  # 2 layers x 3 parts x 4 pairs
    # the split vocabulary (Planner.tp_embedding_ops, tp_head_ops), per pair: forward the token
    # ids and targets gathered (2 x T x 16), the partial embeddings reduce-scattered and the last
    # hidden states gathered (2 x rows each), three all-reduces of 2 T fp32 (ring of 2: each
    # sends all of it); backward the embedding's gradient gathered and the head's scattered
    forward_vocab = 4 * (2 * T * 16 + 2 * 2 * rows + 2 * rows + 3 * 2 * (2 * T * 4))
    backward_vocab = 4 * (2 * rows + 2 * 2 * rows)
    got = summarize(two.records, 1)["bytes_by_stage"]
    assert got["dense"] == dense_bytes + forward_vocab
    assert got["dense_backward"] == dense_bytes + backward_vocab
    assert summarize(one.records, 1)["bytes_by_stage"]["dense"] == 0
    s = scenario()
    shards = sum(block_grad_bytes(s, layer) for layer in range(2)) / 2  # each GPU's half
    assert got["dense_sync"] == pytest.approx(2 * 7 * routers + 2 * 2 * 3 * shards)  # 8-rank ring; 2 x 4-rank rings


def test_tensor_parallelism_is_checked():
    with pytest.raises(ScenarioError, match="parallelism.tp_size"):
        scenario(enabled=False).replace(parallelism={"tp_size": 2})
    with pytest.raises(ScenarioError, match="does not divide cluster.gpus_per_node"):
        scenario().replace(parallelism={"tp_size": 4})
    with pytest.raises(ScenarioError, match="transformer.num_kv_heads"):
        scenario(num_kv_heads=1).replace(parallelism={"tp_size": 2})


def test_without_sequence_parallelism_the_blocks_hold_the_groups_tokens():
    """tp 2 without sequence parallelism: a block's dense layer keeps 10 s b H whole and
    24 s b H / 2 for the pair's sequences (Korthikanti et al. eq. 4; with it 34 s b H / 2:
    eq. 5), its MoE layer those less its FFN's 2 s b H whole and 16 s b H split and with its
    router's scores and map (5 E bytes a token, whole; issue 25), in bf16 as is. Its collectives: an all-reduce per sublayer (the bytes of an all-gather
    and a reduce-scatter), and the MoE layers' rows gathered into the blocks (layer 1's
    forward; both layers' input gradients backward) - more bytes than with it."""
    from sim.hardware.dense_layers import DenseLayers

    sp, no_sp = (scenario().replace(parallelism={"tp_size": 2, "sequence_parallel": on}) for on in (True, False))
    compute = ComputeModel(load_profile(sp.cluster.profile), "bf16", sp.world_size)
    a, b = DenseLayers(sp, compute), DenseLayers(no_sp, compute)
    # each GPU's own tokens: the dense layer's 34 T H, the MoE layer's 16 T H and 5 E T
    # less, in both layers, K and V at the 2 key-value heads (2 x 2 x 16 elements where Korthikanti counts
    # 2 H), bf16, split: the pair's 2 T tokens over 2 GPUs
    kv = 2 * (2 * H - 2 * 2 * 16) * 2 * (2 * T // 2)
    assert a.block_activation_bytes == T * H * (34 + 16) + T * E * 5 - kv
    # the pair's 2 T tokens: 2 T H (10 + 24 / 2) and 2 T H (8 + 8 / 2) + 5 E (2 T)
    assert b.block_activation_bytes == 2 * T * H * (10 + 12 + 8 + 4) + 2 * T * E * 5 - kv
    got = {on: summarize(SimBackend().run(s).records, 1)["bytes_by_stage"] for on, s in ((True, sp), (False, no_sp))}
    rows, pairs = T * H * 2, 4
    # gloo (the local-cpu profile) runs each of the sequence-parallel reduce-scatters as an
    # all-reduce of its 2-row input: 2 rows more than a ring's, per pair (docs/bytes.md)
    gloo_extra = pairs * 2 * rows
    # forward: the embedding's sum as an all-reduce (each of a pair sends 2 rows, not 1) and layer 1's gather;
    # with sequence parallelism 2 layers x 3 parts + the embedding reduce-scatter
    assert got[False]["dense"] == got[True]["dense"] + pairs * (2 * rows) + pairs * (2 * rows) - 7 * gloo_extra
    # backward: no embedding gather, a head all-reduce for its reduce-scatter (+2 rows), 2 layers' input gathers;
    # with sequence parallelism 2 layers x 3 parts + the head reduce-scatter
    assert got[False]["dense_backward"] == got[True]["dense_backward"] - pairs * 2 * rows + pairs * 2 * rows \
        + 2 * pairs * 2 * rows - 7 * gloo_extra
