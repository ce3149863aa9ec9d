"""Pipeline layouts and DualPipe in the simulator (issue 25, item 4: ``sim.pipeline.run``,
``sim.pipeline.stage_work``, ``testbed.policy.pipeline_stages``).

Closed forms on a profile with flat efficiency curves, no launch floor, a free network (every
link 10^12 GB/s, no latency) and memory too fast to bound a kernel: every GEMM takes its FLOPs
over peak x efficiency, and a micro-batch's sends, dispatch and combine take no time to speak
of (bytes / 10^21 B/s). One GPU per node and per stage (EP 1) unless a test says otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from sim.backend import SimBackend
from sim.pipeline.dualpipe import PARAMETER_COPIES, dualpipe_order
from testbed.core.errors import ScenarioError
from testbed.model.whole_model import shape_of
from testbed.policy.pipeline_stages import PipelineStages, stage_cluster
from testbed.run import features
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile, profile_from_dict, save_profile
from testbed.scenario.scenario import Scenario

H, F, E, K, T, S, V = 64, 128, 8, 2, 256, 128, 1000
PEAK = 10e12  # FLOP/s
DENSE, GROUPED, ATTENTION = 0.25, 0.5, 0.1  # the flat efficiencies


def _profile(tmp_path_factory, name: str, dense: float, grouped: float, attention: float) -> str:
    d = load_profile("h200").to_dict()
    d["compute"].pop("gemm", None)  # the flat curves alone: no GEMM shape model (sim.hardware.gemm_efficiency)
    d["compute"].update(memory_GBps=1e12, launch_us=0.0)
    d["compute"]["peak_tflops"].update(bf16=PEAK / 1e12, fp8=2 * PEAK / 1e12)
    d["compute"]["efficiency"] = {"grouped": [[1, grouped], [1e6, grouped]], "loop": [[1, grouped], [1e6, grouped]],
                                  "dense": [[1, dense], [1e6, dense]], "attention": [[1, attention], [1e6, attention]]}
    d["overheads"]["router_us"] = 0.0
    for link in d["links"].values():
        link.update(bandwidth_GBps=1e12, latency_us=0.0)
    d["collectives"].update(latency_us=0.0, all_to_all_peer_us=0.0, kernel_sms=0)
    return str(save_profile(profile_from_dict(d, name), tmp_path_factory.mktemp("profile") / f"{name}.toml"))


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    return _profile(tmp_path_factory, "flat-free", DENSE, GROUPED, ATTENTION)


def scenario(profile, tmp_path, pp, layers, micro, gpus=1, **sections):
    """H 64, F 128, 8 experts top-2, ``layers`` MoE layers (one every layer) in bf16, dropless,
    behind attention of 4 heads (2 KV heads) over sequences of 128 and a vocabulary of 1,000,
    SGD; ``pp`` nodes of ``gpus`` GPUs, one stage each (EP over a node); ``micro``
    micro-batches of T = 256 tokens per GPU."""
    data = {"model": {"hidden_size": H, "ffn_hidden_size": F, "num_experts": E, "top_k": K, "num_layers": layers,
                      "dtype": "bf16"},
            "cluster": {"gpus_per_node": gpus, "nodes_per_microcluster": pp, "microclusters": 1, "profile": profile},
            "parallelism": {"ep_size": gpus, "pp_size": pp}, "pager": {"enabled": False},
            "router": {"capacity_factor": 0.0}, "workload": {"tokens_per_rank": T * micro, "skew": 0.0},
            "sim": {"network_model": "analytic"},
            "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": S, "vocab_size": V,
                            "moe_every": 1, "optimizer": "sgd", "micro_batches": micro},
            "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)}}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return Scenario.from_dict(data)


def dense(flops):
    return flops / (PEAK * DENSE)


def core(flops):
    return flops / (PEAK * ATTENTION)


# one MoE layer on one GPU, one micro-batch of T tokens: attention (Q and O H x H, K and V H x 32) and its
# causal core, the router, the experts on T k rows (two H x F GEMMs each)
ATTENTION_GEMMS = dense(2 * T * (2 * H * H + 2 * H * 32))
CORE = core(2 * 2 * T * (S / 2) * H)
ROUTER = dense(2 * T * H * E)
EXPERTS = 2 * 2 * T * K * H * F / (PEAK * GROUPED)
LAYER = ATTENTION_GEMMS + CORE + ROUTER + EXPERTS
HEAD = dense(2 * T * H * V)


def test_uneven_stages_take_their_layers_seconds(flat, tmp_path):
    """``Etttt|t|tL`` on 3 stages: 4, 1 and 1 MoE layers; a stage's forward and backward are its
    layers' (the closed form of one), the last stage's the head's besides; the stage of 4 layers
    takes 4 times the time of the stage of 1."""
    s = scenario(flat, tmp_path, 3, 6, 3, parallelism={"pipeline_layout": "Etttt|t|tL"})
    pipe = run_scenario(s, "sim")["pipeline"]
    assert pipe["stage_layers"] == [4, 1, 1] and pipe["stage_moe_layers"] == [4, 1, 1]
    assert pipe["layout"] == "Etttt|t|tL" and pipe["simulated_stages"] == 2  # 4 layers; 1 layer (twice)
    fwd = [row[0] for row in pipe["stage_forward_s"]]
    bwd = [row[0] for row in pipe["stage_backward_s"]]
    assert fwd[1] == pytest.approx(LAYER, rel=1e-9)
    assert bwd[1] == pytest.approx(2 * LAYER, rel=1e-9)
    assert fwd[0] == pytest.approx(4 * fwd[1], rel=1e-9) and bwd[0] == pytest.approx(4 * bwd[1], rel=1e-9)
    assert fwd[2] - fwd[1] == pytest.approx(HEAD, rel=1e-9)  # the head, on the last stage only
    assert bwd[2] - bwd[1] == pytest.approx(2 * HEAD, rel=1e-9)


def test_the_embedding_and_head_are_held_on_their_stages_only(flat, tmp_path):
    """The same layout: stage 0 holds the embedding (V x H), stage 2 the head (V x H), stage 1
    neither; the logits (T x V in bf16) are kept on stage 2 only. Each stage's other weights
    are its layers' attention (bf16) and routers (fp32). In flight: as many micro-batches of
    each stage's activations as 1F1B keeps."""
    s = scenario(flat, tmp_path, 3, 6, 3, parallelism={"pipeline_layout": "Etttt|t|tL"})
    pipe = run_scenario(s, "sim")["pipeline"]
    assert pipe["embedding_stages"] == [0] and pipe["loss_stages"] == [2]
    params = [m["parameters"] for m in pipe["stage_memory_breakdown_bytes"]]
    layer = shape_of(s).attention_params * 2 + (H * E + E) * 4
    assert params[1] == pytest.approx(layer, rel=1e-12)
    assert params[0] == pytest.approx(4 * layer + V * H * 2, rel=1e-12)
    assert params[2] == pytest.approx(layer + V * H * 2, rel=1e-12)
    held = [row[0] for row in pipe["stage_held_bytes"]]
    assert held[2] - held[1] == T * V * 2
    assert held[0] == 4 * held[1]
    # 1F1B: stage s keeps p - s micro-batches in flight, each its layers' activations (and logits)
    assert pipe["in_flight"] == [3, 2, 1]
    assert pipe["in_flight_bytes"] == [3 * held[0], 2 * held[1], held[2]]


