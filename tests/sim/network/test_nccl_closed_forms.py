"""Collectives as NCCL runs them (M21), held against the closed forms of nccl-tests'
performance notes (PERFORMANCE.md): algbw = size / time; all-reduce busbw = algbw *
2(n-1)/n, all-gather and reduce-scatter busbw = algbw * (n-1)/n, all-to-all busbw = algbw
* (n-1)/n; plus the tree's log-depth latency, auto selection, NVLS / in-network reduction,
PXN and rail-optimised leaves. Every figure is asserted with a stated tolerance."""

import numpy as np
import pytest
import simpy

from sim.hardware.fabric import build_fabric
from sim.network.analytic_timer import AnalyticTimer
from sim.network.collective_algorithms import binary_tree, double_tree, tree_depth
from sim.network.collective_model import CollectiveModel
from sim.network.network import Network
from testbed.policy.collectives import CollectiveOp
from testbed.scenario.links import route
from testbed.scenario.profile import load_profile, profile_from_dict
from testbed.scenario.sections import ClusterConfig
from testbed.scenario.topology import LEVELS

GiB, MiB = 2**30, 2**20
H200 = load_profile("h200")
NVLINK, NIC = H200.links.nvlink.bandwidth, H200.links.nic.bandwidth  # 370, 48 GB/s


def with_collectives(prof, **changes):
    """``prof`` with collectives keys changed (``all_reduce=...`` etc. set the algorithm)."""
    d = prof.to_dict()
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        if kind in changes:
            d["collectives"]["algorithm"][kind] = changes.pop(kind)
    d["collectives"].update(changes)
    return profile_from_dict(d, prof.name)


