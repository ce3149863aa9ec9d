"""The models' features under tensor parallelism (issue 25): shared experts, MLA, dense-first
layers and MTP modules as Megatron-Core splits them (``testbed.policy.tensor_parallel_ops``,
``Planner.replicated_grad_ops``, ``testbed.model.whole_model``), with bytes by hand on a tiny
scenario: 8 GPUs, 4 a node, TP 2 (groups {0,1} {2,3} {4,5} {6,7}), H 128, 256 tokens a GPU
in bf16, so a GPU's rows are 256 x 128 x 2 = 65,536 bytes."""

import pytest

from sim.hardware.compute import ComputeModel
from sim.hardware.dense_layers import DenseLayers
from sim.hardware.model_support import check_model_support
from sim.hardware.shared_experts import SharedExperts
from testbed.core.errors import ScenarioError
from testbed.model.mtp_layers import controller_scenario
from testbed.model.whole_model import block_grad_bytes, shared_expert_grad_bytes
from testbed.policy.collectives import ByteLedger
from testbed.policy.planner import Planner
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout

ROWS = 256 * 128 * 2  # one GPU's own rows, bytes
GROUPS = 4  # TP groups of 2


def scenario(tp=2, **over) -> Scenario:
    """2 MoE layers after a dense layer each; attention of 8 heads of 16, 2 KV heads, over
    sequences of 256; bf16; sequence parallelism (the default)."""
    data = {"model": {"hidden_size": 128, "ffn_hidden_size": 128, "num_experts": 8, "num_layers": 2, "dtype": "bf16"},
            "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 1},
            "parallelism": {"ep_size": 4, "tp_size": tp},
            "pager": {"enabled": False},
            "workload": {"tokens_per_rank": 256},
            "transformer": {"enabled": True, "num_heads": 8, "num_kv_heads": 2, "seq_len": 256, "vocab_size": 1000,
                            "moe_every": 2}}
    for section, fields in over.items():
        data.setdefault(section, {}).update(fields)
    return Scenario.from_dict(data)


def shared(**over):
    model = {"shared_experts": 1, "shared_ffn_hidden_size": 256}
    model.update(over.pop("model", {}))
    return scenario(model=model, **over)


MLA = {"attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
       "v_head_dim": 16}


def labelled(batches, what: str) -> list[tuple[str, int]]:
    """(kind, size) of the batches whose label names ``what``, each batch one op per TP group."""
    out = []
    for batch in batches:
        if batch[0].label == f"tensor parallel, {what}":
            assert len(batch) == GROUPS and len({(op.kind, op.size) for op in batch}) == 1
            out.append((batch[0].kind, batch[0].size))
    return out


def wire_bytes(s: Scenario, batches) -> dict[str, int]:
    ledger = ByteLedger(Layout(s))
    for op in [op for batch in batches for op in batch]:
        ledger.add_op(op)
    return ledger.by_stage


def test_shared_experts_gather_the_layers_rows_and_reduce_scatter_their_output():
    """With sequence parallelism each MoE layer's shared experts all-gather the GPU's rows
    (65,536 bytes a member) and reduce-scatter the group's 2 x 65,536 of partial outputs, after
    the block's forward ops and before its backward ones. On the wire: a ring of 2 moves each
    member's 65,536 once for each, 4 groups x 2 members x 2 ops x 65,536 = 1,048,576 bytes a
    layer and pass."""
    planner = Planner(shared())
    forward, backward = planner.dense_tp_ops(1, backward=False), planner.dense_tp_ops(1, backward=True)
    assert labelled(forward, "shared experts 0") == [("all_gather", ROWS), ("reduce_scatter", 2 * ROWS)]
    assert labelled(backward, "shared experts 0") == [("reduce_scatter", 2 * ROWS), ("all_gather", ROWS)]
    # after the block's forward ops (the last layer's output head, 4 batches, after them), before its backward
    assert "shared experts" in forward[-5][0].label and "shared experts" in backward[1][0].label
    without = Planner(scenario())
    for back in (False, True):
        extra = (wire_bytes(shared(), planner.dense_tp_ops(1, back))[("dense_backward" if back else "dense")]
                 - wire_bytes(scenario(), without.dense_tp_ops(1, back))[("dense_backward" if back else "dense")])
        assert extra == GROUPS * 2 * 2 * ROWS == 1_048_576


