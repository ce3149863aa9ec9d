"""The models people train on the simulator (issue 24): each feature moves a simulated
step's compute time and memory by category exactly as its closed form says, on a
profile with flat efficiency curves and no launch floor (so every GEMM takes its FLOPs
over peak x efficiency): SwiGLU's three matrices, shared experts on every rank beside
the dispatch, MLA's GEMMs and core, fp8 GEMMs at the fp8 ceiling plus their casts at the
memory bandwidth, MTP's layer and head, dense-first layers, sliding windows, head_dim,
biases and sinks; the parameter memory is the GPU's share of the model card's count.

Besides the GEMMs, the memory-bound kernels (``testbed.model.memory_bound_kernels``) move
their bytes at the memory bandwidth BW, counted here by hand, bf16 (2 bytes an element),
per token: an attention sublayer's input norm (reads and writes H), RoPE (reads and writes
the rotated queries and keys: 4 + 2 heads of 16) and residual add (reads 2 H, writes H):
(5 H + 2 x 96) x 2 = 1024 bytes forward, (3 H + 2 x 96 + 3 H) x 2 = 1152 backward; a dense
FFN sublayer's norm, gelu (reads F_d = 4 H, writes 4 H; backward 3 x 4 H) and residual add:
(5 H + 8 H) x 2 = 1664, (6 H + 12 H) x 2 = 2304; an MoE layer's pre-MLP norm and residual
add: 5 H x 2 = 640, 6 H x 2 = 768; the loss over V: 10 V forward (the bf16 logits read, their
fp32 exponentials written and read), 6 V backward; the router over E: 9 E forward, 12 E
backward; the permutation and its inverse per routed slot (2 H + H + H / K) x 2 = 448, forward
and backward; per expert row gelu's activation 2 F x 2 = 512 forward, 3 F x 2 = 768 backward,
and with more than one expert on a GPU of EP > 1 the sort by local expert and back, 4 H x 2."""

import numpy as np
import pytest

from sim.backend import ClusterSim, SimBackend
from testbed.core.errors import ScenarioError
from testbed.model.model_card import param_count
from testbed.model.whole_model import shape_of
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile, profile_from_dict, save_profile
from testbed.scenario.scenario import Scenario

H, F, E, K, T, S, V = 64, 128, 8, 2, 256, 128, 1000
PEAK, FP8, BW = 10e12, 20e12, 1e12  # FLOP/s (bf16, fp8), bytes/s
DENSE, GROUPED, ATTENTION = 0.25, 0.5, 0.1  # the flat efficiencies


def flat_profile(tmp_path_factory, bandwidth: float) -> str:
    """The H200 profile with flat efficiency curves, no launch floor, no router cost, a
    memory bandwidth of ``bandwidth`` bytes/s."""
    d = load_profile("h200").to_dict()
    d["compute"].pop("gemm", None)  # the flat curves alone: no GEMM shape model (sim.hardware.gemm_efficiency)
    d["collectives"]["kernel_sms"] = 0  # no SMs taken by NCCL kernels (sim.step.kernel_sms)
    d["compute"].update(memory_GBps=bandwidth / 1e9, launch_us=0.0)
    d["compute"]["peak_tflops"].update(bf16=PEAK / 1e12, fp8=FP8 / 1e12)
    d["compute"]["efficiency"] = {"grouped": [[1, GROUPED], [1e6, GROUPED]], "loop": [[1, GROUPED], [1e6, GROUPED]],
                                  "dense": [[1, DENSE], [1e6, DENSE]], "attention": [[1, ATTENTION], [1e6, ATTENTION]]}
    d["overheads"]["router_us"] = 0.0
    return str(save_profile(profile_from_dict(d, "flat"), tmp_path_factory.mktemp("profile") / "flat.toml"))


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """The flat profile at BW."""
    return flat_profile(tmp_path_factory, BW)


@pytest.fixture(scope="module")
def flat_free_kernels(tmp_path_factory):
    """The flat profile at 1e21 bytes/s, where the memory-bound kernels (module doc) cost
    nothing: for a test of the GEMMs' FLOPs alone in which nothing else is memory-bound (no
    fp8 casts, no optimizer, compute-bound GEMMs)."""
    return flat_profile(tmp_path_factory, 1e21)


def kernels(nbytes):
    """Seconds of memory-bound kernels moving ``nbytes`` bytes at BW (module doc)."""
    return nbytes / BW


