"""Megatron-Core's recompute by module on the simulator (issue 25 item 6,
``transformer.recompute_modules``): each module alone on a small whole transformer, on a
profile with flat efficiency curves, no launch floor and no router cost, saves per layer
``LayerRecompute.saved_bytes`` x tokens (the hand numbers of
tests/testbed/policy/test_recompute_modules.py's shape) and adds to the backward its
recomputed work at the compute model's rates (GEMMs' FLOPs over peak x efficiency,
memory-bound kernels' bytes over the bandwidth); ``moe`` runs the layer's dispatch and
combine again (the same ops, the byte ledger unchanged); DeepSeek-V3's Megatron recipe on
configs/deepseek-like-cpu.toml lowers every GPU's peak by its layers' savings; the
refusals name the field."""

import numpy as np
import pytest

from sim.backend import ClusterSim, SimBackend, routing_source
from sim.step.memory_breakdown import memory_breakdown
from testbed.core.errors import ScenarioError
from testbed.model.mtp_layers import controller_scenario
from testbed.model.recompute_modules import LayerRecompute
from testbed.model.whole_model import shape_of
from testbed.run import features
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import load_profile, profile_from_dict, save_profile
from testbed.scenario.scenario import Scenario

#: tests/testbed/policy/test_recompute_modules.py's SMALL: H 64, 4 heads of 16, SwiGLU dense FFN of 128,
#: 8 experts of 32, top 2, one shared expert of 48; here 4 layers (dense, MoE, dense, MoE) on T tokens
H, F, E, K, FS, FD, T, S, V = 64, 32, 8, 2, 48, 128, 256, 128, 1000
PEAK, BW = 10e12, 1e12  # FLOP/s (bf16), bytes/s
DENSE, GROUPED, ATTENTION = 0.25, 0.5, 0.1  # the flat efficiencies
ROWS = T * K  # one GPU, dropless: every token's rows
#: bytes per token each module saves of a dense layer and of an MoE layer (bf16; the policy test's hand numbers)
SAVED = {"core_attn": (16, 16), "mlp": (128 + 512 + 256, 0), "layernorm": (0, 128), "moe_act": (0, 2 * 64),
         "shared_experts": (0, 192 + 96), "moe": (0, 32 + 8 + 2 * 324 + 192 + 96)}