def test_shared_experts_without_sequence_parallelism_all_reduce_their_output():
    planner = Planner(shared(parallelism={"sequence_parallel": False}))
    assert labelled(planner.dense_tp_ops(1, backward=False), "shared experts 0") == [("all_reduce", 2 * ROWS)]
    assert labelled(planner.dense_tp_ops(1, backward=True), "shared experts 0") == [("all_reduce", 2 * ROWS)]


def test_shared_experts_hold_half_their_ffn_and_their_whole_gate_per_gpu():
    """SwiGLU-less FFN 128 x 256 twice (65,536 weights) over TP 2 plus the gate's 128 whole:
    32,896 weights, 65,792 gradient bytes a layer; the same FLOPs per GPU as at TP 1."""
    s2 = shared(model={"shared_expert_gate": True})
    s1 = shared(tp=1, model={"shared_expert_gate": True}, parallelism={"ep_size": 8})
    assert shared_expert_grad_bytes(s1) == (2 * 128 * 256 + 128) * 2
    assert shared_expert_grad_bytes(s2) == (128 * 256 + 128) * 2 == 65_792
    compute = ComputeModel(load_profile("h100"), "bf16")
    two, one = SharedExperts(s2, compute), SharedExperts(s1, ComputeModel(load_profile("h100"), "bf16"))
    assert two.params == 128 * 256 + 128 and one.params == 2 * 128 * 256 + 128
    assert two.forward_s == one.forward_s and two.activation_bytes == one.activation_bytes


def test_dense_first_layers_ops_are_a_dense_layers():
    """Layer 0's block with one dense-first layer: before the block's own, one attention's
    and one dense FFN's pair, the same kinds and sizes as the block's dense layer's."""
    ops = Planner(scenario(transformer={"first_dense_layers": 1})).dense_tp_ops(0, backward=False)
    plain = Planner(scenario()).dense_tp_ops(0, backward=False)
    assert labelled(ops, "dense-first attention 0") == labelled(plain, "attention 0") \
        == [("all_gather", ROWS), ("reduce_scatter", 2 * ROWS)]
    assert labelled(ops, "dense-first FFN 0") == labelled(plain, "dense FFN 2")
    assert len(ops) == len(plain) + 4
    back = Planner(scenario(transformer={"first_dense_layers": 1})).dense_tp_ops(0, backward=True)
    assert labelled(back, "dense-first attention 0") == labelled(plain_back := Planner(scenario()).dense_tp_ops(
        0, backward=True), "attention 0")
    assert len(back) == len(plain_back) + 4


def test_mla_gathers_its_latents_and_sums_its_replicated_down_projections_gradients():
    """MLA with r_q 32, r_kv 16, d_rope 8: each attention all-gathers 256 tokens x 32, x 16 and
    x 8 values (16,384, 8,192 and 4,096 bytes a member), then reduce-scatters the rows. Its down
    projections, 128 x (32 + 16 + 8) = 7,168 weights a layer, are whole on every GPU: each
    layer's bucket carries them whole, and after the backward one all-reduce per TP group sums
    the 4 attention layers' 4 x 7,168 x 2 = 57,344 bytes (fp32 reduce: x 2)."""
    s = scenario(transformer=MLA)
    ops = Planner(s).dense_tp_ops(1, backward=False)
    assert labelled(ops, "attention 1") == [("all_gather", 256 * 32 * 2), ("all_gather", 256 * 16 * 2),
                                            ("all_gather", 256 * 8 * 2), ("reduce_scatter", 2 * ROWS)]
    down = 128 * (32 + 16 + 8)
    whole = block_grad_bytes(scenario(tp=1, transformer=MLA, parallelism={"ep_size": 8}), 1)  # TP 1: all whole
    assert block_grad_bytes(s, 1) == (whole - 2 * down * 2) // 2 + 2 * down * 2
    replicated = [op for op in Planner(s).dense_sync_ops() if op.label.startswith("replicated gradients")]
    fp32 = 2 if s.transformer.grad_reduce_dtype == "fp32" else 1
    assert [(op.kind, op.members, op.size) for op in replicated] == [
        ("all_reduce", (r, r + 1), 4 * down * 2 * fp32) for r in range(0, 8, 2)]
    assert not [op for op in Planner(scenario()).dense_sync_ops() if op.label.startswith("replicated")]


