"""The emulated cluster network (real.netem): its plan without privileges, real namespaces with root.

The root tests build a 2 GPUs/node x 2 nodes x 2 micro-cluster cluster with slow links
(NIC 25e6 bytes/s) so that a few MB show the shaping, move bytes with plain sockets run
in the rank namespaces, and always remove what they made (fixtures with finally).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from real.netem import EmulatedFabric, check_privileges, clean, enter_namespace, leftovers, privileges_missing, registry
from real.netem.nsenter import existing_namespaces
from real.netem.plan import ADDRESS_RANGE, IFNAMSIZ, NAMESPACE_RE
from testbed.core.errors import RunError, ScenarioError
from testbed.scenario.links import fabric_blocks, wired_blocks
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

REASON = privileges_missing()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"emulated network: {REASON}")
REPO = Path(__file__).resolve().parents[3]
NIC_RATE = 25e6  # bytes/s of the slow test profile's NIC


def cluster(gpus_per_node: int = 2, nodes: int = 2, microclusters: int = 2) -> Scenario:
    world = gpus_per_node * nodes * microclusters
    return Scenario.from_dict({
        "cluster": {"gpus_per_node": gpus_per_node, "nodes_per_microcluster": nodes, "microclusters": microclusters},
        "parallelism": {"ep_size": math.gcd(world, 4)},
    })


def slow_profile():
    """local-cpu with links slow enough to see the shaping: NVLink 1e8, NIC and spine 2.5e7 bytes/s."""
    p = load_profile("local-cpu")
    links = dataclasses.replace(
        p.links,
        nvlink=dataclasses.replace(p.links.nvlink, bandwidth_GBps=0.1),
        nic=dataclasses.replace(p.links.nic, bandwidth_GBps=NIC_RATE / 1e9),
        spine=dataclasses.replace(p.links.spine, bandwidth_GBps=NIC_RATE / 1e9))
    return dataclasses.replace(p, links=links)


# ---- the plan (no privileges) ----------------------------------------------------------
SHAPES = [(2, 2, 2), (1, 4, 2), (4, 2, 1), (8, 4, 4), (1, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
def test_names_fit_and_addresses_are_unique_in_the_range(shape):
    f = EmulatedFabric(cluster(*shape), load_profile("local-cpu"))
    assert len(f.run_id) == 6 and int(f.run_id, 16) >= 0
    rows = f.links()
    assert all(len(row.interface) <= IFNAMSIZ for row in rows)
    assert len({row.interface for row in rows}) == len(rows)
    assert all(NAMESPACE_RE.match(ns) for ns in f.namespaces)
    assert len(set(f.namespaces)) == len(f.namespaces)
    world = cluster(*shape).cluster.gpus
    addresses = [f.rank_address(r) for r in range(world)]
    assert len(set(addresses)) == world
    assert all(ipaddress.ip_address(a) in ADDRESS_RANGE for a in addresses)
    assert addresses[0] == "198.18.0.1"
    assert all(f.rank_interface(r) == f"tb{f.run_id}n{r}" for r in range(world))
    assert f.rank_namespace(world - 1) == f"testbed-{f.run_id}-rank{world - 1}"


@pytest.mark.parametrize("shape", SHAPES)
def test_one_shaped_egress_per_block_and_index_at_the_block_rate(shape):
    sc, profile = cluster(*shape), slow_profile()
    f = EmulatedFabric(sc, profile)
    blocks = fabric_blocks(sc.cluster, profile)
    keys = [(row.block, row.index) for row in f.links()]
    assert len(keys) == len(set(keys))
    assert set(keys) == {(b, i) for b in wired_blocks(sc.cluster) for i in range(blocks[b].count)}
    for row in f.links():
        assert row.rate_bits == round(blocks[row.block].bandwidth * 8)
        assert row.namespace in f.namespaces


def test_one_gpu_per_node_has_no_nvlink_and_one_microcluster_no_spine():
    f = EmulatedFabric(cluster(1, 4, 1), load_profile("local-cpu"))
    assert {row.block for row in f.links()} == {"nic_up", "nic_down"}
    assert not any("-node" in ns or ns.endswith("-spine") for ns in f.namespaces)
    assert "/32" not in f.plan.wire_batch(f.rank_namespace(0))
    g = EmulatedFabric(cluster(2, 2, 1), load_profile("local-cpu"))
    assert {row.block for row in g.links()} == {"nvlink_up", "nvlink_down", "nic_up", "nic_down"}
    assert sum("-node" in ns for ns in g.namespaces) == 2


def test_each_side_of_a_link_shapes_its_own_direction():
    f = EmulatedFabric(cluster(), slow_profile(), run_id="abc123")
    where = {(row.block, row.index): (row.namespace, row.interface) for row in f.links()}
    assert where["nic_up", 5] == ("testbed-abc123-rank5", "tbabc123n5")
    assert where["nic_down", 5] == ("testbed-abc123-leaf1", "tbabc123N5")
    assert where["nvlink_up", 3] == ("testbed-abc123-rank3", "tbabc123v3")
    assert where["nvlink_down", 3] == ("testbed-abc123-node1", "tbabc123V3")
    assert where["spine_up", 1] == ("testbed-abc123-leaf1", "tbabc123u1")
    assert where["spine_down", 1] == ("testbed-abc123-spine", "tbabc123U1")
    # rank 3 reaches rank 2 (same node) over NVLink, everyone else over its NIC
    wiring = f.plan.wire_batch("testbed-abc123-rank3")
    assert "route add 198.18.0.3/32 dev tbabc123v3" in wiring
    assert "route add 198.18.0.0/15 dev tbabc123n3" in wiring


def test_every_flow_crossing_a_link_gets_its_own_fair_queue_behind_a_lane_for_small_packets():
    f = EmulatedFabric(cluster(), slow_profile(), run_id="abc123")
    batch = f.plan.shape_batch("testbed-abc123-rank0")
    nic = [line for line in batch.splitlines() if "tbabc123n0 " in line]
    # rank 0's NIC carries its traffic to the 6 ranks of other nodes: one class, queue and filter each
    flows = [line for line in nic if "match ip src 198.18.0.1/32" in line]
    assert len(flows) == 6 and "match ip dst 198.18.0.2/32" not in " ".join(flows)  # rank 1: its node, NVLink
    assert sum("bfifo limit 8388608" in line for line in nic) == 6  # deep: lossless in practice
    # every flow class has an equal share of the link and may borrow all of it
    classes = [line for line in nic if line.startswith("class add") and line.endswith("prio 1")]
    assert len(classes) == 6 and all("rate 31666666bit ceil 200000000bit" in line for line in classes)  # 0.95 / 6
    # packets under 128 bytes (acknowledgements) go first, whatever their flow
    assert any("u32 match u16 0x0000 0xff80 at 2 flowid 1:2" in line for line in nic)
    spine = f.plan.shape_batch("testbed-abc123-leaf0")
    assert sum("tbabc123u0 parent 1: protocol ip prio 2" in line for line in spine.splitlines()) == 16  # 4 x 4 pairs
    g = EmulatedFabric(cluster(), slow_profile(), run_id="abc123", queue_bytes=100_000)
    assert g.plan.shape_batch("testbed-abc123-rank0").count("bfifo limit 100000\n") == 7  # NVLink 1 + NIC 6


def test_bad_run_id_is_refused():
    with pytest.raises(ScenarioError, match="run_id"):
        EmulatedFabric(cluster(), slow_profile(), run_id="ABC")


def test_privilege_check_agrees_with_its_reason():
    if REASON is None:
        check_privileges()
    else:
        with pytest.raises(ScenarioError, match="real.network"):
            check_privileges()


def test_enter_namespace_refuses_other_names():
    with pytest.raises(OSError):
        enter_namespace("not-ours")
    with pytest.raises(OSError):
        enter_namespace("testbed-000000-rank999")  # no such namespace


# ---- real namespaces (root) ------------------------------------------------------------
@pytest.fixture
def made():
    """Fabrics and run ids a test made; all removed afterwards, whatever happened."""
    fabrics: list[EmulatedFabric] = []
    run_ids: list[str] = []
    try:
        yield fabrics, run_ids
    finally:
        for f in fabrics:
            f.down()
        ids = run_ids + [f.run_id for f in fabrics]
        if ids:
            clean(force=True, only=ids)
        assert not [ns for ns in existing_namespaces() if any(ns.startswith(f"testbed-{i}-") for i in ids)]


@pytest.fixture
def fabric(made):
    f = EmulatedFabric(cluster(), slow_profile())
    made[0].append(f)
    return f.up()


SERVER = textwrap.dedent("""
    import socket, struct, sys
    s = socket.socket(); s.bind((sys.argv[1], 5000)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); n = 0
    while (b := c.recv(1 << 20)):
        n += len(b)
    c.sendall(struct.pack("!Q", n)); c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, struct, sys, time
    n = int(sys.argv[2]); t = time.perf_counter()
    c = socket.create_connection((sys.argv[1], 5000), timeout=20)
    block = bytes(1 << 20)
    for i in range(0, n, len(block)):
        c.sendall(block[:min(len(block), n - i)])
    c.shutdown(socket.SHUT_WR)
    got = struct.unpack("!Q", c.recv(8))[0]
    print(got, time.perf_counter() - t)