def scenario(profile, gpus=1, whole=False, **sections):
    """H 64, F 128, 8 experts top-2, 2 MoE layers, bf16, dropless, on ``gpus`` GPUs of one
    node (EP over all of them); ``whole``: the transformer around them (4 heads, 2 KV heads,
    sequences of 128, a dense layer before each MoE layer)."""
    data = {"model": {"hidden_size": H, "ffn_hidden_size": F, "num_experts": E, "top_k": K, "num_layers": 2,
                      "dtype": "bf16"},
            "cluster": {"gpus_per_node": gpus, "nodes_per_microcluster": 1, "microclusters": 1, "profile": profile},
            "parallelism": {"ep_size": gpus}, "pager": {"enabled": False}, "router": {"capacity_factor": 0.0},
            "workload": {"tokens_per_rank": T, "skew": 0.0}, "sim": {"network_model": "analytic"},
            "run": {"steps": 1, "warmup_steps": 0}}
    if whole:
        data["transformer"] = {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": S, "vocab_size": V,
                               "moe_every": 2, "optimizer": "sgd"}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return Scenario.from_dict(data)


def run(s):
    result = SimBackend().run(s)
    return result.records[0], result.extra["memory_breakdown_bytes"]


def dense(flops):
    return flops / (PEAK * DENSE)


def core(flops):
    return flops / (PEAK * ATTENTION)


def test_swiglu_experts_cost_one_and_a_half_gelus_at_equal_f(flat_free_kernels):
    """Three matrices of H x F against two: 1.5 x the FLOPs and weight bytes, forward and
    backward; pages, gradients and optimizer updates 1.5 x; each expert row keeps F more
    (the first GEMM's output is gate and up, 2 F). The activations' kernels (3 F against 2 F
    forward, 5 F against 3 F backward) are not 1.5 x: they cost nothing on this profile."""
    flat = flat_free_kernels
    (gelu, a), (swiglu, b) = (run(scenario(flat, model={"ffn_activation": act})) for act in ("gelu", "swiglu"))
    for stage in ("experts", "experts_backward"):
        assert swiglu.stage_time_s[stage] == pytest.approx(1.5 * gelu.stage_time_s[stage], rel=1e-12)
    assert b["expert_pages"] == 1.5 * a["expert_pages"] == 1.5 * 2 * E * 2 * H * F * 2
    routers = 2 * (H * E + E) * 4
    assert b["gradients"] - routers == 1.5 * (a["gradients"] - routers)
    assert b["activations"] - a["activations"] == 2 * T * K * F * 2  # 2 layers x T K rows x F more, bf16
    # the whole transformer's dense FFN too: 3 H x 4H matrices
    (g, _), (w, _) = (run(scenario(flat, whole=True, model={"ffn_activation": act})) for act in ("gelu", "swiglu"))
    assert w.stage_time_s["dense"] - g.stage_time_s["dense"] == pytest.approx(2 * dense(2 * T * H * 4 * H), rel=1e-9)


def shared_seconds(width, experts=1, gate=False):
    """Forward seconds of the shared experts on T tokens: two gelu matrices each, the gate."""
    return dense(2 * T * 2 * H * width * experts) + (dense(2 * T * H) if gate else 0.0)