def test_decoder_first_and_last_make_uneven_ends(flat, tmp_path):
    """Megatron's --decoder-first/last-pipeline-num-layers: 8 layers on 3 stages, 2 on the first
    and 2 on the last, 4 on the middle one."""
    s = scenario(flat, tmp_path, 3, 8, 3, parallelism={"decoder_first_pipeline_num_layers": 2,
                                                        "decoder_last_pipeline_num_layers": 2})
    pipe = run_scenario(s, "sim")["pipeline"]
    assert pipe["stage_layers"] == [2, 4, 2]
    fwd = [row[0] for row in pipe["stage_forward_s"]]
    assert fwd[1] == pytest.approx(2 * fwd[0], rel=1e-9) and fwd[2] - fwd[0] == pytest.approx(HEAD, rel=1e-9)


def test_the_even_split_spelt_as_a_layout_runs_the_same_step(flat, tmp_path):
    """The testbed's split without the layout fields (L / p MoE layers a stage) is the layout
    string it spells: the same step to the float, whichever way it is given."""
    plain = SimBackend().run(scenario(flat, tmp_path, 2, 4, 4)).records[0]
    spelt = SimBackend().run(scenario(flat, tmp_path, 2, 4, 4, parallelism={"pipeline_layout": "Ett|ttL"})).records[0]
    assert spelt.step_time_s == plain.step_time_s
    assert spelt.bytes_by_stage == plain.bytes_by_stage and spelt.peak_memory_bytes == plain.peak_memory_bytes


