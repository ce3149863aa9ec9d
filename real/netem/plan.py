"""The plan of an emulated cluster: namespaces, veth links, addresses, routes and shaping.

Pure: nothing here runs a command. Every rank gets a network namespace; switches are
namespaces holding one Linux bridge (``tb<id>br``): a node's NVLink switch
(``testbed-<id>-node<n>``, only with more than one GPU per node), a micro-cluster's leaf
(``testbed-<id>-leaf<m>``) and the spine (``testbed-<id>-spine``, only with more than one
micro-cluster). The links of ``testbed.scenario.links`` are veth pairs between them; each end's
egress is one direction, shaped to its block's rate:

- NVLink of rank r: ``tb<id>v<r>`` in the rank (nvlink_up r) <-> ``tb<id>V<r>`` in its
  node (nvlink_down r);
- NIC of rank r: ``tb<id>n<r>`` in the rank (nic_up r) <-> ``tb<id>N<r>`` in its leaf
  (nic_down r);
- uplink of micro-cluster m: ``tb<id>u<m>`` in leaf m (spine_up m) <-> ``tb<id>U<m>`` in
  the spine (spine_down m).

Rank r has address 198.18.0.0 + 1 + r (RFC 2544 benchmarking range 198.18.0.0/15) as a
/32 on its NIC interface; it reaches the ranks of its node by a /32 route over NVLink
and every other rank over the NIC. Rates are bits/s (``tc``'s unit; the fabric blocks
are bytes/s).

The module also writes the command batches ``commands`` feeds to ``ip`` and ``tc``,
one per namespace and stage (see ``EmulatedFabric.up`` for the order).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from dataclasses import dataclass, field
from typing import NamedTuple

from real.netem.settings import (
    FIRST_FLOW_CLASS,
    HTB_QUANTUM,
    SMALL_CLASS,
    SMALL_MASK,
    SMALL_QUEUE,
    SMALL_SHARE,
    SYSCTLS,
    burst_bytes,
    default_queue_bytes,
)
from testbed.core.errors import ScenarioError
from testbed.scenario.links import fabric_blocks, flows_through, wired_blocks

#: every address comes from here (RFC 2544: reserved for benchmarking, never routed)
ADDRESS_RANGE = ipaddress.ip_network("198.18.0.0/15")
#: names of namespaces this package makes; nothing else is ever touched
NAMESPACE_PREFIX = "testbed-"
NAMESPACE_RE = re.compile(r"^testbed-([0-9a-f]{6})-(rank\d+|node\d+|leaf\d+|spine)$")
RUN_ID_RE = re.compile(r"^[0-9a-f]{6}$")
#: Linux interface names hold at most 15 characters
IFNAMSIZ = 15


def new_run_id() -> str:
    """A fresh run id: 6 lowercase hex characters."""
    return secrets.token_hex(3)


def namespace_name(run_id: str, kind: str, index: int | None = None) -> str:
    """``testbed-<id>-rank3``, ``testbed-<id>-spine`` ..."""
    return f"{NAMESPACE_PREFIX}{run_id}-{kind}{'' if index is None else index}"


def rank_address(rank: int) -> str:
    """IPv4 address of ``rank``: 198.18.0.1 for rank 0, counting up through the /15."""
    address = ADDRESS_RANGE.network_address + 1 + rank
    if address not in ADDRESS_RANGE or address == ADDRESS_RANGE.broadcast_address:
        raise ScenarioError("cluster", f"{rank + 1} ranks", f"more ranks than addresses in {ADDRESS_RANGE}")
    return str(address)


class Egress(NamedTuple):
    """One shaped direction of a link: the egress of one veth end."""

    block: str  # testbed.scenario.links block name
    index: int  # rank or micro-cluster
    namespace: str
    interface: str
    rate_bits: int  # bits/s
    flows: tuple[tuple[int, int], ...] = ()  # (src, dst) rank pairs whose route crosses this direction


class VethPair(NamedTuple):
    """A link: ``first`` is made in its namespace with ``second`` as peer in the other."""

    first: Egress
    second: Egress


@dataclass
class Plan:
    """Everything an emulated cluster consists of, by name."""

    run_id: str
    namespaces: list[str]  # in creation order: ranks, nodes, leaves, spine
    rank_namespaces: list[str]
    rank_interfaces: list[str]  # NIC interface of each rank
    nvlink_interfaces: list[str | None]  # None with one GPU per node
    addresses: list[str]
    node_peers: list[list[int]]  # other ranks of each rank's node
    pairs: list[VethPair]
    bridge: str  # bridge name inside every switch namespace
    switches: list[str] = field(default_factory=list)  # namespaces holding a bridge
    queue_bytes: int | None = None  # bfifo limit for every link; None: by rate

    # ---- derived views --------------------------------------------------------------
    def egresses(self) -> list[Egress]:
        """One row per shaped egress, in link order."""
        return [e for pair in self.pairs for e in pair]

    def by_device(self) -> dict[tuple[str, str], Egress]:
        """(namespace, interface) -> its egress."""
        return {(e.namespace, e.interface): e for e in self.egresses()}

    def queue_limit(self, rate_bits: int) -> int:
        """bfifo byte limit of each flow's queue on a link at ``rate_bits``."""
        return self.queue_bytes if self.queue_bytes is not None else default_queue_bytes(rate_bits)

    # ---- command batches, one per namespace and stage --------------------------------
    def netns_add_batch(self) -> str:
        """Host ``ip -batch``: make every namespace (nothing else happens in the host)."""
        return "".join(f"netns add {ns}\n" for ns in self.namespaces)

    @staticmethod
    def netns_del_batch(namespaces: list[str]) -> str:
        return "".join(f"netns del {ns}\n" for ns in namespaces)

    def sysctl_script(self, namespace: str, have_ipv6: bool) -> str:
        """``sh -ec`` script writing the namespace's ``SYSCTLS`` (``have_ipv6``: the kernel has IPv6)."""
        rank = namespace in self.rank_namespaces
        lines = [f"echo {s.value} > /proc/sys/{s.path}" for s in SYSCTLS
                 if (s.where == "every" or rank) and (have_ipv6 or not s.optional)]
        return "; ".join(lines)  # one line, so that an error message quoting it stays one line

    def create_batch(self, namespace: str) -> str:
        """``ip -n NS -batch``, stage 1: the bridge, veth pairs made from this side, lo, address."""
        lines = []
        if namespace in self.switches:
            # STP off and no forward delay: a port forwards as soon as it is up; no
            # multicast snooping: a snooping bridge joins 224.0.0.106 and sends IGMP
            # reports over every link, which the link counters would show
            lines.append(f"link add {self.bridge} type bridge stp_state 0 forward_delay 0 mcast_snooping 0")
            lines.append(f"link set {self.bridge} up")
        for first, second in self.pairs:
            if first.namespace == namespace:
                lines.append(f"link add {first.interface} type veth peer name {second.interface} netns {second.namespace}")
        if namespace in self.rank_namespaces:
            r = self.rank_namespaces.index(namespace)
            lines.append("link set lo up")
            lines.append(f"addr add {self.addresses[r]}/32 dev {self.rank_interfaces[r]}")
        return "".join(line + "\n" for line in lines)

    def wire_batch(self, namespace: str) -> str:
        """``ip -n NS -batch``, stage 2: ports into the bridge, interfaces up, routes."""
        lines = []
        for e in self.egresses():
            if e.namespace != namespace:
                continue
            master = f" master {self.bridge}" if namespace in self.switches else ""
            lines.append(f"link set dev {e.interface}{master} up")
        if namespace in self.rank_namespaces:
            r = self.rank_namespaces.index(namespace)
            lines.append(f"route add {ADDRESS_RANGE} dev {self.rank_interfaces[r]}")
            for p in self.node_peers[r]:
                lines.append(f"route add {self.addresses[p]}/32 dev {self.nvlink_interfaces[r]}")
        return "".join(line + "\n" for line in lines)

    def shape_batch(self, namespace: str) -> str:
        """``tc -n NS -batch``, per egress: an htb at the link's rate whose classes are a
        switch port with per-flow fair queueing and a priority lane for small packets
        (``real.netem.settings``): class 1:2 takes packets under 128 bytes (TCP
        acknowledgements, gloo's control messages, ARP) ahead of data; every (source,
        destination) rank pair whose route crosses the link gets a class of its own with
        an equal share and the whole link to borrow, and a deep bfifo behind it."""
        lines = []
        for e in self.egresses():
            if e.namespace != namespace:
                continue
            dev, rate = e.interface, e.rate_bits
            burst = burst_bytes(rate)
            shape = f"burst {burst} cburst {burst} quantum {HTB_QUANTUM}"
            small = max(1, int(rate * SMALL_SHARE))
            lines.append(f"qdisc add dev {dev} root handle 1: htb default {SMALL_CLASS}")
            lines.append(f"class add dev {dev} parent 1: classid 1:1 htb rate {rate}bit {shape}")
            lines.append(f"class add dev {dev} parent 1:1 classid 1:{SMALL_CLASS:x} htb rate {small}bit ceil {rate}bit "
                         f"{shape} prio 0")
            lines.append(f"qdisc add dev {dev} parent 1:{SMALL_CLASS:x} bfifo limit {SMALL_QUEUE}")
            lines.append(f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match u16 0x0000 0x{SMALL_MASK:04x} at 2 "
                         f"flowid 1:{SMALL_CLASS:x}")
            share = max(1, (rate - small) // max(1, len(e.flows)))
            for k, (src, dst) in enumerate(e.flows):
                cls = f"1:{FIRST_FLOW_CLASS + k:x}"
                lines.append(f"class add dev {dev} parent 1:1 classid {cls} htb rate {share}bit ceil {rate}bit {shape} prio 1")
                lines.append(f"qdisc add dev {dev} parent {cls} bfifo limit {self.queue_limit(rate)}")
                lines.append(f"filter add dev {dev} parent 1: protocol ip prio 2 u32 match ip src {self.addresses[src]}/32 "
                             f"match ip dst {self.addresses[dst]}/32 flowid {cls}")
        return "".join(line + "\n" for line in lines)


def build_plan(cluster, profile, run_id: str | None = None, queue_bytes: int | None = None) -> Plan:
    """The plan of ``cluster`` (a ``ClusterConfig``) with ``profile``'s link rates."""
    run_id = new_run_id() if run_id is None else run_id
    if not RUN_ID_RE.match(run_id):
        raise ScenarioError("real.network.run_id", run_id, "expected 6 lowercase hex characters")
    if queue_bytes is not None and not 0 < queue_bytes <= 2**31 - 1:
        raise ScenarioError("real.network.queue_bytes", queue_bytes, "expected 1 to 2**31 - 1 bytes")
    if getattr(cluster, "rail_optimized", False):
        raise ScenarioError("cluster.rail_optimized", True, "an emulated cluster wires one leaf per micro-cluster; "
                            "it cannot wire rail-optimised leaves (set cluster.rail_optimized = false)")
    blocks = fabric_blocks(cluster, profile)
    wired = wired_blocks(cluster)
    crossing = flows_through(cluster)
    world, per_node, per_mc = cluster.gpus, cluster.gpus_per_node, cluster.gpus_per_microcluster

    def egress(block: str, index: int, namespace: str, interface: str) -> Egress:
        return Egress(block, index, namespace, interface, int(round(blocks[block].bandwidth * 8)),
                      tuple(crossing.get((block, index), ())))

    def name(kind: str, index: int | None = None) -> str:
        return namespace_name(run_id, kind, index)

    def ifname(letter: str, index: int) -> str:
        out = f"tb{run_id}{letter}{index}"
        if len(out) > IFNAMSIZ:
            raise ScenarioError("cluster", f"{world} ranks", f"interface name {out} is longer than {IFNAMSIZ} characters")
        return out

    has_nvlink = "nvlink_up" in wired
    has_spine = "spine_up" in wired
    ranks = [name("rank", r) for r in range(world)]
    nodes = [name("node", n) for n in range(world // per_node)] if has_nvlink else []
    leaves = [name("leaf", m) for m in range(cluster.microclusters)]
    spine = [name("spine")] if has_spine else []
    pairs: list[VethPair] = []
    for r in range(world):
        if has_nvlink:
            node = nodes[r // per_node]
            pairs.append(VethPair(egress("nvlink_up", r, ranks[r], ifname("v", r)),
                                  egress("nvlink_down", r, node, ifname("V", r))))
        leaf = leaves[r // per_mc]
        pairs.append(VethPair(egress("nic_up", r, ranks[r], ifname("n", r)),
                              egress("nic_down", r, leaf, ifname("N", r))))
    for m in range(cluster.microclusters if has_spine else 0):
        pairs.append(VethPair(egress("spine_up", m, leaves[m], ifname("u", m)),
                              egress("spine_down", m, spine[0], ifname("U", m))))
    node_peers = [[p for p in range((r // per_node) * per_node, (r // per_node + 1) * per_node) if p != r]
                  for r in range(world)]
    return Plan(
        run_id=run_id,
        namespaces=ranks + nodes + leaves + spine,
        rank_namespaces=ranks,
        rank_interfaces=[ifname("n", r) for r in range(world)],
        nvlink_interfaces=[ifname("v", r) if has_nvlink else None for r in range(world)],
        addresses=[rank_address(r) for r in range(world)],
        node_peers=node_peers if has_nvlink else [[] for _ in range(world)],
        pairs=pairs,
        bridge=f"tb{run_id}br",
        switches=nodes + leaves + spine,
        queue_bytes=queue_bytes,
    )