def test_shared_experts_run_on_every_rank_beside_the_dispatch(flat):
    base = scenario(flat, gpus=4)
    shared = base.replace(model={"shared_experts": 2, "shared_ffn_hidden_size": 96, "shared_expert_gate": True})
    (plain, a), (over, b) = run(base), run(shared)
    fwd = shared_seconds(96, 2, gate=True)
    # their gelu over 2 x 96 columns a token (module doc): reads and writes 192 forward, 3 x 192 backward
    act_f, act_b = kernels(T * 2 * 192 * 2), kernels(T * 3 * 192 * 2)
    # every rank runs them on its own T tokens: the experts' stage (a mean over ranks) grows by their time
    assert over.stage_time_s["experts"] - plain.stage_time_s["experts"] == pytest.approx(2 * (fwd + act_f), rel=1e-9)
    assert over.stage_time_s["experts_backward"] - plain.stage_time_s["experts_backward"] == pytest.approx(
        2 * (2 * fwd + act_b), rel=1e-9)
    params = (2 * 2 * H * 96 + H) * 2  # per layer: 2 experts of 2 H x 96 and the gate, bf16
    assert b["parameters"] - a["parameters"] == 2 * params
    assert b["gradients"] - a["gradients"] == 2 * params
    assert b["activations"] - a["activations"] == 2 * T * 2 * (96 + H) * 2  # each expert's pre-activation, output
    # replicated: summed with the routers' over all 4 ranks (ring all-reduce: 2 (w - 1) x the bytes)
    assert over.bytes_by_stage["dense_sync"] - plain.bytes_by_stage["dense_sync"] == 2 * 3 * 2 * params
    # SGD reads their weights and gradients and writes their weights at the memory bandwidth
    optimizer = over.stage_time_s["optimizer"] - plain.stage_time_s["optimizer"]
    assert optimizer == pytest.approx(3 * 2 * params / BW, rel=1e-9)
    # in order (no overlap) the step takes exactly their time longer, with the longer gradient sum
    # and update; beside the exchange less
    in_order, _ = run(shared.replace(overlap={"shared_experts": False}))
    sync = in_order.stage_time_s["dense_sync"] - plain.stage_time_s["dense_sync"]
    assert sync > 0
    assert in_order.step_time_s - plain.step_time_s == pytest.approx(
        2 * (3 * fwd + act_f + act_b) + sync + optimizer, rel=1e-9)
    assert plain.step_time_s < over.step_time_s < in_order.step_time_s


def test_the_shared_experts_first_part_starts_with_the_dispatch_and_the_second_with_the_combine(flat):
    s = scenario(flat, gpus=4, model={"shared_experts": 1})
    sim = ClusterSim(s, load_profile(flat))
    from sim.backend import routing_source
    _, phases, tl, _, _, _ = sim.step(0, np.asarray(routing_source(s)(0)), [])
    layer0 = [i for i, ph in enumerate(phases) if ph.layer == 0]
    dispatch = next(i for i in layer0 if phases[i].stage == "dispatch")
    combine = next(i for i in layer0 if phases[i].stage == "combine")
    compute = [i for i in layer0 if phases[i].stage == "experts" and phases[i].kind == "compute"]
    first, routed, second = compute  # shared part 1, the routed experts, shared part 2
    assert np.array_equal(tl.start[first], tl.start[dispatch])
    assert np.array_equal(tl.start[second], tl.start[combine])
    # the first matrix and the activation after it (gelu: reads F, writes F a token, module doc)
    assert np.allclose(tl.end[first] - tl.start[first], dense(2 * T * H * F) + kernels(T * 2 * F * 2))
    assert np.all(tl.start[routed] >= tl.end[first])


