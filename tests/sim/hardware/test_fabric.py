"""The fabric graph (M21): shape, routes, levels, capacities, faults, build speed."""

import subprocess
import sys
import time
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from sim.hardware.fabric import build_fabric
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.sections import ClusterConfig
from testbed.scenario.topology import LEAF, NVLINK, PCIE, SPINE, Layout

H200 = load_profile("h200")


def cluster(gpn=4, npm=2, mcs=3, oversub=1.0):
    return ClusterConfig(gpus_per_node=gpn, nodes_per_microcluster=npm, microclusters=mcs,
                         leaf_spine_oversubscription=oversub)


def test_nodes_and_edges():
    f = build_fabric(cluster(), H200)  # 24 GPUs, 6 nodes, 3 leaves
    g = f.graph
    assert g.number_of_nodes() == 24 + 2 * 6 + 3 + 1
    assert g.number_of_edges() == f.num_edges == 6 * 24 + 2 * 3
    assert {k for k, _ in g.nodes} == {"gpu", "nvswitch", "host", "leaf", "spine"}
    for u, v, a in g.edges(data=True):  # every link both ways, the same on each side
        back = g.edges[v, u]
        assert (back["bandwidth"], back["latency"], back["level"]) == (a["bandwidth"], a["latency"], a["level"])
        assert f.edges[a["index"]] == (u, v)
    assert g.edges[("gpu", 5), ("nvswitch", 1)]["level"] == NVLINK
    assert g.edges[("gpu", 5), ("leaf", 0)]["level"] == LEAF
    assert g.edges[("host", 1), ("gpu", 5)]["level"] == PCIE
    assert g.edges[("leaf", 2), ("spine", 0)]["level"] == SPINE


def test_capacities_from_the_profile():
    f = build_fabric(cluster(oversub=2.0), H200)
    g = f.graph
    assert g.edges[("gpu", 0), ("nvswitch", 0)]["bandwidth"] == 370e9
    assert g.edges[("leaf", 0), ("gpu", 0)]["bandwidth"] == 48e9
    assert g.edges[("gpu", 0), ("host", 0)]["bandwidth"] == 55.19e9
    # leaf uplink: 8 GPUs per micro-cluster x 48 GB/s / oversubscription 2
    assert g.edges[("leaf", 1), ("spine", 0)]["bandwidth"] == pytest.approx(8 * 48e9 / 2)
    assert g.edges[("gpu", 0), ("leaf", 0)]["latency"] == pytest.approx(1.5e-6)


def walk(f, edges):
    nodes = [f.edges[edges[0]][0]]
    for e in edges:
        u, v = f.edges[e]
        assert u == nodes[-1], "route is not a walk"
        nodes.append(v)
    return nodes


def test_routes_by_level():
    f = build_fabric(cluster(), H200)
    assert walk(f, f.path(0, 3)) == [("gpu", 0), ("nvswitch", 0), ("gpu", 3)]
    assert walk(f, f.path(0, 5)) == [("gpu", 0), ("leaf", 0), ("gpu", 5)]
    assert walk(f, f.path(9, 20)) == [("gpu", 9), ("leaf", 1), ("spine", 0), ("leaf", 2), ("gpu", 20)]
    assert len(f.path(7, 7)) == 0
    assert walk(f, f.pcie_path(6, to_gpu=True)) == [("host", 1), ("gpu", 6)]
    assert walk(f, f.pcie_path(6, to_gpu=False)) == [("gpu", 6), ("host", 1)]