def test_mla_under_tp_without_sequence_parallelism_is_refused_naming_attention():
    s = scenario(transformer=MLA, parallelism={"sequence_parallel": False})
    with pytest.raises(ScenarioError) as e:
        check_model_support(s, load_profile("h100"))
    assert e.value.field == "transformer.attention"
    for ok in (scenario(transformer=MLA), shared(), scenario(transformer={"first_dense_layers": 1, "mtp_layers": 1})):
        check_model_support(ok, load_profile("h100"))


def test_mla_down_projections_are_whole_in_a_gpus_dense_weights():
    s2, s1 = scenario(transformer=MLA), scenario(tp=1, transformer=MLA, parallelism={"ep_size": 8})
    d2 = DenseLayers(s2, ComputeModel(load_profile("h100"), "bf16"))
    d1 = DenseLayers(s1, ComputeModel(load_profile("h100"), "bf16"))
    down = 4 * 128 * (32 + 16 + 8)  # 4 attention layers
    assert d2.dense_params == (d1.dense_params - down) // 2 + down
    assert d2.forward_s == d1.forward_s  # the same FLOPs per GPU


def test_an_mtp_modules_block_is_its_embedding_projection_and_attention_and_the_head_runs_twice():
    """One MTP module: the controller's layer 2. Forward: the embedding's reduce-scatter
    (2 x 65,536), the projection's input gathered (2H a token: 131,072 a member) and its
    output gathered along H (65,536), its attention's pair, the shared experts' none (none
    here); the last layer carries the head's ops twice (the model's and the module's)."""
    s = controller_scenario(scenario(transformer={"mtp_layers": 1}))
    planner = Planner(s)
    forward = planner.dense_tp_ops(2, backward=False)
    assert labelled(forward, "MTP embedding") == [("reduce_scatter", 2 * ROWS)]
    assert labelled(forward, "MTP projection") == [("all_gather", 2 * ROWS), ("all_gather", ROWS)]
    assert labelled(forward, "MTP attention 0") == [("all_gather", ROWS), ("reduce_scatter", 2 * ROWS)]
    head = labelled(forward, "output head")
    assert head == [("all_gather", ROWS)] + [("all_reduce", 2 * 256 * 4)] * 3 + [("all_gather", ROWS)] \
        + [("all_reduce", 2 * 256 * 4)] * 3
    backward = planner.dense_tp_ops(2, backward=True)
    assert labelled(backward, "MTP projection") == [("all_gather", ROWS), ("reduce_scatter", 4 * ROWS)]
    assert labelled(backward, "output head") == [("reduce_scatter", 2 * ROWS)] * 2
    assert not labelled(planner.dense_tp_ops(1, backward=False), "MTP projection")


def test_tensor_parallelism_off_plans_none_of_them():
    s = shared(tp=1, parallelism={"ep_size": 8}, transformer={**MLA, "first_dense_layers": 1})
    planner = Planner(s)
    assert planner.dense_tp_ops(0, backward=False) == [] and planner.dense_tp_ops(1, backward=True) == []
    assert not [op for op in planner.dense_sync_ops() if op.label.startswith("replicated")]
