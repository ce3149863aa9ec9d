"""``testbed net probe``: what an emulated cluster's links and gloo really do, against the model.

The real backend measures (``real.netem.probe``, found by name): per level, link latency
(TCP ping-pong) and the protocol overhead and goodput of one bulk flow; per collective
kind, one gloo call on every rank with the seconds it took and the wire bytes each level
carried. For every kind this module then times each algorithm the simulator knows for it
(``sim.network.collective_model.seconds_alone``, found by name) on the same fabric with the
measured latencies and protocol overhead, and names the algorithm whose wire bytes per
level are closest to the measured ones: which algorithm gloo runs is decided by
measurement, not assumed. ``--write`` saves a copy of the profile with what was measured
(link latencies, ``[protocol]``, the algorithms found).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import numpy as np

from testbed.policy.collectives import CollectiveOp
from testbed.run.backend import get_tool
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import ALGORITHMS, MachineProfile, load_profile, save_profile
from testbed.scenario.scenario import Scenario

DEFAULT_CLUSTER = {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 2, "profile": "emulated"}


def probed_profile(profile: MachineProfile, measured: dict) -> MachineProfile:
    """``profile`` with the measured one-way latency per link and protocol overhead."""
    lat = measured["latency"]
    links = profile.links
    nvlink = lat.get("nvlink", {}).get("one_way_per_link_us", links.nvlink.latency_us)
    nic = lat.get("leaf", {}).get("one_way_per_link_us", links.nic.latency_us)
    spine = links.spine.latency_us
    if "spine" in lat:  # a spine route: two NICs and two spine links
        spine = max(0.0, (lat["spine"]["rtt_median_us"] / 2 - 2 * nic) / 2)
    links = dataclasses.replace(
        links, nvlink=dataclasses.replace(links.nvlink, latency_us=nvlink),
        nic=dataclasses.replace(links.nic, latency_us=nic), spine=dataclasses.replace(links.spine, latency_us=spine))
    bulk = [b for b in measured["bulk"].values() if b["payload_fraction"]]
    protocol = profile.protocol
    if bulk:
        protocol = dataclasses.replace(
            protocol, payload_fraction=min(1.0, statistics.median(b["payload_fraction"] for b in bulk)),
            ack_fraction=statistics.median(b["ack_fraction"] for b in bulk))
    if "messages" in measured:
        protocol = dataclasses.replace(protocol, message_bytes=measured["messages"]["message_bytes"])
    return dataclasses.replace(profile, links=links, protocol=protocol)


def _op(kind: str, world: int, per_member: int) -> CollectiveOp:
    members = tuple(range(world))
    if kind == "all_to_all_v":
        m = np.full((world, world), per_member // world, dtype=np.int64)
        return CollectiveOp(kind, members, "dispatch", matrix=m)
    return CollectiveOp(kind, members, "dispatch", size=per_member)


def candidates(scenario: Scenario, profile: MachineProfile, row: dict) -> list[dict]:
    """Each algorithm the simulator knows for ``row``'s kind, timed alone on the fabric."""
    seconds_alone = get_tool("sim-collective-seconds")
    out = []
    for algorithm in ALGORITHMS[row["kind"]]:  # the kind's candidates
        algs = dataclasses.replace(profile.collectives.algorithm, **{row["kind"]: algorithm})
        prof = dataclasses.replace(profile, collectives=dataclasses.replace(profile.collectives, algorithm=algs))
        seconds, wire = seconds_alone(scenario, prof, _op(row["kind"], scenario.world_size, row["bytes_per_member"]))
        measured = row["wire_bytes_by_level"]
        total = max(1, sum(measured.values()))
        out.append({"algorithm": algorithm, "seconds": seconds, "wire_bytes_by_level": wire,
                    "wire_mismatch": sum(abs(wire[lv] - measured[lv]) for lv in measured) / total})
    return out


