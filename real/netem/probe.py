"""Measuring an emulated cluster: its links, and what gloo really puts on them.

``probe(scenario, profile)`` makes the scenario's emulated cluster and measures, with
nothing else running:

- *latency* per level: a 1-byte TCP ping-pong between a pair of ranks whose route crosses
  that level (same node: NVLink; same micro-cluster: two NICs; else two NICs and the
  spine). One-way latency per link = median round trip / 2 / links on the route.
- *bulk* per level: one TCP flow of ``BULK_BYTES`` between the same pair; the kernel's
  counters give the wire bytes forward (first link) and back (acknowledgements), so
  ``payload_fraction`` = payload / forward wire bytes and ``ack_fraction`` = backward wire
  bytes / payload; goodput = payload / seconds against the link's shaped rate.
- *messages*: one-float messages passed back and forth between rank 0 and a rank of
  another node: the wire bytes a message costs on each link it crosses, whatever its
  size (the library's rendezvous notices, headers, acknowledgements): ``message_bytes``.
- *collectives*: the real backend's all-to-all (uniform; on CPU sends and receives to
  every member at once, ``real.comm.collectives.all_to_all_p2p``), gloo's all_gather, reduce_scatter
  and all_reduce, and for reference gloo's own all_to_all (``gloo_alltoallv``), on every
  rank at once, one call each after a gate, at ``COLLECTIVE_BYTES`` per member: seconds
  (slowest rank) and the wire bytes each level carried. Which algorithm that is, is
  decided by comparing with the simulator's candidates (``testbed.cli.net_probe``).

Ping-pong and bulk use plain sockets made in the namespaces by short-lived threads (a
thread's ``setns`` leaves the rest of this process where it is).
"""

from __future__ import annotations

import pickle
import queue as queue_mod
import socket
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from real.comm.collectives import all_to_all_p2p
from real.netem.fabric import EmulatedFabric
from real.netem.nsenter import enter_namespace, join_rank_network
from testbed.core.errors import RunError
from testbed.scenario.links import counted_bytes_by_level, fabric_blocks, route

PING_ROUNDS = 400
BULK_BYTES = 4 * 2**20
COLLECTIVE_BYTES = 2 * 2**20  # per member
COLLECTIVE_KINDS = ("all_to_all_v", "all_gather", "reduce_scatter", "all_reduce", "gloo_alltoallv")
MESSAGES = 200  # tiny messages rank 0 and a rank of another node pass back and forth
PORT = 47001


def level_pairs(cluster) -> dict[str, tuple[int, int]]:
    """A (src, dst) rank pair per level the cluster has: its route crosses that level."""
    out = {}
    if cluster.gpus_per_node > 1:
        out["nvlink"] = (0, 1)
    if cluster.nodes_per_microcluster > 1:
        out["leaf"] = (0, cluster.gpus_per_node)
    if cluster.microclusters > 1:
        out["spine"] = (0, cluster.gpus_per_microcluster)
    return out


def route_links(level: str) -> int:
    """Links a route through ``level`` crosses one way (see ``level_pairs``)."""
    return {"nvlink": 2, "leaf": 2, "spine": 4}[level]


def _in_namespace(namespace: str, fn):
    """``fn()`` run in a thread that entered ``namespace``; its result or its exception."""
    box = {}

    def body():
        try:
            enter_namespace(namespace)
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _connected_pair(fabric: EmulatedFabric, src: int, dst: int) -> tuple[socket.socket, socket.socket]:
    """(client socket in src's namespace, server socket in dst's), connected, TCP_NODELAY."""
    address = fabric.rank_address(dst)

    def listen():
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, PORT))
        s.listen(1)
        return s

    listener = _in_namespace(fabric.rank_namespace(dst), listen)
    client = _in_namespace(fabric.rank_namespace(src), lambda: socket.create_connection((address, PORT), timeout=10))
    server, _ = listener.accept()
    listener.close()
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, server


def _recv_exactly(s: socket.socket, n: int) -> None:
    while n > 0:
        got = len(s.recv(min(n, 1 << 20)))
        if got == 0:
            raise RunError("probe: connection closed early")
        n -= got


def ping(fabric: EmulatedFabric, src: int, dst: int, rounds: int = PING_ROUNDS) -> list[float]:
    """Round-trip seconds of 1-byte messages src -> dst -> src."""
    client, server = _connected_pair(fabric, src, dst)

    def echo():
        for _ in range(rounds):
            _recv_exactly(server, 1)
            server.sendall(b"y")

    t = threading.Thread(target=echo)
    t.start()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        client.sendall(b"x")
        _recv_exactly(client, 1)
        out.append(time.perf_counter() - t0)
    t.join()
    client.close()
    server.close()
    return out


def bulk(fabric: EmulatedFabric, src: int, dst: int, nbytes: int = BULK_BYTES) -> tuple[float, dict, dict]:
    """(seconds, counters before, counters after) of one flow of ``nbytes`` src -> dst."""
    client, server = _connected_pair(fabric, src, dst)
    t = threading.Thread(target=lambda: (_recv_exactly(server, nbytes), server.sendall(b"k")))
    before = fabric.counters()
    t.start()
    t0 = time.perf_counter()
    chunk = b"\0" * (1 << 20)
    left = nbytes
    while left > 0:
        client.sendall(chunk[:min(left, len(chunk))])
        left -= min(left, len(chunk))
    _recv_exactly(client, 1)  # the receiver has every byte
    seconds = time.perf_counter() - t0
    t.join()
    time.sleep(0.05)  # the last acknowledgements
    after = fabric.counters()
    client.close()
    server.close()
    return seconds, before, after