@pytest.mark.parametrize("stages, chunks, layers, expect", [
    (2, 1, 4, [[2], [2]]),
    (2, 2, 8, [[2, 2], [2, 2]]),
])
def test_interleaved_chunks_each_take_their_layers(flat, tmp_path, stages, chunks, layers, expect):
    """v chunks per stage: each its L / (p v) layers' seconds, the head only on the last chunk of
    the last stage."""
    s = scenario(flat, tmp_path, stages, layers, 4, parallelism={"pp_chunks": chunks})
    pipe = run_scenario(s, "sim")["pipeline"]
    assert pipe["stage_chunk_layers"] == expect
    fwd = np.array(pipe["stage_forward_s"])
    want = np.full(fwd.shape, layers // (stages * chunks) * LAYER)
    want[-1, -1] += HEAD
    np.testing.assert_allclose(fwd, want, rtol=1e-9)
    assert pipe["schedule"] == ("interleaved" if chunks > 1 else "1f1b")
    np.testing.assert_allclose(pipe["stage_bubble_s"], np.array(pipe["stage_bubble_fraction"]) * pipe["makespan_s"],
                               rtol=1e-12)


# ---- DualPipe -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def regime(tmp_path_factory):
    """Slow GEMMs beside a fast attention core (dense and grouped GEMMs at 1% of peak, the
    core at 100%): the core's forward is 2 x 10^-4 of a layer's, so the input-gradient
    backward takes the forward's time to that (DeepSeek-V3's Fig. 5 proportions: B - W = F)."""
    return _profile(tmp_path_factory, "gemm-bound", 0.01, 0.01, 1.0)


def _dualpipe(profile, tmp_path, p=4, m=8, hidden=1024, vocab=1, seq=16):
    return scenario(profile, tmp_path, p, 8, m, model={"hidden_size": hidden, "ffn_hidden_size": 2 * hidden},
                    transformer={"vocab_size": vocab, "seq_len": seq}, parallelism={"pipeline_schedule": "dualpipe"})


def _durations(pipe: dict) -> dict[str, np.ndarray]:
    f, b, w = (np.array(pipe[k]) for k in ("stage_forward_s", "stage_backward_s", "stage_weight_s"))
    return {"F": f, "B": b, "I": b - w, "W": w, "F&B": np.array(pipe["stage_overlapped_s"])}


def test_dualpipe_splits_the_backward_as_its_gemms(flat, tmp_path):
    """A middle stage's chunk of 2 MoE layers: the weight gradient is the forward's GEMMs (the
    attention's projections, router, experts) without the attention core; nothing to hide on
    a free network, so an overlapped pair takes the two chunks' compute, 3 x the forward."""
    pipe = run_scenario(_dualpipe(flat, tmp_path, hidden=H, vocab=V, seq=S), "sim")["pipeline"]
    assert pipe["schedule"] == "dualpipe" and pipe["chunks"] == 1 and pipe["parameter_copies"] == PARAMETER_COPIES
    assert pipe["embedding_stages"] == [0, 3] and pipe["loss_stages"] == [0, 3]  # chunks 0 and 3 on both ends
    assert pipe["stage_layers"] == [4, 4, 4, 4]
    d = _durations(pipe)
    assert d["W"][1, 0] == pytest.approx(2 * (ATTENTION_GEMMS + ROUTER + EXPERTS), rel=1e-9)
    assert d["F&B"][1, 0] == pytest.approx(3 * 2 * LAYER, rel=1e-9)
    assert d["F&B"][0, 1] == pytest.approx(3 * 2 * LAYER + HEAD, rel=1e-9)  # chunk 3's forward: the head's


def test_dualpipe_bubble_and_activations_are_table_2s(regime, tmp_path):
    """DeepSeek-V3's Table 2 end to end: on equal stages with B - W = F, W <= F,
    max(F, B) <= F&B <= F + B and free sends, DualPipe's bubble is (PP/2 - 1)(F&B + B - 3W)
    and a stage holds at most PP + 1 micro-batches' chunk activations.

    The run's F, B, W and F&B (read from its result) are those of the middle stages; the
    stages and the regime are equal only up to what the run adds: the head (vocabulary 1)
    on the two end stages, the core's 2 x 10^-4, the combine's local reduction, the sends.
    The schedule is max-plus, so its makespan moves by at most the sum of every op's and
    send's deviation from the equal regime, a stage's busy time by its own ops': that bound
    (under 1% of the bubble here) is the tolerance."""
    p, m = 4, 8
    pipe = run_scenario(_dualpipe(regime, tmp_path, p, m), "sim")["pipeline"]
    d = _durations(pipe)
    f, w = d["F"][1, 0], d["W"][1, 0]
    b = f + w  # the regime's whole backward
    fb = min(max(d["F&B"][1, 0], f, b), f + b)
    ideal = {"F": f, "B": b, "I": f, "W": w, "F&B": fb}
    assert w <= f
    table = (p / 2 - 1) * (fb + b - 3 * w)

    def deviation(s: int) -> float:
        return sum(abs(d[op.kind][s, op.direction] - ideal[op.kind]) for op in dualpipe_order(p, m, s))

    sends = 2 * m * max(pipe["send_s"][:-1]) * (p - 1)
    everything = sum(deviation(s) for s in range(p)) + sends
    for s in (1, 2):  # the middle stages: Table 2's bubble
        bound = everything + deviation(s)
        assert bound < 0.01 * table
        assert pipe["stage_bubble_s"][s] == pytest.approx(table, abs=bound + 1e-12 * pipe["makespan_s"])
    assert pipe["in_flight"] == [p, p + 1, p + 1, p]  # Table 2: PP + 1 on the middle stages, PP on the others


def test_dualpipe_holds_two_chunks_weights(flat, tmp_path):
    """Each DualPipe stage holds two model chunks (2x parameters, Table 2): twice the expert
    weights of a 1F1B stage of the same scenario."""
    dual = run_scenario(_dualpipe(flat, tmp_path, hidden=H, vocab=V, seq=S), "sim")
    plain_s = _dualpipe(flat, tmp_path, hidden=H, vocab=V, seq=S).replace(parallelism={"pipeline_schedule": "1f1b"})
    plain = run_scenario(plain_s, "sim")
    assert dual["memory_breakdown_bytes"]["expert_pages"] == 2 * plain["memory_breakdown_bytes"]["expert_pages"]
    assert dual["pipeline"]["stage_moe_layers"] == [4] * 4 and plain["pipeline"]["stage_moe_layers"] == [2] * 4


@pytest.mark.parametrize("over, field", [
    ({"parallelism": {"pp_size": 3}, "cluster": {"nodes_per_microcluster": 3}, "model": {"num_layers": 6}},
     "parallelism.pp_size"),
    ({"parallelism": {"pp_chunks": 2}}, "parallelism.pp_chunks"),
    ({"transformer": {"micro_batches": 6}, "workload": {"tokens_per_rank": 6 * T}}, "transformer.micro_batches"),
    ({"transformer": {"micro_batches": 9}, "workload": {"tokens_per_rank": 9 * T}}, "transformer.micro_batches"),
])
def test_dualpipe_refusals_name_the_field(flat, tmp_path, over, field):
    s = _dualpipe(flat, tmp_path, hidden=H, vocab=V, seq=S)
    data = s.to_dict()
    for section, values in over.items():
        data[section].update(values)
    with pytest.raises(ScenarioError, match=rf"^{field} = .*dualpipe"):
        SimBackend().check(Scenario.from_dict(data))


# ---- DeepSeek-V3's layout ---------------------------------------------------------------------
def test_deepseek_v3_layout_on_pp8(tmp_path):
    """DeepSeek-V3 on 1,024 H100 (issue 25): ``Et*3|(tt|)*29m|L``, PP 8 with 4 virtual chunks, 61
    layers (3 dense-first, 58 MoE) and one MTP module, here at H 128 on 8 nodes of 2 A100s:
    rank 0 holds the embedding and the dense-first layers, rank 6 the MTP module, rank 7 the
    loss, and the ranks 9, 8, 8, 8, 8, 8, 6, 6 transformer layers."""
    s = Scenario.from_dict({
        "model": {"hidden_size": 128, "ffn_hidden_size": 64, "num_layers": 58, "num_experts": 8, "top_k": 2,
                  "shared_experts": 1, "ffn_activation": "swiglu", "dtype": "bf16"},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 8, "microclusters": 1, "profile": "a100-seed"},
        "parallelism": {"ep_size": 2, "pp_size": 8, "pp_chunks": 4, "pipeline_layout": "Et*3|(tt|)*29m|L"},
        "pager": {"enabled": False}, "router": {"capacity_factor": 0.0},
        "transformer": {"enabled": True, "num_heads": 4, "seq_len": 64, "vocab_size": 512, "first_dense_layers": 3,
                        "dense_ffn_hidden_size": 256, "attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 16,
                        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mtp_layers": 1,
                        "micro_batches": 8},
        "workload": {"tokens_per_rank": 8 * 64}, "sim": {"network_model": "analytic"},
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)}})
    out = run_scenario(s, "sim")
    pipe = out["pipeline"]
    assert pipe["stage_layers"] == [9, 8, 8, 8, 8, 8, 6, 6]
    assert pipe["stage_moe_layers"] == [6, 8, 8, 8, 8, 8, 6, 6] and pipe["stage_mtp_layers"] == [0] * 6 + [1, 0]
    assert pipe["stage_chunk_layers"][0] == [3, 2, 2, 2] and pipe["stage_chunk_layers"][7] == [2, 2, 2, 0]
    assert pipe["embedding_stages"] == [0] and pipe["loss_stages"] == [7]
    assert pipe["simulated_stages"] == 4  # (3 dense-first, 6 MoE), 8 MoE, (6 MoE, 1 MTP), 6 MoE
    assert pipe["schedule"] == "interleaved" and len(pipe["stage_bubble_s"]) == 8
    assert all(0 < x < 1 for x in pipe["stage_bubble_fraction"])
    fwd = np.array(pipe["stage_forward_s"])
    assert fwd[0, 0] < fwd[1, 0]  # three dense layers against two MoE ones
    assert fwd[7, 3] > 0 and fwd[6, 3] > 0  # the head and loss; the MTP module
    assert out["fits_in_device_memory"]