def cluster(nodes, gpn=8, mcs=1, rail=False):
    return ClusterConfig(gpus_per_node=gpn, nodes_per_microcluster=nodes // mcs, microclusters=mcs, rail_optimized=rail)


def model_on(c, prof, mode="analytic"):
    return CollectiveModel(Network(simpy.Environment(), build_fabric(c, prof), mode), prof)


def alone(op, c, prof):
    """(seconds, bytes per level) of ``op`` alone on the fabric, analytic."""
    timer = AnalyticTimer(model_on(c, prof))
    t = timer.seconds(op)
    return t, level_bytes(timer.model)


def flow_seconds(op, c, prof):
    model = model_on(c, prof, "flow")
    model.env.run(model.run(op))
    return model.env.now


def level_bytes(model):
    f, by = model.fabric, model.network.bytes_by_edge
    return {lv: float(by[f.level == i].sum()) for i, lv in enumerate(LEVELS)}


def all_reduce(p, size):
    return CollectiveOp("all_reduce", tuple(range(p)), "expert_sync", size=int(size))


def uniform_a2a(p, per_rank):
    """nccl-tests alltoall: every rank sends ``per_rank`` bytes, per_rank / p to each rank
    (itself included)."""
    return CollectiveOp("all_to_all_v", tuple(range(p)), "dispatch", matrix=np.full((p, p), per_rank // p))


# ---- ring all-reduce across nodes: busbw -> min(NVLink, the node's NICs) -------------------
@pytest.mark.parametrize("nodes,mcs", [(2, 1), (4, 1), (8, 1), (8, 2)])
def test_multi_node_ring_all_reduce_busbw_approaches_min_of_nvlink_and_the_nodes_nics(nodes, mcs):
    prof = with_collectives(H200, all_reduce="ring")
    p, S = 8 * nodes, GiB
    t, by = alone(all_reduce(p, S), cluster(nodes, mcs=mcs), prof)
    busbw = S / t * 2 * (p - 1) / p
    bound = min(NVLINK, 8 * NIC)  # 370 GB/s: every NVLink port carries one channel each way
    assert busbw == pytest.approx(bound, rel=0.10)
    assert busbw <= bound * 1.0001
    # seen: 16 GPUs 366.2, 32 GPUs 363.5, 64 GPUs 358.2 (358.0 over 2 leaves) GB/s; the rest is
    # the latency, 2(p-1) steps of ~1.4 us
    # the ring's bytes stay those of the standard algorithm
    assert sum(by[lv] for lv in ("nvlink", "leaf", "spine")) >= all_reduce(p, S).wire_bytes


def test_one_ring_in_rank_order_is_bound_by_one_nic():
    """channels = 1 (gloo, and NCCL's old behaviour in this simulator): every node crossing
    goes through one GPU's NIC, busbw = the NIC."""
    prof = with_collectives(H200, all_reduce="ring", channels=1)
    t, _ = alone(all_reduce(16, GiB), cluster(2), prof)
    assert GiB / t * 2 * 15 / 16 == pytest.approx(NIC, rel=0.01)


def test_flow_mode_holds_the_same_ring_closed_form():
    prof = with_collectives(H200, all_reduce="ring")
    op = all_reduce(16, GiB)
    t = flow_seconds(op, cluster(2), prof)
    assert GiB / t * 2 * 15 / 16 == pytest.approx(min(NVLINK, 8 * NIC), rel=0.10)
    assert t == pytest.approx(alone(op, cluster(2), prof)[0], rel=0.01)


def test_ring_channels_cross_on_their_own_rail_through_the_entry_gpus_nic():
    prof = with_collectives(H200, all_reduce="ring")
    model = model_on(cluster(2), prof)
    f = model.atom_flows(model.stages(all_reduce(16, MiB))[0][0])
    assert len(f.src) == 8 * 16  # 8 channels of 16 hops
    cross = f.src // 8 != f.dst // 8
    assert cross.sum() == 16  # two crossings per channel
    # each crossing leaves through the NIC on the destination's rail, the 8 channels on 8 rails
    np.testing.assert_array_equal(f.nic_of_src[cross] % 8, f.dst[cross] % 8)
    assert sorted((f.dst[cross] % 8).tolist()) == sorted(list(range(8)) * 2)


# ---- all-to-all across N nodes -----------------------------------------------------------
@pytest.mark.parametrize("nodes", [2, 4, 8])
@pytest.mark.parametrize("pxn", [False, True])
def test_all_to_all_across_nodes(nodes, pxn):
    """Derivation: p = 8N ranks each send S/p to every rank; S(N-1)/N of it leaves the node
    through the rank's NIC (with PXN through the NIC on the destination's rail, the same
    per-NIC total), so t = S(N-1)/N / B_nic. Hence algbw = S/t = N/(N-1) x B_nic exactly (the
    form the issue states is the algbw), and nccl-tests' busbw = algbw (p-1)/p =
    N/(N-1) (p-1)/p x B_nic."""
    prof = with_collectives(H200, pxn=pxn)
    p, S = 8 * nodes, GiB
    t, _ = alone(uniform_a2a(p, S), cluster(nodes), prof)
    algbw = S / t
    # within 2%: the latency (a call and 2(p-1) peer messages of 1.5 us, ~0.2 ms at 64
    # GPUs) against ~20 ms of bytes
    assert algbw == pytest.approx(nodes / (nodes - 1) * NIC, rel=0.02)
    assert algbw * (p - 1) / p == pytest.approx(nodes / (nodes - 1) * (p - 1) / p * NIC, rel=0.02)
    assert algbw < nodes / (nodes - 1) * NIC


def test_all_to_all_peer_messages_make_small_all_to_alls_latency_bound():
    prof = with_collectives(H200, all_to_all_peer_us=2.0, latency_us=10.0)
    c = cluster(8)
    small = uniform_a2a(64, 64 * 1024)  # 1 KiB to each peer
    t, _ = alone(small, c, prof)
    t0, _ = alone(small, c, with_collectives(prof, all_to_all_peer_us=0.0))
    assert t - t0 == pytest.approx(2 * 63 * 2e-6, rel=1e-6)  # 63 sends and 63 receives of 2 us
    assert t > 10 * (1024 * 56 / NIC)  # the bytes alone would take ~1.2 us
    # a sparse all-to-all pays for the member with the most peers only
    mat = np.zeros((64, 64), dtype=np.int64)
    mat[0, 1:5] = 1000
    mat[7, 0] = 1000
    sparse = CollectiveOp("all_to_all_v", tuple(range(64)), "dispatch", matrix=mat)
    ts, _ = alone(sparse, c, prof)
    ts0, _ = alone(sparse, c, with_collectives(prof, all_to_all_peer_us=0.0))
    assert ts - ts0 == pytest.approx(5 * 2e-6, rel=1e-6)  # rank 0 sends 4 and receives 1


# ---- tree ------------------------------------------------------------------------------------
def test_nccls_double_binary_tree():
    assert binary_tree(8).tolist() == [-1, 2, 4, 2, 0, 6, 4, 6]
    for n in (2, 3, 4, 7, 8, 16, 180):
        t1, t2 = double_tree(n)
        assert (t1 < 0).sum() == (t2 < 0).sum() == 1
        inner1 = set(t1[t1 >= 0].tolist())
        inner2 = set(t2[t2 >= 0].tolist())
        if n % 2 == 0:  # mirrored: a rank has children in one tree at most
            assert not (inner1 & inner2), n
        assert tree_depth(t1) == int(np.ceil(np.log2(n)))
    assert [tree_depth(binary_tree(2**k)) for k in range(1, 8)] == list(range(1, 8))


def test_tree_latency_grows_with_log2_nodes_and_the_ring_with_p():
    prof = with_collectives(H200, all_reduce="tree")
    ring = with_collectives(H200, all_reduce="ring")
    tree_t, ring_t = [], []
    for k in range(1, 6):  # 2 .. 32 nodes of 8 GPUs
        op, c = all_reduce(8 * 2**k, 1024), cluster(2**k)
        tree_t.append(alone(op, c, prof)[0])
        ring_t.append(alone(op, c, ring)[0])
    steps = np.diff(tree_t)
    # each doubling of the nodes adds one level to both trees: 2 inter-node hops of 3 us
    assert steps == pytest.approx(np.full(4, 2 * 3e-6), rel=0.02)
    assert tree_t[-1] < 80e-6  # 256 GPUs: ~50 us
    # the ring's latency grows with p: 2(p-1) steps over its hops in turn, of which 1 in 8
    # crosses nodes (4 us: the NVLink hop to the rail's GPU and NIC to NIC), the rest NVLink
    # (1 us): 1 + 3/8 us per step
    ring_steps = np.diff(ring_t)
    assert ring_steps[-1] == pytest.approx(2 * 128 * (1 + 3 / 8) * 1e-6, rel=0.01)
    assert ring_t[-1] > 10 * tree_t[-1]


def test_tree_over_one_gpu_per_node_is_log2_ranks():
    prof = with_collectives(H200, all_reduce="tree")
    t = [alone(all_reduce(2**k, 1024), cluster(2**k, gpn=1), prof)[0] for k in range(1, 8)]
    assert np.diff(t) == pytest.approx(np.full(6, 2 * 3e-6), rel=0.02)


def test_auto_picks_tree_for_small_and_ring_for_large_messages():
    a100 = load_profile("a100-seed")  # all_reduce = "auto"
    model = model_on(cluster(4), a100)
    assert model.algorithm("all_reduce") == "auto"
    pick = {s: model.algorithm_for(all_reduce(32, s)) for s in (MiB, 64 * MiB, 4 * GiB)}
    assert pick == {MiB: "tree", 64 * MiB: "tree", 4 * GiB: "ring"}
    # and auto's time is the fastest candidate's, at every size
    for s in (MiB, 4 * GiB):
        times = {alg: alone(all_reduce(32, s), cluster(4), with_collectives(a100, all_reduce=alg))[0]
                 for alg in ("ring", "tree")}
        assert alone(all_reduce(32, s), cluster(4), a100)[0] == pytest.approx(min(times.values()), rel=1e-9)
    # h200, 2 nodes: small all-reduces go by tree too
    assert model_on(cluster(2), H200).algorithm_for(all_reduce(16, MiB)) == "tree"
    # a fixed choice is kept
    fixed = model_on(cluster(4), with_collectives(a100, all_reduce="ring"))
    assert fixed.algorithm_for(all_reduce(32, MiB)) == "ring"


def test_tree_busbw_at_1gib_on_2_nodes_is_within_10_percent_of_the_bound():
    """What ``auto`` runs for a 1 GiB all-reduce on 2 h200 nodes (the tree: each node sends
    S over its NICs, the ring 2(p-1)/p S), as ``testbed collective`` shows it."""
    model = model_on(cluster(2), H200)
    assert model.algorithm_for(all_reduce(16, GiB)) == "tree"
    t, _ = alone(all_reduce(16, GiB), cluster(2), H200)
    assert GiB / t * 2 * 15 / 16 == pytest.approx(min(NVLINK, 8 * NIC), rel=0.10)


# ---- NVLink SHARP and in-network reduction ---------------------------------------------------
def test_nvls_reduces_the_nvlink_bytes_of_an_all_reduce_in_a_node():
    nvls = with_collectives(H200, nvls=True, all_reduce="nvls", all_gather="nvls", reduce_scatter="nvls")
    ring = with_collectives(H200, all_reduce="ring")
    S, g = GiB, 8
    t_n, by_n = alone(all_reduce(g, S), cluster(1), nvls)
    t_r, by_r = alone(all_reduce(g, S), cluster(1), ring)
    # per NVLink port: S (1 + 1/g) each way with NVLS, 2 (g-1)/g S with the ring
    assert by_n["nvlink"] == pytest.approx(2 * g * S * (1 + 1 / g), rel=1e-9)
    assert by_r["nvlink"] == pytest.approx(2 * g * 2 * (g - 1) / g * S, rel=1e-9)
    busbw = S / t_n * 2 * (g - 1) / g
    assert busbw == pytest.approx(2 * (g - 1) / (g + 1) * NVLINK, rel=0.01)  # 576 GB/s
    assert t_n < 0.7 * t_r
    # reduce-scatter: S up, S/g down; all-gather: n up, g n down
    rs = CollectiveOp("reduce_scatter", tuple(range(g)), "expert_sync", size=S)
    ag = CollectiveOp("all_gather", tuple(range(g)), "expert_sync", size=S // g)
    assert alone(rs, cluster(1), nvls)[1]["nvlink"] == pytest.approx(g * (S + S / g), rel=1e-9)
    assert alone(ag, cluster(1), nvls)[1]["nvlink"] == pytest.approx(g * (S / g + S), rel=1e-9)


def test_nvls_across_nodes_and_auto_with_nvls():
    nvls = with_collectives(H200, nvls=True, all_reduce="nvls")
    ring = with_collectives(H200, all_reduce="ring")
    op = all_reduce(16, GiB)
    t_n, by_n = alone(op, cluster(2), nvls)
    t_r, by_r = alone(op, cluster(2), ring)
    assert by_n["nvlink"] < 0.7 * by_r["nvlink"]
    assert t_n < t_r
    auto = with_collectives(H200, nvls=True)
    assert model_on(cluster(1), auto).algorithm_for(all_reduce(8, GiB)) == "nvls"


@pytest.mark.parametrize("mcs", [1, 2])
def test_in_network_reduction_halves_the_nic_bytes(mcs):
    sharp = with_collectives(H200, collnet=True, all_reduce="collnet")
    ring = with_collectives(H200, all_reduce="ring")
    nodes, S, g = 4, GiB, 8
    p = 8 * nodes
    c = cluster(nodes, mcs=mcs)
    t_s, by_s = alone(all_reduce(p, S), c, sharp)
    t_r, by_r = alone(all_reduce(p, S), c, ring)
    # each GPU's shard S/g up its NIC once and down once
    assert by_s["leaf"] == pytest.approx(2 * p * S / g, rel=1e-9)
    assert by_r["leaf"] == pytest.approx(2 * p * 2 * (p - 1) / p * S / g, rel=1e-9)
    if mcs == 2:  # one reduced copy of each shard up and down each leaf's uplink
        assert by_s["spine"] == pytest.approx(2 * mcs * S, rel=1e-9)
        assert by_s["spine"] < by_r["spine"]
    else:
        assert by_s["spine"] == 0
    assert t_s < t_r


# ---- PXN and rail-optimised leaves ---------------------------------------------------------
def test_rail_optimised_leaves_route_same_rail_through_one_leaf_and_cross_rail_over_the_spine():
    c = cluster(2, rail=True)  # one micro-cluster, 8 rails
    f = build_fabric(c, H200)
    assert f.leaves == 8 and f.rails == 8
    assert route(c, 0, 8) == [("nic_up", 0), ("nic_down", 8)]  # rail 0: leaf 0 only
    assert route(c, 0, 9) == [("nic_up", 0), ("spine_up", 0), ("spine_down", 1), ("nic_down", 9)]
    assert f.level[f.path(0, 9)].tolist().count(LEVELS.index("spine")) == 2
    assert route(cluster(2), 0, 9) == [("nic_up", 0), ("nic_down", 9)]  # one leaf per micro-cluster
    # the NCCL ring's crossings stay on their rails: no spine bytes; one ring in rank order crosses rails
    prof = with_collectives(H200, all_reduce="ring")
    _, by = alone(all_reduce(16, GiB), c, prof)
    assert by["spine"] == 0
    _, by1 = alone(all_reduce(16, GiB), c, with_collectives(prof, channels=1))
    assert by1["spine"] > 0


def test_pxn_keeps_inter_node_all_to_all_traffic_on_the_destinations_rail():
    c = cluster(2, rail=True)
    op = uniform_a2a(16, 16 * MiB)
    inter = 16 * 8 * MiB  # bytes between the two nodes
    _, plain = alone(op, c, H200)
    _, pxn = alone(op, c, with_collectives(H200, pxn=True))
    # without PXN, 7/8 of the inter-node bytes cross rails and so the spine; with PXN none
    assert plain["spine"] == pytest.approx(2 * inter * 7 / 8, rel=1e-9)  # up and down
    assert pxn["spine"] == 0
    assert pxn["leaf"] == plain["leaf"] == pytest.approx(2 * inter, rel=1e-9)
    # the relay is an extra NVLink hop for the 7/8 of messages off the source's rail
    assert pxn["nvlink"] - plain["nvlink"] == pytest.approx(2 * inter * 7 / 8, rel=1e-9)
    model = model_on(c, with_collectives(H200, pxn=True))
    f = model.atom_flows(model.stages(op)[0][0])
    cross = f.src // 8 != f.dst // 8
    np.testing.assert_array_equal(f.nic_of_src[cross] % 8, f.dst[cross] % 8)
    np.testing.assert_array_equal(f.nic_of_src[cross] // 8, f.src[cross] // 8)
    # p2p: the same relay
    p2p = CollectiveOp("p2p", (1, 10), "paging", size=MiB)
    assert alone(p2p, c, with_collectives(H200, pxn=True))[1]["spine"] == 0
    assert alone(p2p, c, H200)[1]["spine"] == 2 * MiB


def test_flow_mode_routes_pxn_and_switch_traffic_like_analytic_mode():
    """The network model takes ``Flows.nic_of_src`` and ``Flows.kind``: flow and analytic
    modes put the same bytes on the same links."""
    c = cluster(2, rail=True)
    for prof, op in ((with_collectives(H200, pxn=True), uniform_a2a(16, 16 * MiB)),
                     (with_collectives(H200, nvls=True, all_reduce="nvls"), all_reduce(16, 256 * MiB)),
                     (with_collectives(H200, collnet=True, all_reduce="collnet"), all_reduce(16, 256 * MiB))):
        flow = model_on(c, prof, "flow")
        flow.env.run(flow.run(op))
        timer = AnalyticTimer(model_on(c, prof))
        t = timer.seconds(op)
        np.testing.assert_allclose(flow.network.bytes_by_edge, timer.model.network.bytes_by_edge, rtol=1e-9)
        assert flow.env.now == pytest.approx(t, rel=0.05)
