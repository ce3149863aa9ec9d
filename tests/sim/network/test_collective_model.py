"""Collective timing against closed forms (ring, direct, nccl-tests bus bandwidth) and C13."""

import numpy as np
import pytest
import simpy

from sim.hardware.fabric import build_fabric
from sim.network.analytic_timer import AnalyticTimer
from sim.network.collective_model import CollectiveModel
from sim.network.network import Network
from testbed.policy.collectives import CollectiveOp
from testbed.scenario.profile import load_profile, profile_from_dict
from testbed.scenario.sections import ClusterConfig

GB = 1e9
NODE = ClusterConfig(gpus_per_node=8, nodes_per_microcluster=2, microclusters=1)


def profile(nvlink=100.0, nic=10.0, link_latency_us=0.0, call_latency_us=0.0, reduce_scatter="ring",
            all_reduce="ring", channels=0, peer_us=0.0):
    d = load_profile("h200").to_dict()
    d["links"]["nvlink"] = {"bandwidth_GBps": nvlink, "latency_us": link_latency_us}
    d["links"]["nic"] = {"bandwidth_GBps": nic, "latency_us": link_latency_us}
    d["collectives"].update(latency_us=call_latency_us, channels=channels, all_to_all_peer_us=peer_us)
    d["collectives"]["algorithm"].update(reduce_scatter=reduce_scatter, all_reduce=all_reduce)
    return profile_from_dict(d, "test")


def timed(op, prof, cluster=NODE, mode="flow"):
    """Simulated seconds of ``op`` alone on the fabric."""
    env = simpy.Environment()
    model = CollectiveModel(Network(env, build_fabric(cluster, prof), mode), prof)
    env.run(model.run(op))
    return env.now


def op(kind, members, size=0, matrix=None):
    return CollectiveOp(kind, tuple(members), "expert_sync", size=int(size), matrix=matrix)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_all_reduce_in_one_node(p):
    S, B = 4 * GB, 100 * GB
    t = timed(op("all_reduce", range(p), S), profile(link_latency_us=1.0, call_latency_us=10.0))
    hop = 2e-6  # gpu -> nvswitch -> gpu
    assert t == pytest.approx(2 * (p - 1) / p * S / B + 10e-6 + 2 * (p - 1) * hop)


def test_ring_all_gather_and_reduce_scatter():
    p, S, B = 8, 1 * GB, 100 * GB
    prof = profile()
    assert timed(op("all_gather", range(p), S), prof) == pytest.approx((p - 1) * S / B)
    assert timed(op("reduce_scatter", range(p), S), prof) == pytest.approx((p - 1) / p * S / B)


def test_nccl_tests_bus_bandwidth_equals_the_link():
    # nccl-tests: algbw = data / time; busbw = algbw * 2(p-1)/p (all-reduce),
    # algbw * (p-1)/p (all-gather with data = p * size, reduce-scatter with data = size)
    p, S, B = 8, 2 * GB, 100 * GB
    prof = profile()
    t = timed(op("all_reduce", range(p), S), prof)
    assert S / t * 2 * (p - 1) / p == pytest.approx(B)
    t = timed(op("all_gather", range(p), S), prof)
    assert p * S / t * (p - 1) / p == pytest.approx(B)
    t = timed(op("reduce_scatter", range(p), S), prof)
    assert S / t * (p - 1) / p == pytest.approx(B)


def test_a_ring_across_nodes_runs_at_the_nic():
    p, S = 16, 1.6 * GB
    # one ring in rank order (gloo): two hops cross one NIC each
    t = timed(op("all_reduce", range(p), S), profile(nic=10.0, channels=1))
    assert t == pytest.approx(2 * (p - 1) / p * S / (10 * GB))
    # NCCL: 8 channels, one per rail: the node's 8 NICs (80 GB/s) carry the crossings
    t = timed(op("all_reduce", range(p), S), profile(nic=10.0))
    assert t == pytest.approx(2 * (p - 1) / p * S / (8 * 10 * GB))
    # and where the NICs are fast, every NVLink port carries one channel each way: NVLink-bound
    t = timed(op("all_reduce", range(p), S), profile(nic=50.0))
    assert t == pytest.approx(2 * (p - 1) / p * S / (100 * GB))
    # channels beyond the members per node are not used
    t4 = timed(op("all_reduce", (0, 1, 8, 9), S), profile(nic=10.0))
    assert t4 == pytest.approx(2 * 3 / 4 * S / (2 * 10 * GB))