def _first_links(cluster, src: int, dst: int, level: str) -> tuple[tuple[str, int], tuple[str, int]]:
    """(src's first link toward dst, dst's first link back): where forward and backward
    bytes of the pair are counted."""
    if level == "nvlink":
        return ("nvlink_up", src), ("nvlink_up", dst)
    return ("nic_up", src), ("nic_up", dst)


# ---- collectives on every rank --------------------------------------------------------------
def _rank_main(rank: int, world: int, store: str, q, barrier, netns: tuple[str, str], nbytes: int, peer: int):
    try:
        join_rank_network(netns)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        n = nbytes // 4 // world * world
        x = torch.ones(n)
        split = [n // world] * world
        calls = {
            "all_to_all_v": lambda: all_to_all_p2p(torch.empty(n), x, split, split, list(range(world)), rank, None),
            "gloo_alltoallv": lambda: dist.all_to_all_single(torch.empty(n), x, split, split),
            "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(n * world), x),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(n // world), x),
            "all_reduce": lambda: dist.all_reduce(x),
        }
        for fn in calls.values():  # connections made, buffers touched
            fn()
        seconds = {}
        for kind in COLLECTIVE_KINDS:
            barrier.wait(120)
            barrier.wait(120)  # the launcher read the counters
            t0 = time.perf_counter()
            calls[kind]()
            seconds[kind] = time.perf_counter() - t0
        barrier.wait(120)
        barrier.wait(120)
        one = torch.ones(1)
        for i in range(MESSAGES if rank in (0, peer) else 0):  # one message at a time, each way in turn
            sender = 0 if i % 2 == 0 else peer
            if rank == sender:
                dist.send(one, peer if rank == 0 else 0)
            else:
                dist.recv(one, sender)
        barrier.wait(120)
        barrier.wait(120)
        q.put(("done", rank, pickle.dumps(seconds)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        q.put(("error", rank, f"{type(e).__name__}: {e}"))


def collectives(fabric: EmulatedFabric, world: int, peer: int, nbytes: int = COLLECTIVE_BYTES) -> tuple[list[dict], tuple]:
    """Each of ``COLLECTIVE_KINDS`` once on every rank: seconds and counters around it; then
    ``MESSAGES`` one-float messages between rank 0 and ``peer``: counters around them."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(world + 1)
    snaps = []
    with tempfile.TemporaryDirectory(prefix="testbed-probe-") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, world, str(Path(tmp) / "store"), q, barrier,
                                                       fabric.rank_network(r), nbytes,
                                                       peer))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            for _ in range(len(COLLECTIVE_KINDS) + 2):
                barrier.wait(300)
                snaps.append(fabric.counters())
                barrier.wait(300)
            results = {}
            while len(results) < world:
                try:
                    kind, rank, payload = q.get(timeout=120)
                except queue_mod.Empty:
                    raise RunError("probe: the ranks made no progress for 2 minutes") from None
                if kind == "error":
                    raise RunError(f"probe rank {rank} failed: {payload}")
                results[rank] = pickle.loads(payload)
        except BaseException:
            barrier.abort()
            raise
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    rows = [{"kind": kind, "bytes_per_member": nbytes // 4 // world * world * 4,
             "seconds": max(results[r][kind] for r in results), "counters_before": snaps[i],
             "counters_after": snaps[i + 1]} for i, kind in enumerate(COLLECTIVE_KINDS)]
    return rows, (snaps[-2], snaps[-1])


def probe(scenario, profile) -> dict:
    """Every measurement of the module doc, on a fresh emulated cluster of ``scenario``."""
    cluster = scenario.cluster
    blocks = fabric_blocks(cluster, profile)
    out = {"latency": {}, "bulk": {}, "collectives": []}
    with EmulatedFabric(scenario, profile) as fabric:
        for level, (src, dst) in level_pairs(cluster).items():
            rtt = ping(fabric, src, dst)
            out["latency"][level] = {"pair": [src, dst], "rtt_median_us": statistics.median(rtt) * 1e6,
                                     "rtt_min_us": min(rtt) * 1e6,
                                     "one_way_per_link_us": statistics.median(rtt) / 2 / route_links(level) * 1e6}
            seconds, before, after = bulk(fabric, src, dst)
            fwd, back = _first_links(cluster, src, dst, level)
            wire_fwd, wire_back = after[fwd] - before[fwd], after[back] - before[back]
            out["bulk"][level] = {
                "pair": [src, dst], "payload_bytes": BULK_BYTES, "seconds": seconds,
                "goodput_Bps": BULK_BYTES / seconds, "shaped_Bps": blocks[fwd[0]].bandwidth,
                "wire_forward_bytes": wire_fwd, "wire_backward_bytes": wire_back,
                "payload_fraction": BULK_BYTES / wire_fwd if wire_fwd else None,
                "ack_fraction": wire_back / BULK_BYTES}
        peer = cluster.gpus_per_node  # the first rank of another node: its route crosses two NICs
        rows, (before, after) = collectives(fabric, cluster.gpus, peer)
        for row in rows:
            row["wire_bytes_by_level"] = counted_bytes_by_level(row.pop("counters_before"), row.pop("counters_after"))
            out["collectives"].append(row)
        wire = sum(after.values()) - sum(before.values())
        links = len(route(cluster, 0, peer))
        out["messages"] = {"pair": [0, peer], "messages": MESSAGES, "wire_bytes": wire,
                           "message_bytes": wire / MESSAGES / links}
    return out
