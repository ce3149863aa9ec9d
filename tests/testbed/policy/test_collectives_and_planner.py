"""Wire bytes of collectives, their transfers per link level, and the planner's ops (M5, M7-M9)."""

import numpy as np
import pytest

from sim.step.phase_sizes import batches
from testbed.policy.collectives import ByteLedger, CollectiveOp, transfers, wire_bytes
from testbed.policy.planner import Planner, padded_elements
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import LEAF, NVLINK, SPINE, Layout


def test_wire_bytes_closed_forms():
    assert wire_bytes("all_reduce", 4, 100) == 2 * 3 * 100
    assert wire_bytes("all_gather", 4, 100) == 4 * 3 * 100
    assert wire_bytes("reduce_scatter", 4, 400) == 3 * 400
    assert wire_bytes("all_reduce", 1, 100) == 0
    m = np.array([[5, 1], [2, 7]])
    assert wire_bytes("all_to_all_v", 2, 0, m) == 3
    assert wire_bytes("p2p", 2, 9, members=(3, 3)) == 0


@pytest.mark.parametrize("kind, size", [("all_reduce", 120), ("all_gather", 30), ("reduce_scatter", 120)])
def test_ring_transfers_add_up_to_wire_bytes(kind, size):
    src, dst, nbytes = transfers(kind, (0, 1, 2, 5), size)
    assert nbytes.sum() == wire_bytes(kind, 4, size)
    assert list(zip(src, dst)) == [(0, 1), (1, 2), (2, 5), (5, 0)]


def test_members_must_ascend():
    with pytest.raises(ValueError, match="strictly increasing"):
        CollectiveOp("all_reduce", (2, 1), "expert_sync", size=4)


def test_levels_follow_the_cluster():
    s = Scenario.from_dict({})  # 2 GPUs/node, 2 nodes/micro-cluster, 2 micro-clusters
    lay = Layout(s)
    assert lay.level(0, 1) == NVLINK and lay.level(0, 2) == LEAF and lay.level(0, 4) == SPINE
    ledger = ByteLedger(lay)
    ledger.add_op(CollectiveOp("all_to_all_v", (0, 1, 2, 4), "dispatch",
                               matrix=np.array([[0, 1, 10, 100], [0] * 4, [0] * 4, [0] * 4])))
    ledger.add_pcie("paging", 7)
    assert ledger.level_dict() == {"nvlink": 1, "leaf": 10, "spine": 100, "pcie": 7}
    assert ledger.by_stage == {"dispatch": 111, "paging": 7}


def test_c13_all_to_all_bytes():
    """C13: H=4096, top-2, B=32768 tokens, FP16: dispatch = B*k*H*2 bytes per layer when
    every slot leaves its rank; dispatch + combine over 32 layers = 32 GiB."""
    tokens, k, h = 32768, 2, 4096
    per_layer = tokens * k * h * 2
    assert per_layer == 2**29  # 0.5 GiB each way, ~1 GB per layer
    assert 2 * per_layer * 32 == 32 * 2**30


def scenario(**comm):
    return Scenario.from_dict({"comm": comm, "model": {"num_experts": 8, "top_k": 2}})


def kept_matrix(s, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 40, size=(s.world_size, s.model.num_experts))


def token_bytes(s, ops):
    return sum(op.wire_bytes for op in ops)


def test_alltoall_dispatch_bytes_are_the_off_rank_slots():
    s = scenario(token_strategy="alltoall")
    lay, planner, kept = Layout(s), Planner(s), kept_matrix(s)
    expected = 0
    for r in range(s.world_size):
        for e in range(8):
            if lay.expert_rank(lay.group_of[r], e) != r:
                expected += kept[r, e] * s.model.hidden_size * s.model.dtype_bytes
    for stage in ("dispatch", "combine", "combine_backward", "dispatch_backward"):
        assert token_bytes(s, planner.token_ops(stage, 0, kept)) == expected