# ---- refusals and features ------------------------------------------------------------------
def test_a_bad_layout_is_one_line_naming_the_field(flat, tmp_path):
    s = scenario(flat, tmp_path, 2, 4, 2, parallelism={"pipeline_layout": "Ett|tL"})
    with pytest.raises(ScenarioError, match=r"^parallelism.pipeline_layout = 'Ett\|tL': 3 transformer layers \(t\), "
                                            r"the model has 4$"):
        SimBackend().check(s)
    with pytest.raises(ScenarioError, match="parallelism.pipeline_layout"):
        run_scenario(s, "sim")
    assert not list(tmp_path.iterdir())  # refused before any run folder


def test_testbed_check_refuses_a_bad_layout(flat, tmp_path, capsys):
    from testbed.cli.main import main as cli_main

    path = tmp_path / "s.toml"
    import tomli_w

    s = scenario(flat, tmp_path, 2, 4, 2, parallelism={"pipeline_layout": "Ett|t*2*L"})
    path.write_text(tomli_w.dumps(s.to_dict()))
    assert cli_main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallelism.pipeline_layout = 'Ett|t*2*L'" in err[0]


@pytest.mark.parametrize("over, field", [
    ({"parallelism": {"pipeline_layout": "Et|t|t|tL", "pp_chunks": 1}}, "parallelism.pp_chunks"),
    ({"parallelism": {"pipeline_layout": "Ett|ttL", "decoder_first_pipeline_num_layers": 2}},
     "parallelism.decoder_first_pipeline_num_layers"),
    ({"parallelism": {"pipeline_layout": "Etttt|L"}}, "parallelism.pipeline_layout"),  # rank 1: no MoE layer
    ({"parallelism": {"pipeline_layout": "Et|tttL"}, "transformer": {"moe_every": 2}, "model": {"num_layers": 2}},
     "parallelism.pipeline_layout"),  # stage 0 splits MoE layer 0's block
])
def test_layouts_the_simulator_cannot_run_are_refused(flat, tmp_path, over, field):
    s = scenario(flat, tmp_path, 2, 4, 2, **over)
    with pytest.raises(ScenarioError, match=rf"^{field} = "):
        SimBackend().check(s)


