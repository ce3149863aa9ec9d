"""Expert tensor parallelism and MoE parallel folding on the simulator (issue 25, item 3):
a step's bytes, expert compute and expert memory per GPU against closed forms worked out by
hand, on layouts small enough to write down, and Mixtral-8x22B's two published layouts.

The hand-worked step. W = 8 GPUs (2 nodes of 4), every GPU routing T = 1024 tokens to its
top K = 2 of E = 4 experts, each expert H = 1024 x F = 4096 SwiGLU (3 matrices, bf16: b = 2
bytes), L = 2 MoE layers; the routing is uniform (c = T K / E = 512 slots from each GPU to
each expert) and dropless. Under EP P, expert TP ETP and expert DP EDP = W / (ETP P):

- an EP group's all-to-all: a GPU keeps the 1/P of its T K slots bound for its own shard,
  sends the rest, H b bytes a row: ``W T K (P - 1) / P x H b`` a token stage;
- a GPU receives N = P (E / P) c = T K rows; its ETP group's all-gather sends each
  member's N rows to the ETP - 1 others, the reduce-scatter each member's partial sums of
  every other member's N rows: ``W (ETP - 1) T K x H b`` each (the sums in the model's
  dtype, as the payload here);
- dispatch and combine_backward = all-to-all + all-gather, combine and dispatch_backward =
  reduce-scatter + all-to-all, L times a step;
- route: every GPU's E int32 counts gathered over its TP x EP group of ETP P GPUs:
  ``L W (ETP P - 1) 4 E``;
- expert sync: the ETP P slices (E / P experts of 3 H F / ETP parameters each) all-reduced
  over their EDP replicas, ``2 (EDP - 1)`` x the slice each: ``L x 2 (EDP - 1) E 3 H F b``,
  which does not depend on ETP; plus M10's discovery, ``W (W - 1) ceil(L E / 8)``;
- a local expert computes ETP P c rows on 1/ETP of its inner dimension: the grouped GEMMs'
  ``2 x 3 x rows x H x F / ETP`` FLOPs at the profile's peak times its grouped efficiency at
  that many rows (compute-bound here), 1/ETP of the ETP-1 figure on the same ETP x the rows;
  twice that backward; besides, each row's memory-bound kernels at the memory bandwidth
  (``testbed.model.memory_bound_kernels``): SwiGLU's activation on its F / ETP columns,
  reading 2 F / ETP and writing F / ETP forward (3 F / ETP b bytes), 5 F / ETP b backward,
  and with E / P > 1 experts on a GPU the sort of the received rows by local expert and
  back, read H and write H each way (4 H b bytes a row, forward and backward);
- weights per GPU ``L (E / P) 3 H F b / ETP``, a gradient ``3 H F b / ETP``, an MoE layer's
  activations ``(T H + (E / P) ETP P c (H + 3 F / ETP)) b`` (its input, and per row the
  expert's input, the gate's and up's outputs and the output).
"""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sim.backend import ClusterSim, _record
from testbed.core.errors import ScenarioError
from testbed.run.features import check_features, used_features
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import GemmShapes, load_profile
from testbed.scenario.scenario import Scenario

W, T, K, E, H, F, L, B = 8, 1024, 2, 4, 1024, 4096, 2, 2
C = T * K // E

#: name -> (parallelism, ETP, EP): nested TP 2 x EP 2 (EDP 2), folded ETP 2 x EP 4 (EDP 1),
#: folded ETP 4 x EP 2 (EDP 1), and today's folded layout with expert TP 1 (EDP 4)
LAYOUTS = {
    "nested tp 2 ep 2": (dict(tp_size=2, ep_size=2, etp_size=2, moe_layout="nested"), 2, 2),
    "folded etp 2 ep 4": (dict(tp_size=2, ep_size=4, etp_size=2), 2, 4),
    "folded etp 4 ep 2": (dict(tp_size=2, ep_size=2, etp_size=4), 4, 2),
    "folded etp 1 ep 2": (dict(tp_size=2, ep_size=2, etp_size=1), 1, 2),
}


