"""Expert tensor parallelism in the planner (``testbed.policy.expert_tensor_parallel``, issue 25
item 3): the ETP groups' all-gather and reduce-scatter around the all-to-all, on any routing;
the route's counts over TP x EP; each slice's sync over its expert-DP group; and the fields
expert TP cannot run with, refused by name."""

import numpy as np
import pytest

from testbed.core.errors import ScenarioError
from testbed.policy.expert_tensor_parallel import ETP_BATCH, received_rows
from testbed.policy.planner import Planner
from testbed.scenario.scenario import Scenario

H, E, F = 64, 8, 256


def scenario(**sections) -> Scenario:
    data = {
        "model": {"num_layers": 2, "num_experts": E, "top_k": 2, "hidden_size": H, "ffn_hidden_size": F,
                  "dtype": "bf16"},
        "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"tp_size": 2, "ep_size": 2, "etp_size": 2, "moe_layout": "nested"},
        "transformer": {"enabled": True, "seq_len": 64, "num_heads": 4},
        "pager": {"enabled": False}, "heat": {"enabled": False},
        "workload": {"tokens_per_rank": 128},
    }
    for section, fields in sections.items():
        data.setdefault(section, {}).update(fields)
    return Scenario.from_dict(data)


def kept_counts(seed=0) -> np.ndarray:
    """[W, E] uneven kept slots, as any routing leaves them."""
    return np.random.default_rng(seed).integers(0, 40, size=(8, E))


def test_the_etp_all_gather_and_reduce_scatter_carry_each_members_received_rows():
    """Nested TP 2 EP 2 on 8 GPUs (EP groups {0,2} {1,3} {4,6} {5,7}, ETP groups {0,1} ...):
    rank r receives N_r = the kept slots of its EP group for its shard's 4 experts; its ETP
    group's all-gather sends N_a rows (H bf16 each) from member a to the other, the
    reduce-scatter N_b partial rows to member b. Over a stage the all-gather moves (ETP - 1)
    x the step's kept slots rows, whatever the routing."""
    s = scenario()
    planner = Planner(s)
    lay, kept = planner.layout, kept_counts()
    n = received_rows(kept, lay)
    for r in range(8):
        group = lay.ep_group(int(lay.group_of[r]))
        j = int(lay.index_of[r])
        assert n[r] == kept[list(group), 4 * j:4 * j + 4].sum()
    row = H * 2
    dispatch = planner.token_ops("dispatch", 0, kept)
    a2a, etp = dispatch[:4], dispatch[4:]
    assert [op.label for op in a2a] == ["tokens"] * 4 and {op.batch for op in a2a} == {0}
    assert [op.members for op in etp] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert {op.batch for op in etp} == {ETP_BATCH} and etp[0].label == "tokens, expert-TP all-gather"
    for op in etp:
        a, b = op.members
        assert op.matrix.tolist() == [[n[a] * row, n[a] * row], [n[b] * row, n[b] * row]]
    assert sum(op.wire_bytes for op in etp) == (2 - 1) * kept.sum() * row
    combine = planner.token_ops("combine", 0, kept)
    rs = combine[:4]  # the reduce-scatter runs before the all-to-all back
    assert [op.label for op in combine[4:]] == ["tokens"] * 4
    for op in rs:
        a, b = op.members
        assert op.label == "partial outputs, expert-TP reduce-scatter"
        assert op.matrix.tolist() == [[n[a] * row, n[b] * row], [n[a] * row, n[b] * row]]
    backward = planner.token_ops("combine_backward", 0, kept)
    assert [op.label for op in backward[4:]] == ["output gradients, expert-TP all-gather"] * 4
    assert [op.label for op in planner.token_ops("dispatch_backward", 0, kept)[:4]] == \
        ["token gradients, expert-TP reduce-scatter"] * 4


def test_fp8_payloads_gather_in_fp8_and_sum_in_the_model_dtype():
    planner = Planner(scenario(comm={"payload_dtype": "fp8"}))
    kept = kept_counts(1)
    gathered = sum(op.wire_bytes for op in planner.token_ops("dispatch", 0, kept)[4:])
    summed = sum(op.wire_bytes for op in planner.token_ops("combine", 0, kept)[:4])
    assert (gathered, summed) == (kept.sum() * H, kept.sum() * H * 2)


def test_the_route_gathers_counts_over_tp_ep_and_the_sync_sums_each_slice_over_expert_dp():
    """Counts: E int32 from each of the 4 ranks of a TP x EP group (p (p-1) 4 E bytes a
    group); sync: a rank's halves of its 4 experts (gelu: 2 H F parameters an expert, H F a
    half, bf16) all-reduced over {0,4} {1,5} {2,6} {3,7}."""
    planner = Planner(scenario())
    route = planner.route_ops(0)
    assert [op.members for op in route] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert sum(op.wire_bytes for op in route) == 2 * 4 * 3 * 4 * E
    sync = planner.expert_sync_ops(1, [])
    slice_bytes = 4 * (2 * H * F // 2) * 2
    assert [(op.members, op.size) for op in sync] == [((r, r + 4), slice_bytes) for r in range(4)]
    assert sync[2].label == "expert-TP slice 0, shard 1"
    fixed = planner.fixed_groups()
    for group in [(0, 1), (0, 4), (0, 1, 2, 3), (0, 2)]:
        assert group in fixed


def test_without_expert_dp_there_is_no_expert_sync():
    s = scenario(parallelism={"tp_size": 2, "ep_size": 4, "etp_size": 2, "moe_layout": "folded"})  # 8 / (2 x 4) = 1
    assert Planner(s).expert_sync_ops(0, []) == []


@pytest.mark.parametrize("sections, field", [
    ({"pager": {"enabled": True}}, "pager.enabled"),
    ({"heat": {"enabled": True}}, "heat.enabled"),
    ({"comm": {"expert_sync": "two_stage"}}, "comm.expert_sync"),
    ({"comm": {"token_strategy": "allgather"}}, "comm.token_strategy"),
    ({"comm": {"token_strategy": "deepep"}}, "comm.token_strategy"),
    ({"model": {"ffn_hidden_size": 255}}, "model.ffn_hidden_size"),
])
def test_what_expert_tp_cannot_run_with_is_named(sections, field):
    with pytest.raises(ScenarioError, match=rf"^{field} = .*with parallelism.etp_size = 2"):
        Planner(scenario(**sections))


def test_expert_tp_1_plans_as_before():
    """Nested with TP 1 is expert TP 1: no ETP ops, the route over the EP groups."""
    s = scenario(parallelism={"tp_size": 1, "etp_size": 1}, transformer={"enabled": False})
    planner = Planner(s)
    assert planner.etp == 1
    assert [op.label for op in planner.token_ops("dispatch", 0, kept_counts())] == ["tokens"] * 4
    assert [op.members for op in planner.route_ops(0)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
