"""The MoE layers' groups as the backends form them (``testbed.scenario.topology.Layout``,
issue 25 item 3): with ``parallelism.moe_layout = "nested"`` or ``etp_size`` > 1 the EP,
expert-TP, expert-DP and TP x EP groups are Megatron-Core's (``build_process_groups``);
folded with expert TP 1 keeps the placement code it always had, whose topology groups are
Megatron-Core's folded ones."""

import numpy as np
import pytest

from testbed.core.errors import ScenarioError
from testbed.layout.process_groups import build_process_groups, groups_of_kind
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


def scenario(gpus_per_node=4, nodes=2, **parallelism) -> Scenario:
    tp = parallelism.get("tp_size", 1)
    return Scenario.from_dict({
        "model": {"num_layers": 2, "num_experts": 8},
        "cluster": {"gpus_per_node": gpus_per_node, "nodes_per_microcluster": nodes, "microclusters": 1},
        "parallelism": parallelism,
        "transformer": {"enabled": tp > 1, "seq_len": 64, "num_heads": 8},
        "pager": {"enabled": False}, "heat": {"enabled": False},
        "workload": {"tokens_per_rank": 128},
    })


#: (cluster, parallelism): nested with and without TP, folded with expert TP, on 8 and 16 GPUs
LAYOUTS = [
    ({}, dict(tp_size=2, ep_size=2, etp_size=2, moe_layout="nested")),
    ({}, dict(tp_size=1, ep_size=2, moe_layout="nested")),
    ({}, dict(tp_size=1, ep_size=2, etp_size=2)),
    ({}, dict(tp_size=2, ep_size=4, etp_size=2)),
    ({}, dict(tp_size=2, ep_size=2, etp_size=4)),
    ({"gpus_per_node": 8}, dict(tp_size=2, ep_size=4, etp_size=2, moe_layout="nested")),
    ({"gpus_per_node": 8}, dict(tp_size=4, ep_size=2, etp_size=1)),  # folded: EP across the TP groups
]


@pytest.mark.parametrize("cluster, parallelism", LAYOUTS)
def test_the_layouts_groups_are_megatron_cores(cluster, parallelism):
    s = scenario(**cluster, **parallelism)
    p = s.parallelism
    lay = Layout(s)
    megatron = build_process_groups(s.world_size, p.tp_size, p.cp_size, 1, p.ep_size, p.etp_size, p.moe_layout)
    assert [lay.ep_group(g) for g in range(lay.replicas)] == list(groups_of_kind(megatron, "ep"))
    assert lay.etp_groups() == list(groups_of_kind(megatron, "etp"))
    assert lay.expert_dp_groups() == list(groups_of_kind(megatron, "edp"))
    assert lay.tp_ep_groups() == list(groups_of_kind(megatron, "tp_ep"))
    for r in range(s.world_size):  # each rank's slice is its place in its ETP group
        assert lay.etp_members[r, lay.etp_index[r]] == r


def test_nested_ep_members_are_tp_apart_and_expert_dp_spans_the_rest():
    """8 GPUs, TP 2, EP 2, nested (rank = tp + 2 (ep + 2 dp')): EP groups {0,2} {1,3} {4,6}
    {5,7}, expert TP = the TP groups {0,1} ..., each shard slice summed over {0,4} {1,5}
    {2,6} {3,7}; rank 2 holds slice 0 of shard 1 (experts 4-7)."""
    lay = Layout(scenario(tp_size=2, ep_size=2, etp_size=2, moe_layout="nested"))
    assert lay.rank_of.tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.etp_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert lay.expert_dp_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert lay.tp_ep_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert (lay.etp_index[2], lay.index_of[2], list(lay.local_experts(2))) == (0, 1, [4, 5, 6, 7])


def test_folded_with_expert_tp_1_keeps_its_placement_and_its_groups_are_megatrons():
    for placement in ("topology", "strided", "random"):
        s = scenario(tp_size=2, ep_size=4, placement=placement)
        lay = Layout(s)
        assert not lay.megatron_groups
        assert lay.etp_members.tolist() == [[r] for r in range(8)] and not lay.etp_index.any()
        assert lay.expert_dp_groups() == sorted(tuple(sorted(lay.replica_group(j))) for j in range(4))
    lay = Layout(scenario(tp_size=2, ep_size=4))
    assert lay.rank_of.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    megatron = build_process_groups(8, tp=2, ep=4, etp=1)
    assert [lay.ep_group(g) for g in range(2)] == list(groups_of_kind(megatron, "ep"))
    assert lay.expert_dp_groups() == list(groups_of_kind(megatron, "edp"))


def test_megatrons_groups_need_topology_placement():
    with pytest.raises(ScenarioError, match=r"parallelism.placement = 'strided': with parallelism.moe_layout = "
                                            r"'nested' and etp_size = 2 .* placement must be topology"):
        Layout(scenario(tp_size=2, ep_size=2, etp_size=2, moe_layout="nested", placement="strided"))


def test_a_nested_layout_with_expert_tp_other_than_tp_is_refused():
    with pytest.raises(ScenarioError, match=r"parallelism.etp_size = 1: moe_layout = 'nested' keeps expert TP = "
                                            r"tp_size = 2"):
        Layout(scenario(tp_size=2, ep_size=2, moe_layout="nested"))


def test_the_local_expert_mask_follows_the_nested_groups():
    """M22's local-first mask reads the EP groups: with nested EP groups {0,2} {1,3} ... on
    nodes of 4 every expert's holder for rank r's group is in r's node."""
    lay = Layout(scenario(tp_size=2, ep_size=2, etp_size=2, moe_layout="nested"))
    assert lay.local_expert_mask("node").all()
    strided = Layout(scenario(gpus_per_node=2, nodes=4, tp_size=2, ep_size=2, etp_size=2, moe_layout="nested"))
    # nodes of 2: rank 0's group {0,2} holds experts 4-7 on node 1
    assert strided.local_expert_mask("node")[0].tolist() == [True] * 4 + [False] * 4
    assert np.array_equal(strided.node(strided.rank_of), [[0, 1], [0, 1], [2, 3], [2, 3]])
