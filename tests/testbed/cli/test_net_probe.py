"""testbed net probe decides which algorithm the library runs from the wire bytes it
measured, against the simulator's candidates on the same fabric."""

import dataclasses

import pytest

from testbed.cli.net_probe import format_probe, identify, probed_profile
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

CLUSTER = {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 2, "profile": "emulated"}


def measured_row(kind, wire, seconds=0.3):
    return {"kind": kind, "bytes_per_member": 2 * 2**20, "seconds": seconds, "wire_bytes_by_level": wire}


def test_the_algorithm_whose_bytes_match_is_found():
    s = Scenario.from_dict({"cluster": CLUSTER, "parallelism": {"ep_size": 4}})
    p = load_profile("emulated")
    # what the probe measured on the emulated cluster (MB per level): a ring all-reduce, and
    # a reduce-scatter that moved as many bytes as the all-reduce (gloo)
    ring = {"nvlink": 30_800_000, "leaf": 30_810_000, "spine": 15_410_000}
    rows = [measured_row("all_reduce", ring), measured_row("reduce_scatter", ring),
            measured_row("all_gather", {"nvlink": 122_970_000, "leaf": 123_000_000, "spine": 61_500_000}, 1.25),
            measured_row("gloo_alltoallv", {"nvlink": 4_400_000, "leaf": 27_370_000, "spine": 18_570_000}, 0.2)]
    found = identify(s, p, rows)
    assert found == {"all_reduce": "ring", "reduce_scatter": "all_reduce", "all_gather": "ring"}
    rs = {c["algorithm"]: c for c in rows[1]["candidates"]}
    assert rs["all_reduce"]["wire_mismatch"] < 0.01 < 0.4 < rs["ring"]["wire_mismatch"]
    assert rows[3]["algorithm"] == "-"  # gloo's own all-to-all is shown, never chosen
    text = format_probe({"cluster": CLUSTER, "profile": "emulated", "latency": {}, "bulk": {}, "collectives": rows})
    assert "-> all_reduce" in text and "-> ring" in text


def test_probed_latencies_and_protocol_go_into_the_profile():
    p = load_profile("emulated")
    measured = {"latency": {"nvlink": {"one_way_per_link_us": 7.0, "rtt_median_us": 28.0},
                            "leaf": {"one_way_per_link_us": 6.0, "rtt_median_us": 24.0},
                            "spine": {"one_way_per_link_us": 5.0, "rtt_median_us": 40.0}},
                "bulk": {lv: {"payload_fraction": 0.95, "ack_fraction": 0.002} for lv in ("nvlink", "leaf", "spine")},
                "messages": {"message_bytes": 400.0}}
    q = probed_profile(p, measured)
    assert q.links.nvlink.latency_us == 7.0 and q.links.nic.latency_us == 6.0
    assert q.links.spine.latency_us == pytest.approx((40.0 / 2 - 2 * 6.0) / 2)  # 2 NICs and 2 spine links each way
    assert q.protocol.payload_fraction == 0.95 and q.protocol.ack_fraction == 0.002
    assert q.protocol.message_bytes == 400.0
    assert dataclasses.replace(q, links=p.links, protocol=p.protocol) == p  # nothing else changed