def scenario(parallelism: dict) -> Scenario:
    return Scenario.from_dict({
        "model": {"num_layers": L, "num_experts": E, "top_k": K, "hidden_size": H, "ffn_hidden_size": F,
                  "ffn_activation": "swiglu", "dtype": "bf16"},
        "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 1, "profile": "h100"},
        "parallelism": parallelism, "router": {"capacity_factor": 0.0},
        "transformer": {"enabled": True, "seq_len": 512, "num_heads": 8},
        "pager": {"enabled": False}, "heat": {"enabled": False},
        "workload": {"tokens_per_rank": T}, "sim": {"network_model": "analytic"},
    })


def simulate(name: str):
    """(cluster sim, decisions, phases, figures, record) of one step on uniform routing."""
    p = load_profile("h100")  # without the GEMM shape model: the curves' closed forms (sim.hardware.gemm_efficiency)
    sim = ClusterSim(scenario(LAYOUTS[name][0]), replace(p, compute=replace(p.compute, gemm=GemmShapes())))
    d, phases, _tl, fig, faults, *_ = sim.step(0, np.full((L, W, E), C), [])
    return sim, d, phases, fig, _record(0, sim, d, fig, faults)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_steps_bytes_are_the_closed_forms(name):
    _, etp, p = LAYOUTS[name]
    edp = W // (etp * p)
    a2a = W * T * K * (p - 1) // p * H * B
    around = W * (etp - 1) * T * K * H * B  # the ETP all-gather, or the reduce-scatter
    tokens = L * (a2a + around)
    expected = {"route": L * W * (etp * p - 1) * 4 * E, "dispatch": tokens, "combine": tokens,
                "combine_backward": tokens, "dispatch_backward": tokens,
                "expert_sync": L * 2 * (edp - 1) * E * 3 * H * F * B + W * (W - 1) * math.ceil(L * E / 8)}
    _, d, _, _, record = simulate(name)
    assert {k: record.bytes_by_stage.get(k, 0) for k in expected} == expected
    gathered = [op for f in d.forward for op in f.dispatch_ops if "expert-TP" in op.label]
    assert sum(op.wire_bytes for op in gathered) == L * around


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_experts_compute_one_slice_on_their_etp_groups_rows(name):
    _, etp, p = LAYOUTS[name]
    sim, d, phases, _, _ = simulate(name)
    rows = etp * p * C  # each local expert's
    compute = sim.builder.compute
    eff = load_profile("h100").compute.efficiency_at("grouped", float(rows))
    gemms = 2 * 3 * (E // p) * rows * H * (F // etp) / (compute.gemm_peak * eff) * compute.scale
    memory_bound = 3 * H * (F // etp) * B * (E // p) / compute.memory_bw
    assert gemms > max(memory_bound, 2 * compute.launch)  # compute-bound: the FLOPs' time
    # the rows' kernels (module doc): the activation, and the sort by local expert where E / P > 1
    sort = 4 * H * B if E // p > 1 else 0
    kernels_f = (E // p) * rows * (3 * (F // etp) * B + sort) / compute.memory_bw * compute.scale
    kernels_b = (E // p) * rows * (5 * (F // etp) * B + sort) / compute.memory_bw * compute.scale
    forward = [ph.seconds for ph in phases if ph.stage == "experts" and ph.kind == "compute"]
    backward = [ph.seconds for ph in phases if ph.stage == "experts_backward" and ph.kind == "compute"]
    assert len(forward) == len(backward) == L
    for fwd, bwd in zip(forward, backward):
        assert fwd == pytest.approx(np.full(W, gemms + kernels_f), rel=1e-12)
        assert bwd == pytest.approx(np.full(W, 2 * gemms + kernels_b), rel=1e-12)
    whole = compute.expert_times(np.full((1, E // p), rows), H, F, "grouped", False, 3)[0]
    # the GEMMs: 1/ETP of the ETP-1 figure on ETP x the rows
    assert forward[0][0] - kernels_f == pytest.approx(whole / etp, rel=1e-12)
    assert sim.builder.expert_rows(d.forward[0]).tolist() == [[rows] * (E // p)] * W


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_weights_gradients_and_activations_are_one_slices(name):
    _, etp, p = LAYOUTS[name]
    sim, d, _, _, _ = simulate(name)
    expert = 3 * H * F * B
    assert sim.expert_weight_bytes().tolist() == [L * (E // p) * expert // etp] * W
    assert sim.builder.expert_update_bytes == expert // etp
    rows = sim.builder.expert_rows(d.forward[0])
    assert sim.builder.activation_bytes(rows).tolist() == [(T * H + (E // p) * etp * p * C * (H + 3 * F // etp)) * B] * W


def test_the_etp_ops_are_timed_in_their_stages():
    """The nested layout's all-to-all is the ETP-1 layout's (EP 2 inside a node, the same
    bytes); its dispatch takes one ETP all-gather longer a layer, its combine one reduce-scatter."""
    sim, d, phases, nested, _ = simulate("nested tp 2 ep 2")
    _, _, _, folded, _ = simulate("folded etp 1 ep 2")
    gather = max(sim.timer.seconds(op) for op in d.forward[0].dispatch_ops if "expert-TP" in op.label)
    scatter = max(sim.timer.seconds(op) for op in d.forward[0].combine_ops if "expert-TP" in op.label)
    assert gather > 0 and scatter > 0
    assert nested.stage_time_s["dispatch"] == pytest.approx(folded.stage_time_s["dispatch"] + L * gather, rel=1e-9)
    assert nested.stage_time_s["combine"] == pytest.approx(folded.stage_time_s["combine"] + L * scatter, rel=1e-9)
    batches = [[op.label for op in ph.ops] for ph in phases if ph.stage == "dispatch" and ph.layer == 0 and ph.kind == "ops"]
    assert batches == [["tokens"] * 4, ["tokens, expert-TP all-gather"] * 4]


def test_both_backends_model_nested_and_expert_tp():
    """Both features are marked modelled on both backends (the real ranks' runs:
    tests/real/rank/test_expert_tensor_parallel.py), and the scenarios use them."""
    for parallelism in (LAYOUTS["nested tp 2 ep 2"][0], LAYOUTS["folded etp 2 ep 4"][0]):
        s = scenario(parallelism)
        assert {"parallelism.etp_size", "parallelism.moe_layout"} & set(used_features(s))
        check_features(s, "sim")
        check_features(s, "real")


def test_a_refused_expert_tp_run_leaves_no_run_folder(tmp_path):
    s = scenario(LAYOUTS["nested tp 2 ep 2"][0]).replace(pager={"enabled": True},
                                                          run={"output_dir": str(tmp_path)})
    with pytest.raises(ScenarioError, match=r"^pager.enabled = True: with parallelism.etp_size = 2 the pages"):
        run_scenario(s, "sim")
    assert not list(tmp_path.iterdir())


PUBLISHED = {"Megatron-Core TP 2 EP 4 PP 8, nested (ETP = TP = 2)": "mixtral-8x22b-128-h100-mcore.toml",
             "folded TP 2 EP 8 PP 8, ETP 1": "mixtral-8x22b-128-h100-folded.toml"}


def test_mixtral_8x22b_on_128_h100_in_both_published_layouts(tmp_path, capsys):
    """One simulated step of each (configs/published/, arXiv 2504.14960 Tables 2-3; global
    batch 256 x 4096, capacity 1.0, h100 profile). Each GPU holds 7 layers' worth of one
    whole expert in both: nested 2 experts' halves (8 / EP 4, ETP 2), folded 1 whole (8 / EP
    8). The step times are printed, not compared with the published MFU (46.3% nested,
    49.3% folded)."""
    root = Path(__file__).resolve().parents[3] / "configs" / "published"
    expert = load_scenario(root / PUBLISHED["folded TP 2 EP 8 PP 8, ETP 1"]).model.expert_bytes
    lines = []
    for name, file in PUBLISHED.items():
        s = load_scenario(root / file, [f"run.output_dir={tmp_path}", "run.steps=2", "run.warmup_steps=1"])
        summary = run_scenario(s, "sim")
        assert summary["memory_breakdown_bytes"]["expert_pages"] == 7 * expert
        lines.append(f"{name}: step {summary['step_time_s'] * 1e3:.1f} ms, MFU {summary['mfu']:.1%}, "
                     f"{summary['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