def identify(scenario: Scenario, profile: MachineProfile, rows: list[dict]) -> dict[str, str]:
    """For each measured collective row: its ``candidates`` and the ``algorithm`` whose wire
    bytes per level are closest (ties, within a percent: the closer time). Returns kind ->
    algorithm found. Rows of kinds the planner does not use (gloo's own all-to-all) are
    set against the direct all-to-all for reference and decide nothing."""
    chosen = {}
    for row in rows:
        if row["kind"] not in ALGORITHMS:
            row["candidates"], row["algorithm"] = candidates(scenario, profile, dict(row, kind="all_to_all_v")), "-"
            continue
        row["candidates"] = candidates(scenario, profile, row)
        best = min(row["candidates"], key=lambda c: (round(c["wire_mismatch"], 2), abs(c["seconds"] - row["seconds"])))
        row["algorithm"] = chosen[row["kind"]] = best["algorithm"]
    return chosen


def probe_scenario(config: str | None, overrides: list[str], write: str | None = None) -> dict:
    """Measure the cluster of ``config`` (default: 2 x 2 x 2 on the emulated profile),
    compare with the model, and optionally write the probed profile."""
    if config:
        scenario = load_scenario(config, overrides)
    else:
        scenario = load_scenario(None, overrides, base={"cluster": DEFAULT_CLUSTER, "parallelism": {"ep_size": 4}})
    scenario = scenario.replace(real={"network": "emulated"})
    profile = load_profile(scenario.cluster.profile)
    measured = get_tool("net-probe")(scenario, profile)
    probed = probed_profile(profile, measured)
    chosen = identify(scenario, probed, measured["collectives"])
    probed = dataclasses.replace(probed, collectives=dataclasses.replace(
        probed.collectives, algorithm=dataclasses.replace(probed.collectives.algorithm, **chosen)))
    result = {"cluster": dataclasses.asdict(scenario.cluster), "profile": profile.name, **measured,
              "probed": {"links": dataclasses.asdict(probed.links), "protocol": dataclasses.asdict(probed.protocol),
                         "algorithm": dataclasses.asdict(probed.collectives.algorithm)}}
    if write:
        result["written"] = str(save_profile(probed, Path(write)))
    return result


def format_probe(result: dict) -> str:
    """The probe as a few readable tables."""
    lines = [f"cluster {result['cluster']['gpus_per_node']} x {result['cluster']['nodes_per_microcluster']} x "
             f"{result['cluster']['microclusters']}, profile {result['profile']}", "",
             "level   rtt median us   one-way per link us   goodput MB/s   shaped MB/s   payload/wire   ack/payload"]
    for level, lat in result["latency"].items():
        b = result["bulk"][level]
        lines.append(f"{level:7s} {lat['rtt_median_us']:13.1f}   {lat['one_way_per_link_us']:19.1f}   "
                     f"{b['goodput_Bps'] / 1e6:12.2f}   {b['shaped_Bps'] / 1e6:11.2f}   "
                     f"{b['payload_fraction']:12.4f}   {b['ack_fraction']:11.4f}")
    if result.get("messages"):
        m = result["messages"]
        lines += ["", f"messages: {m['messages']} one-float messages between ranks {m['pair'][0]} and {m['pair'][1]} put "
                  f"{m['wire_bytes']} bytes on the wire: {m['message_bytes']:.0f} bytes a message on each link it crosses"]
    lines += ["", "collective      bytes/member  measured s  wire MB (nvlink/leaf/spine)   candidates (s, wire mismatch)  -> found"]
    for row in result["collectives"]:
        wire = "/".join(f"{v / 1e6:.2f}" for v in row["wire_bytes_by_level"].values())
        cands = ", ".join(f"{c['algorithm']} {c['seconds']:.3f} s {100 * c['wire_mismatch']:.1f}%" for c in row["candidates"])
        lines.append(f"{row['kind']:15s} {row['bytes_per_member']:12d}  {row['seconds']:10.3f}  {wire:28s}  {cands}  -> {row['algorithm']}")
    if result.get("written"):
        lines += ["", f"wrote {result['written']}"]
    return "\n".join(lines)
