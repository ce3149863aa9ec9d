"""Ulysses attention (``parallelism.attention_parallel = "ulysses"``, ``testbed.policy.ulysses``)
on a tiny scenario, bytes by hand: 8 GPUs, 4 a node, U = tp_size GPUs a group, H 128, 8 heads
of 16, 256 tokens a GPU in bf16; one head's values of a GPU's own rows are 256 x 16 x 2 =
8,192 bytes, so Q and the attention's output are 8 x 8,192 = 65,536 bytes and K and V
k x 8,192 each (k kv heads)."""

import pytest

from sim.hardware.compute import ComputeModel
from sim.hardware.dense_layers import DenseLayers
from sim.hardware.model_support import check_model_support
from testbed.core.errors import ScenarioError
from testbed.model.whole_model import shape_of
from testbed.policy.collectives import ByteLedger
from testbed.policy.planner import Planner
from testbed.run.features import check_features
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout

HEAD = 256 * 16 * 2  # one head's values of a GPU's own rows, bytes


def scenario(u=2, kv=2, attention="ulysses", **over) -> Scenario:
    """2 MoE layers after a dense layer each (2 attentions a block); each GPU seq_len / U rows
    of its group's sequences of 256 U; sequence parallelism (the default)."""
    data = {"model": {"hidden_size": 128, "ffn_hidden_size": 128, "num_experts": 8, "num_layers": 2, "dtype": "bf16"},
            "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 1},
            "parallelism": {"ep_size": 4, "tp_size": u, "attention_parallel": attention},
            "pager": {"enabled": False},
            "workload": {"tokens_per_rank": 256},
            "transformer": {"enabled": True, "num_heads": 8, "num_kv_heads": kv, "seq_len": 256 * u,
                            "vocab_size": 1000, "moe_every": 2}}
    for section, fields in over.items():
        data.setdefault(section, {}).update(fields)
    return Scenario.from_dict(data)


def wire_bytes(s: Scenario, batches) -> dict[str, int]:
    ledger = ByteLedger(Layout(s))
    for op in [op for batch in batches for op in batch]:
        ledger.add_op(op)
    return ledger.by_stage


@pytest.mark.parametrize("u, kv", [(2, 2), (4, 4)])
def test_each_attention_runs_four_all_to_alls_each_way_with_these_bytes(u, kv):
    """Forward Q, K, V then the output; backward the output's, V's, K's and Q's gradients.
    A GPU sends (U - 1) / U of each: U = 2, k = 2: (65,536 + 2 x 16,384 + 65,536) / 2 = 81,920
    bytes an attention; U = 4, k = 4: 3/4 x (65,536 + 2 x 32,768 + 65,536) = 147,456. Two
    attentions a block, 8 GPUs; layer 0 and the last layer add nothing (the embedding and the
    head are whole on every GPU)."""
    s = scenario(u, kv)
    planner = Planner(s)
    groups = 8 // u
    for layer in (0, 1):
        for backward in (False, True):
            batches = planner.dense_tp_ops(layer, backward)
            assert [len(b) for b in batches] == [groups] * 8
            kinds = {op.kind for b in batches for op in b}
            assert kinds == {"all_to_all_v"}
            order = [b[0].label.split()[-1] for b in batches]
            forward = ["Q", "K", "V", "output"]
            assert order == (list(reversed(forward)) if backward else forward) * 2
            per_gpu = {2: 81_920, 4: 147_456}[u]
            stage = "dense_backward" if backward else "dense"
            assert wire_bytes(s, batches)[stage] == 2 * 8 * per_gpu
    q = batches[-1][0]  # backward's last: Q's gradient, each peer 65,536 / U
    assert q.matrix[0, 1] == 65_536 // u and q.matrix[0, 0] == 0


def test_tensor_parallelism_of_the_same_layout_plans_its_gathers_not_these():
    ops = Planner(scenario(attention="tp")).dense_tp_ops(0, False)  # layer 0: no head
    assert {op.kind for b in ops for op in b} == {"all_gather", "reduce_scatter"}