""")


def transfer(f: EmulatedFabric, src: int, dst: int, nbytes: int) -> float:
    """Send ``nbytes`` from rank src to rank dst over TCP; return the seconds it took."""
    server = subprocess.Popen(["ip", "netns", "exec", f.rank_namespace(dst), sys.executable, "-c", SERVER,
                               f.rank_address(dst)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(["ip", "netns", "exec", f.rank_namespace(src), sys.executable, "-c", CLIENT,
                              f.rank_address(dst), str(nbytes)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        got, seconds = out.stdout.split()
        assert int(got) == nbytes
        server.wait(timeout=10)
        return float(seconds)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def moved(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@needs_root
def test_up_and_down_are_fast_and_leave_nothing(made):
    f = EmulatedFabric(cluster(), slow_profile())
    made[0].append(f)
    host_interfaces = socket.if_nameindex()
    start = time.perf_counter()
    f.up()
    up_s = time.perf_counter() - start
    assert socket.if_nameindex() == host_interfaces  # nothing made in the host's namespace
    assert set(f.namespaces) <= set(existing_namespaces())
    assert len(f.namespaces) == 8 + 4 + 2 + 1
    assert registry.read_all()[f.run_id][1]["owner_pid"] == os.getpid()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        f.counters()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    f.down()
    down_s = time.perf_counter() - start
    assert up_s < 2.0 and down_s < 1.0 and min(times) < 0.1, (up_s, down_s, times)
    assert not set(f.namespaces) & set(existing_namespaces())
    assert f.run_id not in registry.read_all()
    f.down()  # idempotent


@needs_root
def test_an_exception_inside_with_still_removes_everything(made):
    f = EmulatedFabric(cluster(), slow_profile())
    made[0].append(f)
    with pytest.raises(ValueError, match="boom"):
        with f:
            assert set(f.namespaces) <= set(existing_namespaces())
            raise ValueError("boom")
    assert not set(f.namespaces) & set(existing_namespaces())
    assert f.run_id not in registry.read_all()


BROKEN_STAGES = [
    ("sysctl_script", lambda ns, have_ipv6: "echo 1 > /proc/sys/net/nosuch", "sh -ec echo 1 > /proc/sys/net/nosuch"),
    ("wire_batch", lambda ns: "link set dev nosuchdev up\n", "at `link set dev nosuchdev up`"),
    ("shape_batch", lambda ns: "qdisc add dev nosuchdev root handle 1: htb\n", "at `qdisc add dev nosuchdev"),
]


@needs_root
@pytest.mark.parametrize("stage, broken, quoted", BROKEN_STAGES, ids=[b[0] for b in BROKEN_STAGES])
def test_a_failing_command_raises_one_line_and_removes_what_was_made(made, stage, broken, quoted):
    f = EmulatedFabric(cluster(), slow_profile())
    made[0].append(f)
    setattr(f.plan, stage, broken)
    with pytest.raises(RunError) as info:
        f.up()
    message = str(info.value)
    assert "\n" not in message and quoted in message and "testbed-" in message, message
    assert not set(f.namespaces) & set(existing_namespaces())
    assert f.run_id not in registry.read_all()


@needs_root
def test_namespaces_without_a_registry_file_belong_to_a_dead_owner(fabric):
    registry.remove(fabric.run_id)
    run = {r["run_id"]: r for r in leftovers()}[fabric.run_id]
    assert run["owner_pid"] is None and not run["owner_alive"] and run["registry"] is None
    assert set(clean(only=[fabric.run_id])) == set(fabric.namespaces)
    assert not set(fabric.namespaces) & set(existing_namespaces())


@pytest.mark.slow
@needs_root
def test_same_node_traffic_uses_nvlink_only(fabric):
    before = fabric.counters()
    transfer(fabric, 0, 1, 1_000_000)
    d = moved(before, fabric.counters())
    assert d["nvlink_up", 0] >= 1_000_000 and d["nvlink_down", 1] >= 1_000_000
    assert all(v == 0 for (block, _), v in d.items() if not block.startswith("nvlink")), d


@needs_root
def test_cross_microcluster_traffic_crosses_nic_leaf_and_spine(fabric):
    before = fabric.counters()
    transfer(fabric, 0, 4, 1_000_000)
    d = moved(before, fabric.counters())
    for key in [("nic_up", 0), ("spine_up", 0), ("spine_down", 1), ("nic_down", 4)]:
        assert d[key] >= 1_000_000, (key, d)
    assert all(v == 0 for (block, _), v in d.items() if block.startswith("nvlink")), d


@needs_root
def test_a_bulk_transfer_runs_at_the_shaped_rate(fabric):
    before = fabric.counters()
    seconds = transfer(fabric, 0, 2, 6_000_000)  # other node, same leaf: one NIC each way
    d = moved(before, fabric.counters())
    wire_rate = d["nic_up", 0] / seconds
    assert abs(wire_rate / NIC_RATE - 1) < 0.15, (wire_rate, seconds)
    assert d["spine_up", 0] < 1000  # the leaf floods only the ARP broadcast up the spine
    print(f"wire rate {wire_rate / 1e6:.2f} MB/s over {seconds:.3f} s")


@needs_root
def test_a_rank_process_enters_its_namespace(fabric):
    script = textwrap.dedent(f"""
        import socket
        from real.netem import enter_namespace
        enter_namespace({fabric.rank_namespace(3)!r})
        print(sorted(name for _, name in socket.if_nameindex()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(sorted(["lo", fabric.rank_interface(3), f"tb{fabric.run_id}v3"]))


CHILD = textwrap.dedent("""
    import subprocess, sys, time
    from testbed.scenario.profile import load_profile
    from testbed.scenario.scenario import Scenario
    from real.netem import EmulatedFabric
    sc = Scenario.from_dict({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 2},
                             "parallelism": {"ep_size": 4}})
    f = EmulatedFabric(sc, load_profile("local-cpu"), run_id=sys.argv[1]).up()
    # a stand-in rank process; "inside" once it has entered the namespace
    rank = subprocess.Popen(["ip", "netns", "exec", f.rank_namespace(0), "sh", "-c", "echo inside; exec sleep 60"],
                            stdout=subprocess.PIPE, text=True)
    assert rank.stdout.readline().strip() == "inside"
    print(rank.pid, flush=True)
    time.sleep(60)
""")


@needs_root
def test_clean_removes_what_a_killed_owner_left_and_keeps_live_runs(made, fabric):
    run_id = secrets.token_hex(3)
    made[1].append(run_id)
    child = subprocess.Popen([sys.executable, "-c", CHILD, run_id], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        rank_pid = int(child.stdout.readline())
    finally:
        child.kill()
        child.wait()
    assert os.path.exists(f"/proc/{rank_pid}")  # the rank outlives its owner
    runs = {r["run_id"]: r for r in leftovers()}
    assert not runs[run_id]["owner_alive"] and len(runs[run_id]["namespaces"]) == 4 + 2 + 2 + 1
    assert runs[fabric.run_id]["owner_alive"]

    removed = clean()
    assert set(runs[run_id]["namespaces"]) <= set(removed)
    assert not set(runs[run_id]["namespaces"]) & set(existing_namespaces())
    assert run_id not in registry.read_all()
    deadline = time.monotonic() + 5
    while registry.process_start(rank_pid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert registry.process_start(rank_pid) is None  # killed by clean

    assert not set(fabric.namespaces) & set(removed)  # a live owner's cluster stays ...
    assert set(fabric.namespaces) <= set(existing_namespaces())
    assert set(clean(force=True, only=[fabric.run_id])) == set(fabric.namespaces)  # ... unless forced
    assert not set(fabric.namespaces) & set(existing_namespaces())
    fabric.down()  # nothing left to do, no error


GLOO_RANK = textwrap.dedent("""
    import os, sys
    from real.netem import enter_namespace
    namespace, interface, master, rank = sys.argv[1:5]
    enter_namespace(namespace)  # before torch starts any thread
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29500", rank=int(rank), world_size=2)
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    print(int(t.sum()))
    dist.destroy_process_group()
""")


@pytest.mark.slow
@needs_root
def test_gloo_ranks_in_two_microclusters_all_reduce_over_the_spine(fabric):
    before = fabric.counters()
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_RANK, fabric.rank_namespace(r), fabric.rank_interface(r),
                               fabric.rank_address(0), str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO) for i, r in enumerate((0, 4))]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == [str(2 << 20)] * 2
    d = moved(before, fabric.counters())
    # two ranks: each sends its whole 4 MiB tensor to the other, headers on top
    for key in [("nic_up", 0), ("spine_up", 0), ("spine_down", 1), ("nic_down", 4),
                ("nic_up", 4), ("spine_up", 1), ("spine_down", 0), ("nic_down", 0)]:
        assert d[key] >= 4 << 20, (key, d)
    assert all(v == 0 for (block, _), v in d.items() if block.startswith("nvlink")), d