def test_mla_attention_is_its_gemms_and_core(flat):
    """MLA of 4 heads: query latent 32, key-value latent 16, d_nope 16, d_rope 8, d_v 16.
    Its GEMMs: q down H x 32, q up 32 x 4 x 24, kv down H x (16 + 8), kv up 16 x 4 x 32,
    o 4 x 16 x H; its core 2 x keys x 4 x 24 + 2 x keys x 4 x 16 per token, keys s / 2; its
    memory-bound kernels RoPE on 4 x 8 + 8 (the shared key's) against GQA's (4 + 2) x 16, read
    and written, and its latents' norms (32 + 16 wide: 2 x forward, 3 x backward)."""
    mla = {"attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 16}
    (g, a), (m, b) = run(scenario(flat, whole=True)), run(scenario(flat, whole=True, transformer=mla))
    gqa_params = H * H + 2 * H * 32 + H * H
    mla_params = 32 * (H + 4 * 24) + H * 24 + 16 * 4 * 32 + 4 * 16 * H
    assert sum(k * n for k, n in shape_of(scenario(flat, whole=True, transformer=mla)).attention_linears) == mla_params
    gqa = dense(2 * T * gqa_params) + core(2 * 2 * T * (S / 2) * H)
    mla_s = dense(2 * T * mla_params) + core(T * (2 * (S / 2) * 4 * 24 + 2 * (S / 2) * 4 * 16))
    kernels_f = kernels(T * (2 * 40 + 2 * 48 - 2 * 96) * 2)  # 16 elements a token fewer than GQA's
    kernels_b = kernels(T * (2 * 40 + 3 * 48 - 2 * 96) * 2)  # 32 more
    # 2 blocks x 2 attentions each
    assert m.stage_time_s["dense"] - g.stage_time_s["dense"] == pytest.approx(4 * (mla_s - gqa + kernels_f), rel=1e-9)
    assert m.stage_time_s["dense_backward"] - g.stage_time_s["dense_backward"] == pytest.approx(
        4 * (2 * (mla_s - gqa) + kernels_b), rel=1e-9)
    assert b["parameters"] - a["parameters"] == 4 * (mla_params - gqa_params) * 2
    # activations: Q, K (4 x 24), V and the output's input (4 x 16), the latents whole, for GQA's Q and
    # output input at 4 heads of 16 and K and V at its 2 key-value heads: 2 (4 + 2) 16
    split, whole = 2 * 4 * 24 + 2 * 4 * 16, 2 * 32 + 16 + 8 + 16
    assert b["activations"] - a["activations"] == 4 * 2 * T * (split + whole - 2 * (4 + 2) * 16)


def cast(rows, k, n, backward=False):
    """Bytes of one fp8 GEMM's casts from bf16 (3 bytes an element read and written, 4-byte
    scales per 1 x 128 tile and 128 x 128 weight block; every dimension here is <= 128 but
    the FFN's 256 and SwiGLU's)."""
    tiles = lambda d: -(-d // 128)  # noqa: E731
    if backward:
        return rows * n * 3 + rows * tiles(n) * 4 + rows * k * 3 + k * tiles(rows) * 4 + rows * n * 3 + n * tiles(rows) * 4
    return rows * k * 3 + rows * tiles(k) * 4 + k * n * 3 + tiles(k) * tiles(n) * 4


def test_fp8_gemms_run_at_the_fp8_ceiling_plus_their_casts_at_the_memory_bandwidth(flat):
    fp8 = {"gemm_dtype": "fp8", "fp8_scaling": "blockwise"}
    (_, a), (f8, b) = run(scenario(flat, whole=True)), run(scenario(flat, whole=True, model=fp8))
    qkv, o, up, down = (H, 2 * H), (H, H), (H, 4 * H), (4 * H, H)  # 4 heads of 16, 2 KV heads; the dense FFN
    attention_flops, ffn_flops = 2 * T * (H * 2 * H + H * H), 2 * T * 8 * H * H
    attention_core = core(2 * 2 * T * (S / 2) * H)  # stays at the bf16 ceiling, as the head does
    casts = sum(cast(T, *w) for w in (qkv, o))
    # the memory-bound kernels stay at bf16 (module doc): 2 attention sublayers, a dense FFN, an MoE layer's norm
    block_kernels = kernels(T * (2 * 1024 + 1664 + 640))
    block = 2 * (attention_flops / (FP8 * DENSE) + attention_core + casts / BW) \
        + ffn_flops / (FP8 * DENSE) + sum(cast(T, *w) for w in (up, down)) / BW + block_kernels
    head = dense(2 * T * H * V) + kernels(T * 10 * V)  # and the loss
    assert f8.stage_time_s["dense"] == pytest.approx(2 * block + head, rel=1e-9)
    # the experts: T K rows of 2 GEMMs (H x F, F x H) at fp8's ceiling, each expert's weights cast once;
    # each row's gelu at bf16 (one GPU: no sort)
    gemm = 4 * T * K * H * F / (FP8 * GROUPED)
    expert_casts = T * K * (H * 3 + 4 + F * 3 + 4) + E * (2 * H * F * 3 + 2 * 4)
    assert f8.stage_time_s["experts"] == pytest.approx(2 * (gemm + expert_casts / BW + kernels(T * K * 512)),
                                                       rel=1e-9)
    # per layer: each expert's 64 rows (T K / E) tiled along the rows for the weight gradient
    backward_casts = E * sum(cast(T * K // E, *w, backward=True) for w in ((H, F), (F, H)))
    assert f8.stage_time_s["experts_backward"] == pytest.approx(
        2 * (2 * gemm + backward_casts / BW + kernels(T * K * 768)), rel=1e-9)
    # memory: the fp8 copies of every weight the step computes with (1 byte an element and the scales)
    copies = 2 * (2 * (H * 2 * H + 4 + H * H + 4) + H * 4 * H + 2 * 4 + 4 * H * H + 2 * 4)  # 2 blocks
    copies += 2 * E * (2 * H * F + 2 * 4)  # 2 layers of 8 experts
    assert b["parameters"] - a["parameters"] == copies
    # the linears' inputs kept quantized, 1 + 4 / 128 bytes an element instead of 2 (blockwise scales):
    # a dense layer's input norm output, attention output, pre-MLP norm output and gelu output (H, H, H, 4 H),
    # an MoE layer's first two and each of its K rows' input and activation (H + F); 2 layers of each
    cached = 2 * (3 * H + 4 * H) + 2 * (2 * H + K * (H + F))
    assert a["activations"] - b["activations"] == T * cached * (2 - (1 + 4 / 128))


def test_fp8_gemms_need_an_fp8_ceiling():
    s = Scenario.from_dict({"model": {"gemm_dtype": "fp8"}, "cluster": {"profile": "a100-seed"}})
    with pytest.raises(ScenarioError, match=r"model.gemm_dtype = 'fp8'.*compute.peak_tflops.fp8"):
        SimBackend().check(s)


def test_an_mtp_module_is_one_more_moe_layer_and_one_more_head(flat):
    """One MTP module after the last MoE layer is MoE layer 2 of the controller's
    (``testbed.model.mtp_layers``): its block is its projection 2H x H and its attention
    over the whole sequence, its MoE FFN the router and the experts on the rows routed to
    them (T k on the one GPU, as each of the model's two layers), and the shared head runs
    once more; with their memory-bound kernels (module doc): the attention sublayer's and the
    MoE layer's norm and residual add, the loss, the router's and the permutation's, the rows'
    activation."""
    plain, a = run(scenario(flat, whole=True))
    mtp, b = run(scenario(flat, whole=True, transformer={"mtp_layers": 1}))
    block = dense(2 * T * 2 * H * H) + dense(2 * T * (2 * H * H + 2 * H * 32)) + core(2 * 2 * T * (S / 2) * H)
    head = dense(2 * T * H * V)
    assert mtp.stage_time_s["dense"] - plain.stage_time_s["dense"] == pytest.approx(
        block + head + kernels(T * (1024 + 640 + 10 * V)), rel=1e-9)
    assert mtp.stage_time_s["dense_backward"] - plain.stage_time_s["dense_backward"] == pytest.approx(
        2 * (block + head) + kernels(T * (1152 + 768 + 6 * V)), rel=1e-9)
    assert mtp.stage_time_s["route"] - plain.stage_time_s["route"] == pytest.approx(
        dense(2 * T * H * E) + kernels(T * (9 * E + K * 448)), rel=1e-9)
    experts = 4 * T * K * H * F / (PEAK * GROUPED)
    assert mtp.stage_time_s["experts"] - plain.stage_time_s["experts"] == pytest.approx(
        experts + kernels(T * K * 512), rel=1e-9)
    assert mtp.stage_time_s["experts_backward"] - plain.stage_time_s["experts_backward"] == pytest.approx(
        2 * experts + kernels(T * K * 768), rel=1e-9)
    # its routed experts are a layer's pages (all 8 on the one GPU); its projection, attention and router the rest
    assert b["expert_pages"] - a["expert_pages"] == E * 2 * H * F * 2
    assert b["parameters"] - a["parameters"] == (2 * H * H + 2 * H * H + 2 * H * 32) * 2 + (H * E + E) * 4
    # every expert computed; the projection's and attention's gradients with the head's
    assert b["gradients"] - a["gradients"] == E * 2 * H * F * 2 + (2 * H * H + 2 * H * H + 2 * H * 32) * 2 \
        + (H * E + E) * 4
    # an MoE layer: Korthikanti's standard layer less its FFN term, 34 - 18 s b H (bf16), and the router's
    # fp32 scores and routing map (5 E bytes a token), K and V at the 2 key-value heads (2 (4 + 2) 16 for
    # Korthikanti's 4 H); its input and rows (input, gelu's input and output)
    layer = 16 * T * H * 2 / 2 + T * E * 5 - 2 * T * (4 * H - 2 * (4 + 2) * 16)
    rows = (T * H + T * K * (H + 2 * F)) * 2
    assert b["activations"] - a["activations"] == layer + 2 * T * H * 2 + rows + T * V * 2


@pytest.mark.parametrize("router", [{}, {"score": "sigmoid", "expert_groups": 4, "groups_per_token": 2,
                                         "bias_update_rate": 0.001}], ids=["counts", "scored"])
def test_an_mtp_run_plans_the_moe_layers_of_a_model_one_layer_deeper(flat, router):
    """The MoE layers the controller plans with D = 1 MTP module are those of the same model
    with L + D = 3 MoE layers and no MTP: under the synthetic workload's routing (drawn
    count by count, or token by token from the router's scores with V3's group limit and
    bias balancing) every token stage, the expert sync, the pages and the heat move the
    same bytes, to the byte, over 3 steps on 4 GPUs (EP 2 x 2 replicas, paged); the dense
    sync differs by the blocks (the MTP module's projection and attention against a
    layer's block)."""
    s = scenario(flat, gpus=4, whole=True, parallelism={"ep_size": 2}, router=router,
                 pager={"enabled": True, "page_size_bytes": "16KiB", "gpu_budget_bytes": "160KiB"},
                 workload={"skew": 1.0, "seed": 7}, run={"steps": 3})
    mtp, deeper, model = (SimBackend().run(x) for x in (
        s.replace(transformer={"mtp_layers": 1}), s.replace(model={"num_layers": 3}), s))
    assert mtp.routing.routed.shape[1] == 3
    assert np.array_equal(mtp.routing.routed, deeper.routing.routed)
    for got, want in zip(mtp.records, deeper.records):
        assert got.bytes_by_stage["dispatch"] == want.bytes_by_stage["dispatch"] > 0
        assert {k: v for k, v in got.bytes_by_stage.items() if k != "dense_sync"} == \
            {k: v for k, v in want.bytes_by_stage.items() if k != "dense_sync"}
        assert got.page_moves == want.page_moves and got.dropped_slots == want.dropped_slots
    assert sum(r.page_moves for r in mtp.records) > 0 and mtp.records[0].bytes_by_stage["expert_sync"] > 0
    # the model without its MTP module moves a layer's tokens fewer
    assert all(m.bytes_by_stage["dispatch"] < d.bytes_by_stage["dispatch"] for m, d in zip(model.records, mtp.records))


def test_dense_first_layers_come_before_the_first_moe_layer(flat):
    (plain, a), (first, b) = (run(scenario(flat, gpus=2, whole=True, transformer={"first_dense_layers": n}))
                              for n in (0, 2))
    attention = dense(2 * T * (2 * H * H + 2 * H * 32)) + core(2 * 2 * T * (S / 2) * H)
    layer = attention + dense(2 * T * 8 * H * H) + kernels(T * (1024 + 1664))  # an attention and a dense FFN sublayer
    assert first.stage_time_s["dense"] - plain.stage_time_s["dense"] == pytest.approx(2 * layer, rel=1e-9)
    # all of it in MoE layer 0's block, none in layer 1's
    assert first.extra["layer_time_s"][1] == pytest.approx(plain.extra["layer_time_s"][1], rel=1e-12)
    weights = 2 * (2 * H * H + 2 * H * 32 + 8 * H * H) * 2
    assert b["parameters"] - a["parameters"] == weights
    assert first.bytes_by_stage["dense_sync"] - plain.bytes_by_stage["dense_sync"] == 2 * 1 * weights


def test_sliding_window_layers_attend_a_band(flat):
    """Layers 0 and 2 of 4 (full_attention_every 2) attend a window of 32 of the 128: keys
    w - w^2 / 2s = 28 against s / 2 = 64 on average."""
    (full, _), (window, _) = (run(scenario(flat, whole=True, transformer={"sliding_window": w})) for w in (0, 32))
    saved = core(2 * 2 * T * H * 64) - core(2 * 2 * T * H * (32 - 32 * 32 / (2 * S)))
    assert full.stage_time_s["dense"] - window.stage_time_s["dense"] == pytest.approx(2 * saved, rel=1e-9)
    assert full.stage_time_s["dense_backward"] - window.stage_time_s["dense_backward"] == pytest.approx(
        2 * 2 * saved, rel=1e-9)


def test_head_dim_sets_the_attention_width(flat):
    """4 heads of 32 (n d 128 against H 64), 2 KV heads: Q H x 128, K and V H x 64, O 128 x H;
    RoPE reads and writes (4 + 2) x 32 a token against (4 + 2) x 16 (module doc)."""
    (plain, a), (wide, b) = run(scenario(flat, whole=True)), run(scenario(flat, whole=True, transformer={"head_dim": 32}))
    per = lambda params, width: dense(2 * T * params) + core(2 * 2 * T * (S / 2) * width)  # noqa: E731
    delta = per(H * 128 + 2 * H * 64 + 128 * H, 128) - per(2 * H * H + 2 * H * 32, H) + kernels(T * 2 * 6 * 16 * 2)
    assert wide.stage_time_s["dense"] - plain.stage_time_s["dense"] == pytest.approx(4 * delta, rel=1e-9)
    assert b["parameters"] - a["parameters"] == 4 * (2 * H * 128 + 2 * H * 64 - 2 * H * H - 2 * H * 32) * 2


def test_biases_and_sinks_add_parameters_not_time(flat):
    (plain, a), (biased, b) = run(scenario(flat, whole=True)), run(scenario(
        flat, whole=True, model={"ffn_bias": True}, transformer={"attention_bias": "all", "attention_sinks": True}))
    for stage in ("dense", "experts", "dense_backward", "experts_backward"):
        assert biased.stage_time_s[stage] == plain.stage_time_s[stage]
    attention = 64 + 2 * 32 + H + 4  # Q, K, V, O biases and 4 sinks
    dense_ffn = 4 * H + H
    experts = E * (F + H)  # the local experts' biases, beside their pages
    assert b["parameters"] - a["parameters"] == (4 * attention + 2 * dense_ffn + 2 * experts) * 2
    assert b["expert_pages"] == a["expert_pages"]


def test_the_parameter_memory_is_the_gpus_share_of_the_model_card(flat):
    """Every feature at once on 4 GPUs (EP 4): the weights a GPU holds (its pages and the
    rest) are the card's count, its share: the routed experts 1/4 (the MTP module's too),
    the rest whole, the norms left out (as both backends count), the routers in fp32."""
    s = scenario(flat, gpus=4, whole=True,
                 model={"ffn_activation": "swiglu", "shared_experts": 1, "shared_ffn_hidden_size": 96,
                        "shared_expert_gate": True, "ffn_bias": True},
                 transformer={"first_dense_layers": 1, "mtp_layers": 1, "attention": "mla", "q_lora_rank": 32,
                              "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                              "sliding_window": 32, "attention_sinks": True})
    _, got = run(s)
    shape = shape_of(s)
    card = param_count(shape).by_component
    mtp_norms = shape.mtp_module_norm_params
    mtp_routed = shape.experts * shape.expert_params
    mtp_share = card["mtp"] - mtp_norms - shape.router_params - mtp_routed + mtp_routed / 4
    bf16 = (card["embedding"] + card["head"] + card["attention"] + card["dense_ffn"] + card["shared_experts"]
            + card["routed_experts"] / 4 + mtp_share)
    fp32 = card["routers"] + shape.router_params  # the MoE layers' and the MTP module's
    assert got["expert_pages"] + got["parameters"] == 2 * bf16 + 4 * fp32


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v2", "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b",
                                    "mixtral-8x22b", "qwen2-57b-a14b", "gpt-oss-120b", "olmoe-1b-7b",
                                    "megascale-352b"])
def test_every_preset_simulates_a_step(preset, tmp_path):
    """Each shipped model, its first 2 MoE layers (``--set model.num_layers=2``), on 8 H200s
    (2 x 2 x 2, EP 4), sequences of 512, through ``testbed run``'s runner (which refuses a
    feature the simulator does not model)."""
    s = Scenario.from_dict({"model": {"preset": preset, "num_layers": 2},
                            "transformer": {"enabled": True, "seq_len": 512}, "workload": {"tokens_per_rank": 1024},
                            "cluster": {"profile": "h200"}, "pager": {"enabled": False},
                            "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)}})
    out = run_scenario(s, "sim")
    assert out["step_time_s"] > 0 and out["stage_time_s"]["dense"] > 0 and out["stage_time_s"]["experts"] > 0
    assert out["model_flops_per_step"] == pytest.approx(shape_of(s).step_flops(8 * 1024, 512))


def test_deepeps_kernels_slow_the_shared_experts_beside_them(flat):
    """deepep holds 20 of the 132 SMs while its dispatch runs: the shared experts beside it
    run at 1 - 20/132 of their speed for as long as the dispatch takes alone."""
    from sim.step.kernel_sms import sm_slowed

    s = scenario(flat, gpus=4, model={"shared_experts": 1}, comm={"token_strategy": "deepep"})
    sim = ClusterSim(s, load_profile(flat))
    from sim.backend import routing_source
    decisions, phases, _, _, _, _ = sim.step(0, np.asarray(routing_source(s)(0)), [])
    first = next(ph for ph in phases if ph.layer == 0 and ph.stage == "experts" and ph.kind == "compute")
    alone = sim.builder.batch_seconds(decisions.forward[0].dispatch_ops)
    assert np.all(alone > 0)
    # the first matrix and its gelu (reads F, writes F a token: module doc), both slowed
    want = sm_slowed(np.full(4, dense(2 * T * H * F) + kernels(T * 2 * F * 2)), alone, 20 / 132)
    assert np.allclose(first.seconds, want, rtol=1e-12) and np.all(first.seconds > dense(2 * T * H * F))


def test_only_the_first_pipeline_stage_runs_the_dense_first_layers(flat, monkeypatch):
    """Every stage is simulated as stage 0; the dense-first layers' seconds come off the
    others, as the head's come off all but the last."""
    import sim.pipeline.run as pipeline_run

    seen = {}

    def capture(fwd, bwd, *args):
        seen["fwd"], seen["bwd"] = fwd, bwd
        return real(fwd, bwd, *args)

    real = pipeline_run.run_pipeline
    monkeypatch.setattr(pipeline_run, "run_pipeline", capture)
    s = scenario(flat, gpus=2, whole=True, cluster={"nodes_per_microcluster": 2}, parallelism={"pp_size": 2},
                 transformer={"micro_batches": 2, "first_dense_layers": 1}, workload={"tokens_per_rank": 2 * T})
    SimBackend().run(s)
    layer = dense(2 * T * (2 * H * H + 2 * H * 32)) + core(2 * 2 * T * (S / 2) * H) + dense(2 * T * 8 * H * H)
    head = dense(2 * T * H * V)
    # the memory-bound kernels (module doc): the layer's attention and dense-FFN sublayers', the loss's
    layer_f, layer_b = kernels(T * (1024 + 1664)), kernels(T * (1152 + 2304))
    loss_f, loss_b = kernels(T * 10 * V), kernels(T * 6 * V)
    fwd = seen["fwd"][:, 0]
    # stage 0: the dense layer, not the head
    assert fwd[0] - fwd[1] == pytest.approx(layer + layer_f - head - loss_f, rel=1e-9)
    assert seen["bwd"][0, 0] - seen["bwd"][1, 0] == pytest.approx(2 * (layer - head) + layer_b - loss_b, rel=1e-9)


def test_only_the_last_pipeline_stage_runs_the_mtp_modules(flat, monkeypatch):
    """Every stage is simulated as one with the MTP module's MoE layer after its own; its
    layer's seconds (the span of its phases: its block, router and experts on the stage's
    one GPU) and the head's, once per module more, come off all but the last stage."""
    import sim.pipeline.run as pipeline_run

    seen = {}

    def capture(fwd, bwd, *args):
        seen["fwd"], seen["bwd"] = fwd, bwd
        return real(fwd, bwd, *args)

    real = pipeline_run.run_pipeline
    monkeypatch.setattr(pipeline_run, "run_pipeline", capture)
    s = scenario(flat, whole=True, cluster={"nodes_per_microcluster": 2}, parallelism={"pp_size": 2},
                 transformer={"micro_batches": 2, "mtp_layers": 1}, workload={"tokens_per_rank": 2 * T})
    SimBackend().run(s)
    block = dense(2 * T * 2 * H * H) + dense(2 * T * (2 * H * H + 2 * H * 32)) + core(2 * 2 * T * (S / 2) * H)
    moe = dense(2 * T * H * E) + 4 * T * K * H * F / (PEAK * GROUPED)  # the router, the experts on T k rows
    heads = 2 * dense(2 * T * H * V)  # the model's and the module's
    # the memory-bound kernels (module doc): the two losses; the block's attention sublayer and MoE layer's
    # norm and residual add; the router's, the permutation of the T K slots, the rows' activation
    kernels_f = kernels(T * (2 * 10 * V + 1024 + 640 + 9 * E + K * 448 + K * 512))
    kernels_b = kernels(T * (2 * 6 * V + 1152 + 768 + 12 * E + K * 448 + K * 768))
    assert seen["fwd"][1, 0] - seen["fwd"][0, 0] == pytest.approx(heads + block + moe + kernels_f, rel=1e-9)
    assert seen["bwd"][1, 0] - seen["bwd"][0, 0] == pytest.approx(2 * (heads + block + moe) + kernels_b, rel=1e-9)