def test_gloo_reduce_scatter_takes_the_all_reduce_time_and_bytes():
    gloo = profile(reduce_scatter="all_reduce", call_latency_us=75.0, link_latency_us=5.0)
    rs, ar = op("reduce_scatter", range(4), GB), op("all_reduce", range(4), GB)
    assert timed(rs, gloo) == pytest.approx(timed(ar, gloo))
    assert timed(rs, gloo) > 1.9 * timed(rs, profile(call_latency_us=75.0, link_latency_us=5.0))
    env = simpy.Environment()
    model = CollectiveModel(Network(env, build_fabric(NODE, gloo), "flow"), gloo)
    assert model.wire_bytes_on_fabric(rs) == 2 * rs.wire_bytes == ar.wire_bytes
    local = load_profile("local-cpu")
    assert CollectiveModel(Network(env, build_fabric(NODE, local), "flow"), local).algorithm("reduce_scatter") == "all_reduce"


def test_wire_bytes_on_fabric_match_the_standard_algorithm():
    env = simpy.Environment()
    prof = profile()
    model = CollectiveModel(Network(env, build_fabric(NODE, prof), "flow"), prof)
    mat = np.arange(36).reshape(6, 6) * 1000
    for o in (op("all_reduce", range(5), 1000), op("all_gather", range(5), 1000),
              op("reduce_scatter", range(5), 1000), op("p2p", (3, 9), 1000),
              op("all_to_all_v", range(6), matrix=mat)):
        assert model.wire_bytes_on_fabric(o) == o.wire_bytes


def test_direct_all_to_all_is_one_flow_per_off_diagonal_entry():
    env = simpy.Environment()
    prof = profile(link_latency_us=1.0, call_latency_us=10.0)
    model = CollectiveModel(Network(env, build_fabric(NODE, prof), "flow"), prof)
    mat = np.array([[5, 0, 7], [1, 9, 0], [0, 2, 3]])
    flows = model.flows_for(op("all_to_all_v", (0, 1, 9), matrix=mat))
    assert sorted(zip(flows.src.tolist(), flows.dst.tolist(), flows.nbytes.tolist())) == \
        [(0, 9, 7.0), (1, 0, 1.0), (9, 1, 2.0)]
    assert flows.fixed_latency_s == pytest.approx(10e-6 + 2e-6)  # 0 -> 9 crosses the leaf


def test_p2p_and_single_member_ops():
    prof = profile(link_latency_us=1.0, call_latency_us=10.0)
    assert timed(op("p2p", (0, 8), GB), prof) == pytest.approx(GB / (10 * GB) + 10e-6 + 2e-6)
    assert timed(op("all_reduce", (3,), GB), prof) == 0.0
    assert timed(op("p2p", (3, 3), GB), prof) == 0.0


def test_c13_all_to_all_bytes_per_layer_and_step():
    # C13: H = 4096, top-2, B = 32,768 tokens, FP16, 32 MoE layers
    H, k, B, dtype_bytes, layers, p = 4096, 2, 32768, 2, 32, 8
    slots_per_pair = B // p * k // p  # uniform routing: each rank's slots spread evenly
    dispatch = np.full((p, p), slots_per_pair * H * dtype_bytes)
    d_op = op("all_to_all_v", range(p), matrix=dispatch)
    c_op = op("all_to_all_v", range(p), matrix=dispatch.T.copy())
    assert dispatch.sum() == B * k * H * dtype_bytes == 2**29  # 0.5 GiB
    per_layer = dispatch.sum() + c_op.matrix.sum()
    assert per_layer == 2**30 and layers * per_layer == 32 * 2**30  # ~1 GB / layer, ~32 GB / step
    # what crosses the fabric leaves out each rank's own slots: (p-1)/p of it
    assert d_op.wire_bytes + c_op.wire_bytes == per_layer * (p - 1) // p
    # on the seed's cluster, one rank per node: every byte crosses a 23 GB/s NIC
    seed = load_profile("a100-seed")
    one_per_node = ClusterConfig(gpus_per_node=1, nodes_per_microcluster=8, microclusters=1)
    t = timed(d_op, seed, one_per_node)
    per_nic = dispatch[0].sum() * (p - 1) / p
    # call 20 us, 7 peer messages of 2 us each, one NIC-to-NIC path of 3 us
    assert t == pytest.approx(per_nic / 23e9 + 20e-6 + 7 * 2e-6 + 3e-6, rel=0.01)


