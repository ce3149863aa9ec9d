"""Context parallelism's plan (``testbed.policy.context_parallel``, issue 25 item 2) with
hand numbers: Megatron-Core's CP groups, the load-balanced chunk split and its equal
attention work, the ring's bytes per step (issue 25's done-when: CP's bytes per step
worked out by hand), and the dense gradients summed over DP x CP. The refusals name their
fields."""

import numpy as np
import pytest

from testbed.core.errors import ScenarioError
from testbed.layout.process_groups import build_process_groups, groups_of_kind
from testbed.model.transformer_shape import attention_core_flops
from testbed.policy.collectives import ByteLedger
from testbed.policy.context_parallel import (
    attended_pairs,
    core_flops_per_gpu,
    cp_groups,
    kv_block_bytes,
    local_positions,
)
from testbed.policy.planner import Planner
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


def scenario(cp=4, tp=1, tokens=512, **over) -> Scenario:
    """8 GPUs, 4 a node; 2 MoE layers after a dense layer each (2 attention sublayers a
    block); attention of 8 heads of 16 with 2 KV heads over sequences of 1,024; bf16."""
    data = {"model": {"hidden_size": 128, "ffn_hidden_size": 128, "num_experts": 8, "num_layers": 2, "dtype": "bf16"},
            "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 1},
            "parallelism": {"ep_size": 4, "cp_size": cp, "tp_size": tp},
            "pager": {"enabled": False},
            "workload": {"tokens_per_rank": tokens},
            "transformer": {"enabled": True, "num_heads": 8, "num_kv_heads": 2, "seq_len": 1024, "vocab_size": 1000,
                            "moe_every": 2}}
    for section, fields in over.items():
        data.setdefault(section, {}).update(fields)
    return Scenario.from_dict(data)


