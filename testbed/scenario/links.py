"""The directed links of a cluster's three-level fabric (M21), in one place for both backends.

The simulator's fabric (``sim.hardware.fabric``) and the emulated cluster of the real backend
(``real.netem``) are built from this one description, so that they have the same links
at the same rates. Links come in *blocks*, each a direction of one link class, indexed by
rank (W = GPUs) or micro-cluster (M):

- ``nvlink_up[r]`` / ``nvlink_down[r]``: GPU r to / from its node's NVLink switch;
- ``nic_up[r]`` / ``nic_down[r]``: GPU r's NIC to / from its leaf;
- ``h2d[r]`` / ``d2h[r]``: host memory of r's node to / from GPU r (PCIe);
- ``spine_up[l]`` / ``spine_down[l]``: leaf l to / from the spine.

Leaves (M21): one per micro-cluster, or with ``cluster.rail_optimized`` one per (micro-
cluster, rail): NIC i of every node of micro-cluster m goes to leaf ``m * gpus_per_node +
i`` (``leaf_of``), so that same-rail traffic of a micro-cluster crosses one leaf and
cross-rail traffic crosses the spine. A leaf's spine uplink carries ``(GPUs under the
leaf) * spine.bandwidth / leaf_spine_oversubscription`` (the spine figure of a profile is
a per-GPU share), a fluid model of ECMP spreading flows evenly over the real spine
switches; rails split a micro-cluster's uplink capacity between its leaves.
"""

from __future__ import annotations

from typing import NamedTuple

from testbed.scenario.topology import LEAF, LEVELS, NVLINK, PCIE, SPINE

#: the blocks in the order of the simulator's dense edge arrays
BLOCKS = ("nvlink_up", "nvlink_down", "nic_up", "nic_down", "h2d", "d2h", "spine_up", "spine_down")
#: the blocks between GPUs and switches (no PCIe): what an emulated cluster wires
NETWORK_BLOCKS = ("nvlink_up", "nvlink_down", "nic_up", "nic_down", "spine_up", "spine_down")
#: the level (testbed.scenario.topology code) of each block's links
BLOCK_LEVEL = {"nvlink_up": NVLINK, "nvlink_down": NVLINK, "nic_up": LEAF, "nic_down": LEAF, "h2d": PCIE, "d2h": PCIE,
               "spine_up": SPINE, "spine_down": SPINE}


class BlockFigures(NamedTuple):
    """One block: how many links, and each one's rate, latency and level."""

    count: int  # links in the block (ranks or micro-clusters)
    bandwidth: float  # bytes/s per link, in the block's direction
    latency: float  # seconds
    level: int  # testbed.scenario.topology level code


def rails(cluster) -> int:
    """Leaves per micro-cluster: ``gpus_per_node`` with rail-optimised leaves, else 1."""
    return cluster.gpus_per_node if getattr(cluster, "rail_optimized", False) else 1


def leaf_count(cluster) -> int:
    """Leaf switches of the cluster (module doc)."""
    return cluster.microclusters * rails(cluster)


def leaf_of(cluster, rank):
    """The leaf rank ``rank``'s NIC goes to (ints or numpy arrays; module doc)."""
    mc = rank // cluster.gpus_per_microcluster
    r = rails(cluster)
    return mc * r + rank % cluster.gpus_per_node if r > 1 else mc


def fabric_blocks(cluster, profile) -> dict[str, BlockFigures]:
    """Every block of ``cluster`` (a ``ClusterConfig``) with ``profile``'s link figures."""
    links = profile.links
    w, m = cluster.gpus, leaf_count(cluster)
    per_leaf = cluster.gpus_per_microcluster // rails(cluster)
    uplink = per_leaf * links.spine.bandwidth / cluster.leaf_spine_oversubscription
    figures = {"nvlink": (w, links.nvlink), "nic": (w, links.nic), "h2d": (w, links.pcie), "d2h": (w, links.pcie)}
    out = {}
    for block in BLOCKS:
        if block.startswith("spine"):
            out[block] = BlockFigures(m, uplink, links.spine.latency, BLOCK_LEVEL[block])
        else:
            count, fig = figures[block.split("_")[0]]
            out[block] = BlockFigures(count, fig.bandwidth, fig.latency, BLOCK_LEVEL[block])
    return out


def counted_bytes_by_level(before: dict, after: dict) -> dict[str, int]:
    """Bytes the directed links of each network level carried between two readings of
    per-link byte counters keyed (block, index) (an emulated cluster's ``counters()``)."""
    out = {lv: 0 for lv in LEVELS[:3]}
    for (block, index), value in after.items():
        out[LEVELS[BLOCK_LEVEL[block]]] += int(value - before.get((block, index), 0))
    return out


def wired_blocks(cluster) -> tuple[str, ...]:
    """The network blocks a cluster really needs: no NVLink with one GPU per node, no
    spine with one leaf."""
    out = []
    for b in NETWORK_BLOCKS:
        if b.startswith("nvlink") and cluster.gpus_per_node == 1:
            continue
        if b.startswith("spine") and leaf_count(cluster) == 1:
            continue
        out.append(b)
    return tuple(out)


def route(cluster, src: int, dst: int, nic_of_src: int | None = None) -> list[tuple[str, int]]:
    """The directed links (block, index) of the fixed route from rank ``src`` to rank
    ``dst``: same node: NVLink up and down; else the NIC of ``nic_of_src`` (a GPU of
    ``src``'s node, default ``src`` itself; another GPU is reached over NVLink first: PXN,
    M21), the spine up and down when that NIC and ``dst``'s hang off different leaves, and
    ``dst``'s NIC (none to itself). ``sim.hardware.fabric`` routes the same way."""
    if src == dst:
        return []
    per_node = cluster.gpus_per_node
    if src // per_node == dst // per_node:
        return [("nvlink_up", src), ("nvlink_down", dst)]
    nic = src if nic_of_src is None else nic_of_src
    if nic // per_node != src // per_node:
        raise ValueError(f"nic_of_src {nic} is not on the node of rank {src}")
    out = [] if nic == src else [("nvlink_up", src), ("nvlink_down", nic)]
    l_src, l_dst = leaf_of(cluster, nic), leaf_of(cluster, dst)
    if l_src == l_dst:
        return out + [("nic_up", nic), ("nic_down", dst)]
    return out + [("nic_up", nic), ("spine_up", l_src), ("spine_down", l_dst), ("nic_down", dst)]


def flows_through(cluster) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """For every directed network link (block, index), the (src, dst) rank pairs whose
    route crosses it, in rank order."""
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for a in range(cluster.gpus):
        for b in range(cluster.gpus):
            for link in route(cluster, a, b):
                out.setdefault(link, []).append((a, b))
    return out


def path_latency_s(cluster, profile, src: int, dst: int) -> float:
    """One-way latency of the route from rank ``src`` to rank ``dst``, seconds: the sum of
    its links' latencies."""
    blocks = fabric_blocks(cluster, profile)
    return sum(blocks[b].latency for b, _ in route(cluster, src, dst))


def capacity_by_level(cluster, profile) -> dict[str, float]:
    """Bytes per second of all directed links of each level (``LEVELS``) together: what a
    level's utilisation divides by (wire bytes per step / (capacity x step time))."""
    cap = {lv: 0.0 for lv in LEVELS}
    for fig in fabric_blocks(cluster, profile).values():
        cap[LEVELS[fig.level]] += fig.count * fig.bandwidth
    return cap