def test_hierarchical_moves_the_same_tokens_in_two_stages():
    flat, hier = scenario(token_strategy="alltoall"), scenario(token_strategy="hierarchical")
    kept = kept_matrix(flat, 3)
    f_ops, h_ops = Planner(flat).token_ops("dispatch", 0, kept), Planner(hier).token_ops("dispatch", 0, kept)
    lay = Layout(flat)
    # inter-node bytes: flat sends rank->rank across nodes; hierarchical aggregates them
    def cross_node(ops):
        total = 0
        for op in ops:
            src, dst, n = op.transfers()
            total += n[lay.node(src) != lay.node(dst)].sum()
        return total
    assert cross_node(h_ops) == cross_node(f_ops)
    assert len([o for o in h_ops if o.batch == 1]) == 2 * 2  # 2 groups x 2 columns inter-node
    assert token_bytes(hier, h_ops) >= token_bytes(flat, f_ops)


def test_allgather_bytes_do_not_depend_on_routing():
    s = scenario(token_strategy="allgather")
    p, t, h = 4, s.workload.tokens_per_rank, s.model.hidden_size * 4
    ops = Planner(s).token_ops("dispatch", 0, kept_matrix(s))
    per_group = p * (p - 1) * (t * h) + p * (p - 1) * (t * 2 * 8)
    assert token_bytes(s, ops) == 2 * per_group
    combine = Planner(s).token_ops("combine", 0, kept_matrix(s, 1))
    assert token_bytes(s, combine) == 2 * (p - 1) * (p * t * h)