@pytest.mark.parametrize("u, kv", [(2, 2), (4, 4)])
def test_weights_are_whole_and_the_compute_and_activations_are_tensor_parallelisms(u, kv):
    """Every dense weight whole (tensor parallelism: 1/U of them); the same FLOPs per GPU
    (its own T rows over whole weights; U T rows of n / U heads in the core) and the same
    activations (each GPU's own rows, as with sequence parallelism)."""
    compute = ComputeModel(load_profile("h100"), "bf16")
    ulysses, tp = DenseLayers(scenario(u, kv), compute), DenseLayers(scenario(u, kv, attention="tp"), compute)
    whole = shape_of(scenario(u, kv)).dense_params
    assert ulysses.dense_params == whole and tp.dense_params == whole // u
    assert ulysses.forward_s == tp.forward_s and ulysses.backward_s == tp.backward_s
    assert ulysses.activation_bytes == tp.activation_bytes


@pytest.mark.parametrize("over, field", [({"kv": 2}, "transformer.num_kv_heads"),
                                         ({"kv": 2, "transformer": {"num_heads": 6, "head_dim": 16}},
                                          "transformer.num_heads")])
def test_heads_not_divisible_by_the_group_are_refused_at_load(over, field):
    """U = 4: 2 kv heads, or 6 heads, cannot be whole heads per GPU (the scenario's check for
    every tensor-parallel group, Ulysses' constraint too)."""
    with pytest.raises(ScenarioError) as err:
        scenario(4, **over)
    assert err.value.field == field


REFUSED = [
    ({"transformer": {"attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                      "qk_nope_head_dim": 16, "v_head_dim": 16}}, "transformer.attention"),
    ({"parallelism": {"cp_size": 2}, "transformer": {"seq_len": 256}}, "parallelism.cp_size"),
    ({"parallelism": {"sequence_parallel": False}, "transformer": {"seq_len": 256}}, "parallelism.sequence_parallel"),
]


@pytest.mark.parametrize("over, field", REFUSED, ids=[f for _, f in REFUSED])
def test_what_ulysses_is_not_modelled_with_is_refused_naming_the_field(over, field):
    over = dict(over)
    s = scenario(2, 2, **over)
    with pytest.raises(ScenarioError) as err:
        check_model_support(s, load_profile("h100"))
    assert err.value.field == field


def test_it_runs_on_the_simulator_and_only_there(tmp_path):
    s = scenario(2, 2, run={"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path)})
    check_features(s, "sim")
    with pytest.raises(ScenarioError) as err:
        check_features(s, "real")
    assert err.value.field == "parallelism.attention_parallel"
    summary = run_scenario(s, "sim")
    assert summary["step_time_s"] > 0
    # forward and backward a step: 2 MoE layers x 2 attentions x 81,920 bytes x 8 GPUs each
    assert summary["bytes_by_stage"]["dense"] == 2 * 2 * 81_920 * 8


def test_the_dense_gradients_are_summed_whole_over_every_gpu(tmp_path):
    """Under Ulysses every dense weight is whole on every GPU, so the dense gradient sum moves
    what the same model without tensor parallelism moves on the same GPUs, and the weights
    and optimizer state a GPU holds are those of tp 1."""
    runs = {}
    for name, over in (("ulysses", {}), ("tp1", {"parallelism": {"tp_size": 1, "attention_parallel": "tp"},
                                                 "transformer": {"seq_len": 512}, "workload": {"tokens_per_rank": 512}})):
        s = scenario(2, 2, run={"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path / name)}, **over)
        runs[name] = run_scenario(s, "sim")
    u, one = runs["ulysses"], runs["tp1"]
    assert u["bytes_by_stage"]["dense_sync"] == one["bytes_by_stage"]["dense_sync"] > 0
    for category in ("parameters", "optimizer_state"):
        assert u["memory_breakdown_bytes"][category] == one["memory_breakdown_bytes"][category], category

