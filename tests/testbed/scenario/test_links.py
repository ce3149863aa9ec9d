"""The one description of the fabric's links (testbed.scenario.links) agrees with the simulator's
routing, and every flow crosses the links its route names."""

import numpy as np
import pytest

from real.netem.plan import build_plan
from sim.hardware.fabric import build_fabric
from testbed.core.errors import ScenarioError
from testbed.scenario.links import (
    fabric_blocks,
    flows_through,
    leaf_count,
    leaf_of,
    path_latency_s,
    route,
    wired_blocks,
)
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


@pytest.mark.parametrize("shape", [(2, 2, 2), (4, 2, 1), (1, 2, 2), (2, 1, 3), (2, 2, 2, True), (4, 2, 1, True)])
def test_routes_are_the_simulators(shape):
    g, n, m, rail = (*shape, False)[:4]
    s = Scenario.from_dict({"cluster": {"gpus_per_node": g, "nodes_per_microcluster": n, "microclusters": m,
                                        "rail_optimized": rail},
                            "parallelism": {"ep_size": 1}})
    profile = load_profile("emulated")
    fabric = build_fabric(s, profile)
    W = s.world_size
    for a in range(W):
        for b in range(W):
            links = route(s.cluster, a, b)
            expected = sorted(fabric.offset[block] + i for block, i in links)
            assert sorted(fabric.path(a, b).tolist()) == expected, (a, b)
            assert path_latency_s(s.cluster, profile, a, b) == pytest.approx(
                float(fabric.paths([a], [b]).latency[0]) if a != b else 0.0)
            # the byte ledger's level of a pair is the highest level its route crosses
            if a != b:
                top = max(fabric.level[e] for e in fabric.path(a, b))
                assert Layout(s).level(a, b) == top, (a, b)
            if a // g != b // g:  # through any GPU's NIC of a's node (PXN)
                for nic in range(a // g * g, a // g * g + g):
                    links = route(s.cluster, a, b, nic)
                    expected = sorted(fabric.offset[block] + i for block, i in links)
                    assert sorted(fabric.paths([a], [b], nic_of_src=[nic]).edges.tolist()) == expected, (a, b, nic)
    crossing = flows_through(s.cluster)
    assert {block for block, _ in crossing} <= set(wired_blocks(s.cluster))
    for (block, i), pairs in crossing.items():
        assert all((block, i) in route(s.cluster, a, b) for a, b in pairs)


def test_the_spine_uplink_carries_a_share_per_gpu_divided_by_oversubscription():
    s = Scenario.from_dict({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 2,
                                        "leaf_spine_oversubscription": 4.0}, "parallelism": {"ep_size": 1}})
    blocks = fabric_blocks(s.cluster, load_profile("emulated"))
    assert blocks["spine_up"].count == 2 and blocks["nic_up"].count == 8
    assert blocks["spine_up"].bandwidth == pytest.approx(4 * 0.0125e9 / 4)
    assert np.isclose(blocks["nvlink_up"].bandwidth, 3 * blocks["nic_up"].bandwidth)


def test_rail_optimised_leaves_in_the_one_description():
    s = Scenario.from_dict({"cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 2,
                                        "rail_optimized": True}, "parallelism": {"ep_size": 1}})
    c = s.cluster
    assert leaf_count(c) == 8 and [leaf_of(c, r) for r in (0, 5, 7, 9, 14)] == [0, 1, 3, 5, 6]
    blocks = fabric_blocks(c, load_profile("h200"))
    assert blocks["spine_up"].count == 8 and blocks["spine_up"].bandwidth == pytest.approx(2 * 48e9)
    assert route(c, 1, 5) == [("nic_up", 1), ("nic_down", 5)]
    assert route(c, 1, 6) == [("nic_up", 1), ("spine_up", 1), ("spine_down", 2), ("nic_down", 6)]
    assert route(c, 1, 6, nic_of_src=2) == [("nvlink_up", 1), ("nvlink_down", 2), ("nic_up", 2), ("nic_down", 6)]
    with pytest.raises(ValueError, match="not on the node"):
        route(c, 1, 6, nic_of_src=4)
    one_mc = Scenario.from_dict({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1,
                                             "rail_optimized": True}, "parallelism": {"ep_size": 1}}).cluster
    assert "spine_up" in wired_blocks(one_mc)  # two rails: cross-rail traffic needs the spine
    with pytest.raises(ScenarioError) as e:
        Scenario.from_dict({"cluster": {"rail_optimized": "yes"}})
    assert e.value.field == "cluster.rail_optimized"


def test_the_emulated_cluster_refuses_rail_optimised_leaves():
    s = Scenario.from_dict({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1,
                                        "profile": "emulated", "rail_optimized": True},
                            "parallelism": {"ep_size": 1}})
    with pytest.raises(ScenarioError) as e:
        build_plan(s.cluster, load_profile("emulated"), "abc123")
    assert e.value.field == "cluster.rail_optimized"
