"""The one description of the fabric's links (testbed.links) agrees with the simulator's
routing, and every flow crosses the links its route names."""

import numpy as np
import pytest

from sim.fabric import build_fabric
from testbed.links import fabric_blocks, flows_through, path_latency_s, route, wired_blocks
from testbed.profile import load_profile
from testbed.scenario import Scenario


@pytest.mark.parametrize("shape", [(2, 2, 2), (4, 2, 1), (1, 2, 2), (2, 1, 3)])
def test_routes_are_the_simulators(shape):
    g, n, m = shape
    s = Scenario.from_dict({"cluster": {"gpus_per_node": g, "nodes_per_microcluster": n, "microclusters": m},
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