def test_stages_are_any_whole_number_of_nodes(flat, tmp_path):
    """8 one-GPU nodes in 2 micro-clusters of 4: stages of one node, two, or a micro-cluster;
    a stage of 3 nodes of micro-clusters of 2 would hold parts of two."""
    def stage(pp, per_microcluster=4, microclusters=2):
        return stage_cluster(scenario(flat, tmp_path, pp, 8, pp, cluster={"nodes_per_microcluster": per_microcluster,
                                                                          "microclusters": microclusters}))
    assert stage(8) == {"microclusters": 1, "nodes_per_microcluster": 1}
    assert stage(4) == {"microclusters": 1, "nodes_per_microcluster": 2}
    assert stage(2) == {"microclusters": 1}
    assert stage(2, 2, 4) == {"microclusters": 2}
    pipe = run_scenario(scenario(flat, tmp_path, 8, 8, 8, cluster={"nodes_per_microcluster": 4, "microclusters": 2}),
                        "sim")["pipeline"]
    assert pipe["stages"] == 8 and pipe["stage_layers"] == [1] * 8
    with pytest.raises(ScenarioError, match=r"^parallelism.pp_size = 2: .*whole nodes"):
        scenario(flat, tmp_path, 2, 6, 2, cluster={"nodes_per_microcluster": 2, "microclusters": 3})