def test_routes_are_shortest_paths_and_match_layout_levels():
    c = cluster()
    s = Scenario.from_dict({"cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 3}})
    f, levels = build_fabric(s, H200), Layout(s).level_matrix
    r = np.arange(c.gpus)
    src, dst = np.repeat(r, c.gpus), np.tile(r, c.gpus)
    paths = f.paths(src, dst)
    g = f.graph.subgraph(n for n in f.graph if n[0] != "host")  # no routing through host memory
    for i in range(0, len(src), 7):
        edges = paths.edges[paths.indptr[i]:paths.indptr[i + 1]]
        np.testing.assert_array_equal(edges, f.path(src[i], dst[i]))
        if src[i] == dst[i]:
            continue
        assert len(edges) == nx.shortest_path_length(g, ("gpu", src[i]), ("gpu", dst[i]))
        assert f.level[edges].max() == levels[src[i], dst[i]]
        assert paths.latency[i] == pytest.approx(f.latency[edges].sum())


def test_bad_ranks_and_kinds():
    f = build_fabric(cluster(), H200)
    with pytest.raises(ValueError):
        f.path(0, 24)
    with pytest.raises(ValueError):
        f.paths([0], [1], kind="nvme")


def test_set_capacity_degrades_and_cuts_links():
    f = build_fabric(cluster(), H200)
    spine = f.set_capacity("spine", 0.5)
    assert len(spine) == 6 and np.allclose(f.capacity[spine], f.nominal[spine] / 2)
    pair = f.set_capacity((("gpu", 0), ("leaf", 0)), 0.0)
    assert len(pair) == 2 and (f.capacity[pair] == 0).all()
    assert f.graph.edges[("leaf", 0), ("gpu", 0)]["bandwidth"] == 0
    around = f.set_capacity(("gpu", 1), 0.25)
    assert len(around) == 6  # nvlink, nic and pcie, both ways
    f.set_capacity(np.arange(f.num_edges), 1.0)
    np.testing.assert_array_equal(f.capacity, f.nominal)
    with pytest.raises(ValueError):
        f.set_capacity("nvlink", -1)
    with pytest.raises(ValueError):
        f.set_capacity("infiniband", 0.5)


def test_building_1440_gpus_is_fast():
    s = Scenario.from_dict({"cluster": {"gpus_per_node": 8, "nodes_per_microcluster": 10, "microclusters": 18}})
    start = time.perf_counter()
    f = build_fabric(s, H200)
    elapsed = time.perf_counter() - start
    assert f.world == 1440 and f.num_edges == 6 * 1440 + 2 * 18
    assert elapsed < 1.0, f"building the 1,440-GPU fabric took {elapsed:.3f} s"


def test_the_simulator_imports_without_torch():
    code = ("import sys, sim, sim.hardware.fabric, sim.network.network, sim.network.collective_model, sim.hardware.compute; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])


def test_a_flow_can_leave_its_node_through_a_peers_nic():
    f = build_fabric(cluster(), H200)  # 4 GPUs per node
    # 1 -> 5 through GPU 3's NIC: NVLink to 3, 3's NIC, the leaf, 5's NIC
    assert walk(f, f.paths([1], [5], nic_of_src=[3]).edges) == [("gpu", 1), ("nvswitch", 0), ("gpu", 3),
                                                               ("leaf", 0), ("gpu", 5)]
    same = f.paths([1, 2], [5, 3], nic_of_src=[1, 0])  # its own NIC; within a node nic_of_src is ignored
    np.testing.assert_array_equal(same.edges, np.concatenate([f.path(1, 5), f.path(2, 3)]))
    with pytest.raises(ValueError, match="not on the node"):
        f.paths([1], [5], nic_of_src=[4])
    assert f.rail_peer(1, 6).tolist() == 2 and f.rail_peer(9, 2).tolist() == 10


def test_rail_optimised_leaves():
    c = ClusterConfig(gpus_per_node=4, nodes_per_microcluster=2, microclusters=2, rail_optimized=True)
    f = build_fabric(c, H200)
    assert f.leaves == 8 and f.num_edges == 6 * 16 + 2 * 8
    assert f.graph.has_edge(("gpu", 5), ("leaf", 1)) and f.graph.has_edge(("gpu", 14), ("leaf", 6))
    # leaf uplink: the 2 GPUs under a rail leaf x 48 GB/s
    assert f.graph.edges[("leaf", 3), ("spine", 0)]["bandwidth"] == pytest.approx(2 * 48e9)
    assert walk(f, f.path(1, 5)) == [("gpu", 1), ("leaf", 1), ("gpu", 5)]  # same rail
    assert walk(f, f.path(1, 6)) == [("gpu", 1), ("leaf", 1), ("spine", 0), ("leaf", 2), ("gpu", 6)]
    assert walk(f, f.paths([1], [6], nic_of_src=[2]).edges) == [("gpu", 1), ("nvswitch", 0), ("gpu", 2),
                                                               ("leaf", 2), ("gpu", 6)]
    assert walk(f, f.path(1, 13)) == [("gpu", 1), ("leaf", 1), ("spine", 0), ("leaf", 5), ("gpu", 13)]


def test_edge_flows_and_rerouting_bump_the_routing_version():
    f = build_fabric(cluster(), H200)
    e = np.array([f.offset["nvlink_up"] + 3, f.offset["spine_down"] + 1])
    p = f.paths(e, e, "edge")
    np.testing.assert_array_equal(p.edges, e)
    assert p.latency.tolist() == pytest.approx([0.5e-6, 0.5e-6])
    with pytest.raises(ValueError):
        f.paths([f.num_edges], [0], "edge")
    v = f.routing_version
    f.set_capacity((("gpu", 1), ("leaf", 0)), 0.0)
    assert f.reroute_nic(1) == 0 and f.routing_version == v + 1
    assert walk(f, f.nic_edges([1], up=True).edges) == [("gpu", 1), ("nvswitch", 0), ("gpu", 0), ("leaf", 0)]
    assert walk(f, f.nic_edges([1], up=False).edges) == [("leaf", 0), ("gpu", 0), ("nvswitch", 0), ("gpu", 1)]
    assert f.leaf_of_nic([1, 5]).tolist() == [0, 0]