def test_expert_sync_allreduce_vs_two_stage():
    s_ar, s_ts = scenario(expert_sync="allreduce"), scenario(expert_sync="two_stage")
    eb = s_ar.model.expert_bytes
    ar = Planner(s_ar).expert_sync_ops(0, [])
    assert len(ar) == 4 and all(op.members == (j, 4 + j) for j, op in enumerate(ar))
    assert sum(op.wire_bytes for op in ar) == 4 * 2 * 1 * (2 * eb)
    groups = [(0, 4), (0,), (), (1, 5)] + [(2, 6)] * 4
    ts = Planner(s_ts).expert_sync_ops(0, groups)
    synced = [g for g in groups if len(g) >= 2]
    assert len(ts) == 2 * len(synced)
    rs = [op for op in ts if op.kind == "reduce_scatter"]
    assert [op.members for op in rs] == synced
    assert all(op.cached for op in ts)
    # batches of 4 experts: RS of batch b in 2b, AG in 2b+1, streams 0..3
    assert [op.batch for op in rs] == [0, 0, 0, 0, 2, 2] and [op.stream for op in rs] == [0, 1, 2, 3, 0, 1]
    # a batch's ops are consecutive, which is what both backends run together
    assert [(op.kind[0], op.batch) for op in ts] == [("r", 0)] * 4 + [("a", 1)] * 4 + [("r", 2)] * 2 + [("a", 3)] * 2
    assert [len(b) for b in batches(ts)] == [4, 4, 2, 2]
    n = padded_elements(s_ts.model.expert_params, 2)
    assert sum(op.wire_bytes for op in ts) == len(synced) * (1 * n * 4 + 2 * 1 * (n // 2) * 4)


def test_single_member_ops_are_left_out():
    s = Scenario.from_dict({"cluster": {"gpus_per_node": 1, "nodes_per_microcluster": 1, "microclusters": 1},
                            "parallelism": {"ep_size": 1}})
    p = Planner(s)
    assert p.route_ops(0) == [] and p.dense_sync_ops() == [] and p.expert_sync_ops(0, []) == []
    assert p.discovery_ops() == [] and p.heat_ops() == [] and p.refresh_request_ops(0, [0]) == []
    assert p.token_ops("dispatch", 0, np.ones((1, 8), dtype=int)) == []


def test_routed_counts_travel_within_each_ep_group_not_the_world():
    s = Scenario.from_dict({"parallelism": {"ep_size": 4}})  # 8 GPUs: EP groups {0..3}, {4..7}
    ops = Planner(s).route_ops(3)
    assert [(op.kind, op.members, op.stage, op.layer) for op in ops] == [
        ("all_gather", (0, 1, 2, 3), "route", 3), ("all_gather", (4, 5, 6, 7), "route", 3)]
    assert all(op.size == s.model.num_experts * 4 for op in ops)
    strided = Planner(s.replace(parallelism={"placement": "strided"})).route_ops(0)
    assert [op.members for op in strided] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    # one EP group = the world: the same all-gather tells every rank everything, no other world view
    one = Planner(s.replace(parallelism={"ep_size": 8}))
    assert [op.members for op in one.route_ops(0)] == [tuple(range(8))]
    assert one.discovery_ops() == [] and one.heat_ops(1)[0].size == 2 * s.model.num_layers * s.model.num_experts * 8
    # ... but each GPU's pager counts its own page accesses (M18): without paging, no heat all-reduce
    unpaged = Planner(s.replace(parallelism={"ep_size": 8}, pager={"enabled": False}))
    assert unpaged.heat_ops() == []


def test_the_world_view_is_one_bit_packed_discovery_and_one_heat_all_reduce():
    s = Scenario.from_dict({"parallelism": {"ep_size": 4}, "model": {"num_layers": 3, "num_experts": 12}})
    p = Planner(s)
    (disc,) = p.discovery_ops()
    assert (disc.kind, disc.members, disc.stage, disc.layer) == ("all_gather", tuple(range(8)), "expert_sync", -1)
    assert disc.size == -(-3 * 12 // 8)  # L x E bits
    (heat,) = p.heat_ops(10)  # the steps since the last heat update: compute and memory heat
    assert (heat.kind, heat.members, heat.stage, heat.size) == ("all_reduce", tuple(range(8)), "heat", 10 * 2 * 3 * 12 * 8)
    req = p.refresh_request_ops(1, [2])
    assert [(op.kind, op.members, op.stage, op.layer, op.size) for op in req] == [
        ("all_gather", (2, 6), "paging", 1, 1)]  # 3 experts of shard 2 -> 3 bits -> 1 byte


def test_router_gradients_go_in_ddp_buckets_filled_in_backward_order():
    s = Scenario.from_dict({"model": {"num_layers": 5, "hidden_size": 64, "num_experts": 8}})
    per_layer = (64 * 8 + 8) * 4
    p = Planner(s.replace(comm={"grad_bucket_bytes": 2 * per_layer}))
    assert p.grad_buckets() == [[4, 3], [2, 1], [0]]
    ops = p.dense_sync_ops()
    assert [(op.kind, op.members, op.layer, op.size) for op in ops] == [
        ("all_reduce", tuple(range(8)), 3, 2 * per_layer), ("all_reduce", tuple(range(8)), 1, 2 * per_layer),
        ("all_reduce", tuple(range(8)), 0, per_layer)]
    assert [list(Planner.bucket_layers(op)) for op in ops] == [[3, 4], [1, 2], [0]]
    assert all(op.size <= 2 * per_layer for op in ops)
    assert Planner(s.replace(comm={"grad_bucket_bytes": 2 * per_layer - 1})).grad_buckets() == [[4], [3], [2], [1], [0]]
    assert Planner(s.replace(comm={"grad_bucket_bytes": 0})).grad_buckets() == [[4, 3, 2, 1, 0]]
    # the default is DDP's 25 MiB: these small layers share one bucket
    assert Planner(s).grad_buckets() == [[4, 3, 2, 1, 0]]


def test_router_gradient_buckets_are_the_same_with_and_without_overlap():
    from testbed.policy.controller import Controller

    s = Scenario.from_dict({"model": {"num_layers": 3}, "comm": {"grad_bucket_bytes": (64 * 8 + 8) * 4}})
    routed = np.full((s.world_size, s.model.num_experts), 8)
    for overlap in (False, True):
        c = Controller(s.replace(overlap={"sync_with_backward": overlap}))
        c.begin_step(0)
        for layer in range(3):
            c.forward_layer(layer, routed)
        for layer in reversed(range(3)):
            c.backward_layer(layer)
        assert [op.layer for op in c.sync().dense_sync_ops] == [2, 1, 0]


def test_algorithm_steps_count_what_each_call_waits_for_in_turn():
    from testbed.policy.collectives import algorithm_steps

    assert algorithm_steps("all_reduce", 8) == 14 and algorithm_steps("all_gather", 8) == 7
    assert algorithm_steps("reduce_scatter", 8) == 7 and algorithm_steps("reduce_scatter", 8, True) == 14
    assert algorithm_steps("all_to_all_v", 4) == 3 and algorithm_steps("p2p", 2) == 1
    assert algorithm_steps("all_reduce", 1) == 0