def test_the_pipeline_fields_run_on_the_simulator_only(flat, tmp_path):
    """issue 25's pipeline fields: modelled by the simulator, refused on the real backend."""
    for name, value in (("pipeline_layout", "Ett|ttL"), ("decoder_first_pipeline_num_layers", 1),
                        ("decoder_last_pipeline_num_layers", 1), ("pipeline_schedule", "dualpipe")):
        s = scenario(flat, tmp_path, 2, 4, 4, parallelism={name: value})
        assert features.used_features(s) == [f"parallelism.{name}"]
        features.check_features(s, "sim")
        with pytest.raises(ScenarioError, match=rf"parallelism.{name} = .*the real backend does not model this yet"):
            features.check_features(s, "real")
        assert run_scenario(s, "sim")["pipeline"]["stages"] == 2


def test_stages_with_one_layer_mix_share_one_simulation(flat, tmp_path):
    st = PipelineStages.of(scenario(flat, tmp_path, 3, 6, 3, parallelism={"pipeline_layout": "Etttt|t|tL"}))
    assert st.simulated == (0, 1, 1) and len(st.scenarios) == 2
    assert [x.model.num_layers for x in st.scenarios] == [4, 1]
    assert st.scenarios[1].parallelism.pipeline_layout == "" and st.scenarios[1].parallelism.pp_size == 1