def test_analytic_and_flow_modes_agree_on_collectives():
    prof = load_profile("h200")
    rng = np.random.default_rng(0)
    uniform = op("all_to_all_v", range(16), matrix=np.full((16, 16), 2_000_000))
    for o in (op("all_reduce", range(16), GB), op("all_gather", range(8), 64e6), uniform):
        assert timed(o, prof, mode="analytic") == pytest.approx(timed(o, prof, mode="flow"), rel=0.05)
    skewed = op("all_to_all_v", range(16), matrix=rng.integers(0, 4_000_000, (16, 16)))
    assert timed(skewed, prof, mode="analytic") <= timed(skewed, prof, mode="flow") * 1.0001


@pytest.mark.parametrize("alg", ["ring", "tree", "hierarchical", "nvls", "collnet"])
def test_analytic_loads_are_the_routed_atom_flows(alg):
    """One decomposition: AnalyticTimer.stage_loads = CollectiveModel.atom_flows routed by
    Fabric.paths, stage by stage, for every algorithm."""
    d = load_profile("h200").to_dict()
    d["collectives"].update(nvls=True, collnet=True)
    d["collectives"]["algorithm"]["all_reduce"] = alg
    prof = profile_from_dict(d, "t")
    c = ClusterConfig(gpus_per_node=4, nodes_per_microcluster=2, microclusters=2)
    model = CollectiveModel(Network(simpy.Environment(), build_fabric(c, prof), "analytic"), prof)
    timer = AnalyticTimer(model)
    o = op("all_reduce", (0, 1, 2, 3, 8, 9, 10, 11), 12_345_678)
    loads = timer.stage_loads(o)
    stages = model.stages(o)
    assert len(loads) == len(stages)
    for load, stage in zip(loads, stages):
        want = np.zeros(model.fabric.num_edges)
        fixed = 0.0
        for a in stage:
            f = model.atom_flows(a)
            paths = model.fabric.paths(f.src, f.dst, f.kind, **({} if f.kind == "edge" else {"nic_of_src": f.nic_of_src}))
            np.add.at(want, paths.edges, np.repeat(f.nbytes, paths.hops))
            fixed = max(fixed, f.fixed_latency_s)
        got = np.zeros(model.fabric.num_edges)
        got[load.edges] = load.nbytes
        np.testing.assert_allclose(got, want, rtol=1e-12)
        assert load.fixed_s == pytest.approx(fixed)
    assert timer.seconds(o) == pytest.approx(timed(o, prof, c, mode="analytic"), rel=1e-9)


def test_cached_routes_follow_a_rerouted_nic():
    prof = profile(all_reduce="ring")
    model = CollectiveModel(Network(simpy.Environment(), build_fabric(NODE, prof), "analytic"), prof)
    timer = AnalyticTimer(model)
    o = op("all_reduce", range(16), GB)
    before = set(timer.stage_loads(o)[0].edges.tolist())
    nic0 = model.fabric.offset["nic_up"] + 0
    assert nic0 in before
    model.fabric.set_capacity((("gpu", 0), ("leaf", 0)), 0.0)
    model.fabric.reroute_nic(0)
    after = set(timer.stage_loads(o)[0].edges.tolist())
    assert nic0 not in after and model.fabric.offset["nic_up"] + 1 in after


def test_wire_bytes_on_fabric_of_switch_algorithms():
    d = load_profile("h200").to_dict()
    d["collectives"].update(nvls=True)
    d["collectives"]["algorithm"]["all_reduce"] = "nvls"
    prof = profile_from_dict(d, "t")
    model = CollectiveModel(Network(simpy.Environment(), build_fabric(NODE, prof), "analytic"), prof)
    o = op("all_reduce", range(8), 8_000_000)
    assert model.wire_bytes_on_fabric(o) == 8 * 9_000_000  # S (1 + 1/8) up each member's port