MLA = {"attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 8}
V3_RECIPE = "mlp,mla_up_proj,moe_act,layernorm"  # issue 25: DeepSeek-V3 on 1,024 H100


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """The H200 profile with flat efficiency curves, no launch floor, no router cost."""
    d = load_profile("h200").to_dict()
    d["compute"].pop("gemm", None)  # the flat curves alone: no GEMM shape model (sim.hardware.gemm_efficiency)
    d["collectives"]["kernel_sms"] = 0  # no SMs taken by NCCL kernels (sim.step.kernel_sms)
    d["compute"].update(memory_GBps=BW / 1e9, launch_us=0.0)
    d["compute"]["peak_tflops"].update(bf16=PEAK / 1e12)
    d["compute"]["efficiency"] = {"grouped": [[1, GROUPED], [1e6, GROUPED]], "loop": [[1, GROUPED], [1e6, GROUPED]],
                                  "dense": [[1, DENSE], [1e6, DENSE]], "attention": [[1, ATTENTION], [1e6, ATTENTION]]}
    d["overheads"]["router_us"] = 0.0
    return str(save_profile(profile_from_dict(d, "flat"), tmp_path_factory.mktemp("profile") / "flat.toml"))


def scenario(profile, modules="", gpus=1, **sections):
    data = {"model": {"hidden_size": H, "ffn_hidden_size": F, "num_experts": E, "top_k": K, "num_layers": 2,
                      "dtype": "bf16", "ffn_activation": "swiglu", "shared_experts": 1, "shared_ffn_hidden_size": FS},
            "transformer": {"enabled": True, "num_heads": 4, "seq_len": S, "vocab_size": V, "moe_every": 2,
                            "dense_ffn_hidden_size": FD, "optimizer": "sgd", "recompute_modules": modules},
            "cluster": {"gpus_per_node": gpus, "nodes_per_microcluster": 1, "microclusters": 1, "profile": profile},
            "parallelism": {"ep_size": gpus}, "pager": {"enabled": False}, "router": {"capacity_factor": 0.0},
            "overlap": {"shared_experts": False}, "workload": {"tokens_per_rank": T, "skew": 0.0},
            "sim": {"network_model": "analytic"}, "run": {"steps": 1, "warmup_steps": 0}}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return Scenario.from_dict(data)


def step(s):
    """(decisions, phases, step figures, memory breakdown of the fullest GPU) of step 0."""
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    d, phases, _, fig, *_ = sim.step(0, np.asarray(routing_source(controller_scenario(s))(0)), [])
    return d, phases, fig, memory_breakdown(sim, d, phases, int(np.argmax(fig.peak_by_rank)))


def dense(flops):
    return flops / (PEAK * DENSE)


def core(flops):
    return flops / (PEAK * ATTENTION)


def grouped(flops):
    return flops / (PEAK * GROUPED)


def memory(elements):
    """A memory-bound kernel moving ``elements`` bf16 elements."""
    return elements * 2 / BW


def shared_forward():
    """The shared expert's forward on T tokens: gate and up H x 2 F_s, down F_s x H."""
    return dense(2 * T * H * 2 * FS) + dense(2 * T * FS * H)


#: seconds each module adds to a stage's backward, over the model's 2 dense and 2 MoE layers
ADDED = {
    # attention's core, causal (half the keys), 4 heads of 16, in all 4 layers
    "core_attn": {"dense_backward": 4 * core(T * 2 * 2 * (S / 2) * 64)},
    # the dense FFN's GEMMs; SwiGLU reads 2 F_d and writes F_d, the fused norm reads and writes H
    "mlp": {"dense_backward": 2 * (dense(2 * T * (H * 2 * FD + FD * H)) + memory(T * (3 * FD + 2 * H)))},
    # the MoE layers' pre-MLP norm (GQA's input norm and a dense layer's are inside their linears)
    "layernorm": {"dense_backward": 2 * memory(T * 2 * H)},
    # each row's SwiGLU: reads 2 F, writes F
    "moe_act": {"experts_backward": 2 * memory(ROWS * 3 * F)},
    # their forward again: the GEMMs and the SwiGLU between them (reads 2 F_s, writes F_s), as the forward's
    "shared_experts": {"experts_backward": 2 * (shared_forward() + memory(T * 3 * FS))},
    # the MoE FFN's forward again, as the forward times it: the router with its scores' kernel (9 E bytes a
    # token) and the permutation of its K slots (2 H + H + H / K = 224 values a slot, 448 bytes); the experts'
    # GEMMs and each row's SwiGLU (3 F values; one GPU: no sort); the shared expert with its SwiGLU
    "moe": {"route_backward": 2 * (dense(2 * T * H * E) + T * (9 * E + K * 448) / BW),
            "experts_backward": 2 * (grouped(2 * 3 * ROWS * H * F) + memory(ROWS * 3 * F) + shared_forward()
                                     + memory(T * 3 * FS))},
}


@pytest.mark.parametrize("module", list(SAVED))
def test_each_module_alone_saves_its_tensors_and_adds_its_recompute(flat, module):
    base, s = scenario(flat), scenario(flat, module)
    (_, _, before, a), (_, _, after, b) = step(base), step(s)
    shape = shape_of(s)
    per_token = [LayerRecompute(shape, moe, S).saved_bytes(module, rows_per_token=K) for moe in (False, True)]
    assert tuple(per_token) == SAVED[module]
    saved = 2 * T * sum(per_token)  # 2 dense and 2 MoE layers
    if module == "moe":  # the simulator's rows leave out the fp32 probability (4 bytes a row) moe frees
        saved -= 2 * T * K * 4
    assert a["activations"] - b["activations"] == saved
    assert before.peak_memory_bytes - after.peak_memory_bytes == saved
    added = ADDED[module]
    for stage, seconds in added.items():
        assert after.stage_time_s[stage] - before.stage_time_s[stage] == pytest.approx(seconds, rel=1e-9)
    for stage in set(before.stage_time_s) - set(added) - {"optimizer"}:
        assert after.stage_time_s[stage] == pytest.approx(before.stage_time_s[stage], rel=1e-12), stage
    # on one GPU the recompute is on the critical path: the step is that much longer
    assert after.step_time_s - before.step_time_s == pytest.approx(sum(added.values()), rel=1e-9)


@pytest.mark.parametrize("module, saved", [("mla_up_proj", (352, 352)), ("layernorm", (128, 256))])
def test_mla_s_modules(flat, module, saved):
    """MLA (latents 32 and 16, d_nope 8, d_rope 4, d_v 8), per token and layer:
    mla_up_proj frees the normed latents (48 elements), Q, K (48 each) and V (32) and runs
    the two up projections (32 x 48, 16 x 64), their fused norms (reading and writing 48)
    and RoPE (reading 116, writing 128) again; layernorm frees MLA's input norm's output
    (its own norm), and the MoE layers' pre-MLP norm's."""
    base, s = scenario(flat, transformer=MLA), scenario(flat, module, transformer=MLA)
    (_, _, before, a), (_, _, after, b) = step(base), step(s)
    shape = shape_of(s)
    assert tuple(LayerRecompute(shape, moe, S).saved_bytes(module) for moe in (False, True)) == saved
    assert a["activations"] - b["activations"] == 2 * T * sum(saved)
    if module == "mla_up_proj":
        seconds = 4 * (dense(2 * T * (32 * 48 + 16 * 64)) + memory(T * ((48 + 64 + 4) + (48 + 48 + 32) + 2 * 48)))
    else:
        seconds = 2 * memory(T * 2 * H) + 2 * memory(T * 2 * 2 * H)
    added = after.stage_time_s["dense_backward"] - before.stage_time_s["dense_backward"]
    assert added == pytest.approx(seconds, rel=1e-9)
    assert after.step_time_s - before.step_time_s == pytest.approx(seconds, rel=1e-9)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_under_tensor_parallelism_a_gpu_saves_its_share(flat, sequence_parallel):
    """TP 2 (no shared expert: refused there): the layer's tensors split over the 2 GPUs
    as ``LayerRecompute.kept_bytes`` splits them - mlp's FFN outputs by columns, the
    pre-MLP norm's output whole or, with sequence parallelism, split too - on the group's
    2 T tokens; core_attn's softmax statistics by heads."""
    tp = {"parallelism": {"tp_size": 2, "sequence_parallel": sequence_parallel}, "model": {"shared_experts": 0}}
    base, s = scenario(flat, gpus=2, **tp), scenario(flat, "mlp,core_attn", gpus=2, **tp)
    (_, _, _, a), (_, _, _, b) = step(base), step(s)
    dense_layer, moe_layer = (LayerRecompute(shape_of(s), moe, S) for moe in (False, True))
    split = {"tp": 2, "sequence_parallel": sequence_parallel}
    saved = 2 * 2 * T * sum(layer.kept_bytes((), **split) - layer.kept_bytes(("mlp", "core_attn"), **split)
                            for layer in (dense_layer, moe_layer))
    norm = 128 / 2 if sequence_parallel else 128
    assert saved == 2 * 2 * T * ((512 + 256) / 2 + norm + 2 * 16 / 2)
    assert a["activations"] - b["activations"] == saved


def test_moe_s_recompute_frees_every_row_where_megatron_s_saving_is_more_than_the_simulator_counts(flat):
    """Experts of F 128 > H: a row here keeps H + 3 F = 448 elements (896 bytes), less
    than the 900 Megatron-Core's moe frees of it (those and a 4-byte prob, left out here): the
    rows then keep nothing; the router's scores and map (40 bytes a token) and the shared
    expert's 288 go as before."""
    wide = {"ffn_hidden_size": 128}
    (_, _, _, a), (_, _, _, b) = step(scenario(flat, model=wide)), step(scenario(flat, "moe", model=wide))
    assert LayerRecompute(shape_of(scenario(flat, model=wide)), True, S).saved_bytes("moe") == 40 + 2 * 900 + 288
    assert a["activations"] - b["activations"] == 2 * (T * (40 + 288) + ROWS * 896)


def test_moe_runs_the_layer_s_dispatch_and_combine_again_before_its_backward(flat):
    """Two GPUs: each layer's backward starts with moe's recompute - the route, the
    forward's dispatch ops once more, the experts, the forward's combine ops once more -
    then the backward. The planner's ledger counts the exchange once; the links
    carry it twice."""
    plain, s = scenario(flat, gpus=2), scenario(flat, "moe", gpus=2)
    d, phases, _, _ = step(s)
    for f in d.forward:
        mine = [ph for ph in phases if ph.layer == f.layer]
        back = mine[[ph.stage for ph in mine].index("route_backward"):]  # the layer's backward, from the recompute
        assert [ph.stage for ph in back[:4]] == ["route_backward", "dispatch_backward", "experts_backward",
                                                 "combine_backward"]
        for again, planned in ((back[1].ops, f.dispatch_ops), (back[3].ops, f.combine_ops)):
            assert [(op.kind, op.members) for op in again] == [(op.kind, op.members) for op in planned]
            assert all(np.array_equal(x.matrix, y.matrix) for x, y in zip(again, planned))
            assert all(x is not y for x, y in zip(again, planned))
        # then the backward: the shared expert's (in order, before the exchange), the combine_backward
        assert back[4].stage == "experts_backward" and back[4].ops is None
        assert back[5].stage == "combine_backward" and back[5].ops == d.backward[f.layer].combine_backward_ops
    one, two = SimBackend().run(plain).records[0], SimBackend().run(s).records[0]
    assert two.bytes_by_stage == one.bytes_by_stage
    assert sum(two.wire_bytes_by_level.values()) > sum(one.wire_bytes_by_level.values())
    assert two.step_time_s > one.step_time_s


def test_deepseek_v3_s_recipe_lowers_every_gpu_s_peak_by_its_layers_savings():
    """configs/deepseek-like-cpu.toml (fp32; MLA; a dense-first layer, 2 MoE layers and an
    MTP module's; 4 GPUs) with mlp, mla_up_proj, moe_act and layernorm: every GPU's peak
    drops by T x each layer's per-token saving (``LayerRecompute.kept_bytes`` without
    and with the recipe, at fp32) plus each MoE layer's rows there x a row's saving."""
    base = load_scenario("configs/deepseek-like-cpu.toml").replace(run={"steps": 1, "warmup_steps": 0})
    s = base.replace(transformer={"recompute_modules": V3_RECIPE})
    (_, _, before, a), (d, _, after, b) = step(base), step(s)
    recipe, tokens = V3_RECIPE.split(","), s.workload.tokens_per_rank
    shape, seq = shape_of(s), s.transformer.seq_len
    dense_layer, moe_layer = LayerRecompute(shape, False, seq), LayerRecompute(shape, True, seq)
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    saved = tokens * (dense_layer.kept_bytes((), 4) - dense_layer.kept_bytes(recipe, 4))
    for f in d.forward:  # the 2 MoE layers and the MTP module's
        rows = sim.builder.expert_rows(f).sum(axis=1)
        per_token = rows / tokens
        saved = saved + tokens * np.array([moe_layer.kept_bytes((), 4, rows_per_token=r)
                                           - moe_layer.kept_bytes(recipe, 4, rows_per_token=r) for r in per_token])
    assert len(d.forward) == 3 and np.all(saved > 0)
    assert before.peak_by_rank - after.peak_by_rank == pytest.approx(saved, rel=1e-12)
    assert a["activations"] - b["activations"] == pytest.approx(saved[np.argmax(after.peak_by_rank)], rel=1e-12)
    assert after.step_time_s > before.step_time_s


def test_both_backends_model_recompute_modules_and_the_simulator_saves_and_pays(flat, tmp_path):
    """Marked modelled on both (the real ranks': tests/real/rank/test_recompute_modules.py)."""
    s = scenario(flat, "mlp,layernorm", run={"output_dir": str(tmp_path)})
    assert "transformer.recompute_modules" in features.used_features(s)
    features.check_features(s, "sim")
    features.check_features(s, "real")
    summary = run_scenario(s, "sim")
    plain = step(scenario(flat))[2]
    assert summary["peak_memory_bytes"] == plain.peak_memory_bytes - 2 * T * (896 + 128)  # mlp's and layernorm's
    assert summary["step_time_s"] > plain.step_time_s


@pytest.mark.parametrize("sections, reason", [
    ({"sim": {"expert_kernel": "loop"}, "transformer": {"recompute_modules": "moe_act"}},
     "only supported with grouped expert GEMMs"),
    ({"transformer": {"recompute_modules": "mla_up_proj"}}, "only supported with multi_latent_attention"),
    ({"overlap": {"shared_experts": True}, "transformer": {"recompute_modules": "shared_experts"}},
     "shared-expert overlap"),
    ({"transformer": {"recompute_modules": "core_attn", "recompute": "full"}}, "recompute = 'full'"),
    ({"transformer": {"recompute_modules": "mlp", "enabled": False}}, "needs transformer.enabled"),
])
def test_a_refused_combination_names_the_field(flat, sections, reason):
    s = scenario(flat, **sections)
    modules = s.transformer.recompute_modules
    with pytest.raises(ScenarioError, match=rf"^transformer.recompute_modules = '{modules}': .*{reason}"):
        SimBackend().check(s)