@pytest.mark.parametrize("tp, cp", [(1, 4), (2, 2), (1, 8)])
def test_the_cp_groups_are_megatrons(tp, cp):
    """Order tp-cp-ep-dp-pp: rank = tp + TP (cp + CP dp); member j of a group is CP index j."""
    s = scenario(cp=cp, tp=tp, tokens=1024 // (cp * tp) * 2)
    assert cp_groups(s) == list(groups_of_kind(build_process_groups(8, tp=tp, cp=cp, ep=4, etp=1), "cp"))
    if (tp, cp) == (2, 2):
        assert cp_groups(s) == [(0, 2), (1, 3), (4, 6), (5, 7)]


def test_each_gpu_holds_chunks_r_and_2cp_minus_1_minus_r():
    """Sequence of 16 in 8 chunks of 2 over CP 4: GPU 0 chunks 0 and 7, GPU 3 chunks 3 and 4;
    together the whole sequence, once."""
    assert local_positions(0, 4, 16).tolist() == [0, 1, 14, 15]
    assert local_positions(3, 4, 16).tolist() == [6, 7, 8, 9]
    everything = np.concatenate([local_positions(r, 4, 16) for r in range(4)])
    assert sorted(everything.tolist()) == list(range(16))


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_the_causal_work_is_equal_on_every_gpu(cp):
    """Exactly, with the diagonal: s (s + 1) / (2 CP) pairs on every GPU (a brute-force count
    of the mask); the FLOPs as attention_core_flops counts a causal mask (half the
    diagonal): 2 x 2 x width x s^2 / (2 CP), 1/CP of the whole sequence's."""
    s, width = 2 * cp * 5, 64
    mask = np.tril(np.ones((s, s), dtype=int))
    for r in range(cp):
        assert attended_pairs(r, cp, s) == mask[local_positions(r, cp, s)].sum() == s * (s + 1) // (2 * cp)
    assert core_flops_per_gpu(s, cp, width) == 2 * 2 * width * s * s / (2 * cp)
    assert core_flops_per_gpu(s, cp, width) == attention_core_flops(s, s, width) / cp


def test_the_rings_bytes_per_step_by_hand():
    """CP 4 on 8 GPUs (two groups, one a node), 512 tokens a GPU: a KV block is 512 rows x 2
    KV heads x 16 x (K and V) x 2 bytes = 65,536 bytes. Per attention sublayer, forward:
    3 steps of 8 sends of a block (to the next member); backward: 4 steps of 8 sends of 1, 2,
    2 and 1 blocks (to the previous). Two sublayers a block: 3,145,728 bytes forward and
    6,291,456 backward a layer, all over NVLink."""
    s = scenario()
    block = 512 * 2 * 16 * 2 * 2
    assert kv_block_bytes(s) == block == 65536
    planner = Planner(s)
    forward, backward = planner.dense_tp_ops(1, backward=False), planner.dense_tp_ops(1, backward=True)
    assert [len(b) for b in forward] == [8] * 6 and [len(b) for b in backward] == [8] * 8
    assert [b[0].size for b in forward] == [block] * 6
    assert [b[0].size for b in backward] == [block, 2 * block, 2 * block, block] * 2
    assert {op.members for op in forward[0]} == {(0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4)}
    assert {op.members for op in backward[0]} == {(1, 0), (2, 1), (3, 2), (0, 3), (5, 4), (6, 5), (7, 6), (4, 7)}
    ledger = ByteLedger(Layout(s))
    for op in [op for batch in forward + backward for op in batch]:
        ledger.add_op(op)
    assert ledger.by_stage == {"dense": 3145728, "dense_backward": 6291456}
    assert ledger.level_dict() == {"nvlink": 3145728 + 6291456, "leaf": 0, "spine": 0, "pcie": 0}
    # layer 0's block with a dense-first layer: three attention sublayers
    first = Planner(scenario(transformer={"first_dense_layers": 1})).dense_tp_ops(0, backward=False)
    assert len(first) == 3 * 3


def test_with_tensor_parallelism_a_block_is_the_tp_groups_rows_at_the_gpus_heads():
    """TP 2 x CP 2: a CP rank's rows are its TP group's 2 x 256 tokens, each GPU's K and V
    of 1 KV head: 512 x 1 x 16 x 2 x 2 bytes, the same block as without TP; the TP groups'
    collectives come first (the block's 2 attentions and dense FFN, the head's with the last
    layer), the ring after them, over the ranks of one TP index."""
    s = scenario(cp=2, tp=2, tokens=256)
    assert kv_block_bytes(s) == 512 * 1 * 16 * 2 * 2
    ops = Planner(s).dense_tp_ops(1, backward=False)
    kinds = [batch[0].kind for batch in ops]
    assert kinds == ["all_gather", "reduce_scatter"] * 3 + ["all_gather"] + ["all_reduce"] * 3 + ["p2p"] * 2
    assert {op.members for op in ops[-1]} == {(0, 2), (2, 0), (1, 3), (3, 1), (4, 6), (6, 4), (5, 7), (7, 5)}


def test_an_mla_block_is_the_up_projected_keys_and_values():
    """Megatron-Core's MLA hands the ring K of n x (d_nope + d_rope) and V of n x d_v: 8 x
    (16 + 8 + 16) elements a token."""
    mla = {"attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 16}
    s = scenario(transformer=mla)
    assert kv_block_bytes(s) == 512 * 8 * (16 + 8 + 16) * 2


@pytest.mark.parametrize("tp", [1, 2])
def test_the_dense_gradients_are_summed_over_dp_x_cp(tp):
    """Megatron-Core's DDP sums the dense gradients over dp_cp: without TP all 8 GPUs; with
    TP 2 the 4 of each TP index, Megatron's dp_cp groups."""
    s = scenario(cp=2, tp=tp, tokens=512 // tp)
    dense = {op.members for op in Planner(s).dense_sync_ops() if Planner.bucket_part(op) != "routers"}
    want = set(groups_of_kind(build_process_groups(8, tp=tp, cp=2, ep=4, etp=1), "dp_cp"))
    assert dense == want


REFUSED = [
    ({"parallelism": {"cp_size": 3}}, "parallelism.cp_size"),  # 3 does not divide 8 GPUs
    ({"parallelism": {"cp_size": 2}, "transformer": {"seq_len": 1026}}, "transformer.seq_len"),
    ({"parallelism": {"cp_size": 2}, "transformer": {"enabled": False}}, "parallelism.cp_size"),
    ({"parallelism": {"cp_size": 2, "pp_size": 2}, "transformer": {"micro_batches": 2}}, "parallelism.pp_size"),
    ({"parallelism": {"cp_size": 2, "tp_size": 2, "sequence_parallel": False}}, "parallelism.sequence_parallel"),
    ({"parallelism": {"cp_size": 2}, "transformer": {"sliding_window": 128}}, "transformer.sliding_window"),
    ({"parallelism": {"cp_size": 2}, "transformer": {"attention_sinks": True}}, "transformer.attention_sinks"),
    ({"parallelism": {"cp_size": 2}, "transformer": {"mtp_layers": 1}}, "transformer.mtp_layers"),
    ({"parallelism": {"cp_size": 2}, "transformer": {"recompute": "full"}}, "transformer.recompute"),
    ({"parallelism": {"cp_size": 2}, "transformer": {"recompute_modules": "mlp,core_attn"}},
     "transformer.recompute_modules"),
    ({"parallelism": {"cp_size": 2}, "workload": {"tokens_per_rank": 256}}, "workload.tokens_per_rank"),
    ({"parallelism": {"cp_size": 2}, "workload": {"tokens_per_rank": 0, "global_batch": 4, "micro_batch_size": 1},
      "transformer": {"seq_len": 1026}}, "transformer.seq_len"),
]


@pytest.mark.parametrize("over, field", REFUSED, ids=[f for _, f in REFUSED])
def test_what_context_parallelism_does_not_take_is_refused_naming_the_field(over, field):
    """cp_size not dividing the GPUs, seq_len not a multiple of 2 x cp_size (with
    tokens_per_rank, and with a global batch), the MoE stack alone, pipeline stages, TP
    without sequence parallelism, what TE's p2p ring has not (sliding windows, sinks), what
    the testbed does not model with it (MTP, recompute of attention, the sequence-wise
    balance loss), and a CP rank's rows that are not whole shares of sequences (256 x 1 is
    not a multiple of 1,024 / 2)."""
    data = {"model": {"hidden_size": 128, "ffn_hidden_size": 128, "num_experts": 8, "num_layers": 2},
            "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 1},
            "parallelism": {"ep_size": 4},
            "workload": {"tokens_per_rank": 512},
            "transformer": {"enabled": True, "num_heads": 8, "num_kv_heads": 2, "seq_len": 1024, "vocab_size": 1000}}
    for section, fields in over.items():
        data.setdefault(section, {}).update(fields)
    if data["workload"].get("tokens_per_rank") == 0:
        del data["workload"]["tokens_per_rank"]
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict(data)
    assert err.value.field == field
