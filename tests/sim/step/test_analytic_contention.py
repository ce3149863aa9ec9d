"""Analytic mode with collectives that share links (sim.step.schedule.run_analytic): ops that
run at the same time slow each other where they share a link, as in flow mode, and only
there."""

import numpy as np
import pytest
import simpy

import sim.step.link_loads
import sim.step.schedule
from sim.hardware.fabric import build_fabric
from sim.network.analytic_timer import AnalyticTimer
from sim.network.collective_model import CollectiveModel
from sim.network.network import Network
from sim.step.phases import Phase
from sim.step.schedule import run_analytic, run_flows
from testbed.policy.collectives import CollectiveOp
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile, profile_from_dict
from testbed.scenario.scenario import Scenario
from testbed.scenario.sections import ClusterConfig

GB = 1e9
FLOW_TOLERANCE = 0.03  # flow mode's finishes wait up to 1% (Network.coalesce); a little more for latency


def profile(nic=40.0, spine=10.0):
    """h200's latencies and algorithms, round link rates (GB/s)."""
    d = load_profile("h200").to_dict()
    d["links"]["nic"]["bandwidth_GBps"] = nic
    d["links"]["spine"]["bandwidth_GBps"] = spine
    return profile_from_dict(d, "test")


def models(cluster: ClusterConfig, prof):
    """(analytic timer, flow-mode collective model) on fabrics of the cluster."""
    analytic = CollectiveModel(Network(simpy.Environment(), build_fabric(cluster, prof), "analytic"), prof)
    flow = CollectiveModel(Network(simpy.Environment(), build_fabric(cluster, prof), "flow"), prof)
    return AnalyticTimer(analytic), flow


def two_leaves(gpus_per_node=2, oversub=2.0) -> ClusterConfig:
    """Two micro-clusters of one node each: traffic between them crosses the spine (with
    ``profile``'s figures, 2 GPUs x 10 GB/s / 2 = 10 GB/s each way per leaf)."""
    return ClusterConfig(gpus_per_node=gpus_per_node, nodes_per_microcluster=1, microclusters=2,
                         leaf_spine_oversubscription=oversub)


def all_to_all(members, nbytes, stage="dispatch"):
    p = len(members)
    return CollectiveOp("all_to_all_v", tuple(members), stage, matrix=np.full((p, p), nbytes) - np.diag([nbytes] * p))


def durations(timeline) -> list[float]:
    return [end - start for _, start, end in timeline.ops]


def transfer(timer, op, seconds) -> float:
    """Seconds of ``op``'s bytes flowing: its time less its fixed latencies."""
    return seconds - sum(load.fixed_s for load in timer.stage_loads(op))


def test_two_all_to_alls_sharing_a_spine_link_take_twice_as_long():
    """Group A = GPUs 0 and 2, group B = 1 and 3, one GPU of each on each leaf. A leaf's
    spine uplink carries 10 GB/s, its NICs 40: alone, each all-to-all sends S over the
    uplink (S / 10 GB/s); together they send 2 S over it, so each takes twice as long
    (max-min: the two flows on the uplink get 5 GB/s each). Flow mode agrees."""
    cluster, prof = two_leaves(), profile()
    timer, flow = models(cluster, prof)
    a, b = all_to_all((0, 2), 1 * GB), all_to_all((1, 3), 1 * GB)
    alone = [transfer(timer, op, timer.seconds(op)) for op in (a, b)]
    assert alone == pytest.approx([0.1, 0.1], rel=1e-6)  # 1 GB over 10 GB/s
    together = [Phase("dispatch", 0, "ops", "comm", (), ops=[a, b])]
    analytic = run_analytic(together, 4, timer, 0.0, 0.0)
    assert [transfer(timer, op, d) for op, d in zip((a, b), durations(analytic))] == pytest.approx([0.2, 0.2], rel=1e-6)
    flows = run_flows(together, 4, flow, 0.0, 0.0)
    assert durations(analytic) == pytest.approx(durations(flows), rel=FLOW_TOLERANCE)


def test_an_all_to_all_joining_halfway_shares_the_rest():
    """B starts when A is half done: A moves its second half at half rate (0.05 s ->
    0.1 s), B shares for that time and then runs alone: both take 0.15 s, A ending
    first, as max-min (and flow mode) has it."""
    cluster, prof = two_leaves(), profile()
    timer, flow = models(cluster, prof)
    a, b = all_to_all((0, 2), 1 * GB), all_to_all((1, 3), 1 * GB)
    delay = np.zeros(4)
    delay[[1, 3]] = 0.05  # B's members arrive when half of A's bytes are through (same latency)
    phases = [Phase("dispatch", 0, "ops", "comm", (), ops=[a]),
              Phase("experts", 0, "compute", "compute", (), seconds=delay),
              Phase("dispatch", 0, "ops", "sync", (1,), ops=[b])]
    analytic = run_analytic(phases, 4, timer, 0.0, 0.0)
    # as consistent as run_analytic's fixed point is asked to be
    assert [transfer(timer, op, d) for op, d in zip((a, b), durations(analytic))] == \
        pytest.approx([0.15, 0.15], rel=sim.step.schedule.PASS_RTOL)
    flows = run_flows(phases, 4, flow, 0.0, 0.0)
    assert durations(analytic) == pytest.approx(durations(flows), rel=FLOW_TOLERANCE)


def test_ops_on_disjoint_links_keep_their_time_alone():
    """Groups inside one node each (0-1 on leaf 0, 2-3 on leaf 1) use only their own
    NVLink ports: together they take exactly their time alone."""
    cluster, prof = two_leaves(), profile()
    timer, _ = models(cluster, prof)
    a, b = all_to_all((0, 1), 1 * GB), all_to_all((2, 3), 3 * GB)
    alone = [timer.seconds(op) for op in (a, b)]
    analytic = run_analytic([Phase("dispatch", 0, "ops", "comm", (), ops=[a, b])], 4, timer, 0.0, 0.0)
    assert durations(analytic) == alone


def test_ops_one_after_another_on_the_same_links_keep_their_time_alone():
    """The same group's dispatch and combine cross the same spine link, one after the
    other on the comm stream: they never share it, so each keeps its time alone."""
    cluster, prof = two_leaves(), profile()
    timer, _ = models(cluster, prof)
    a, b = all_to_all((0, 2), 1 * GB), all_to_all((0, 2), 2 * GB, "combine")
    phases = [Phase("dispatch", 0, "ops", "comm", (), ops=[a]), Phase("combine", 0, "ops", "comm", (0,), ops=[b])]
    analytic = run_analytic(phases, 4, timer, 0.0, 0.0)
    assert durations(analytic) == pytest.approx([timer.seconds(a), timer.seconds(b)], rel=1e-12)  # end - start


def fan_out_beside_a_ring(peer: int, ring_bytes: float):
    """(all-to-all, ring, phases): GPU 0 sends 1 GB to each of GPUs 4, 5 and 6 (three flows
    through its NIC) while a ring all-reduce of ``ring_bytes`` between GPU 0 and ``peer``
    runs on the sync stream (one flow through the same NIC)."""
    a2a = CollectiveOp("all_to_all_v", (0, 4, 5, 6), "combine_backward",
                       matrix=np.array([[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]) * GB)
    ring = CollectiveOp("all_reduce", (0, peer), "expert_sync", size=int(ring_bytes))
    phases = [Phase("combine_backward", 0, "ops", "comm", (), ops=[a2a]),
              Phase("expert_sync", 0, "ops", "sync", (), ops=[ring])]
    return a2a, ring, phases


def test_a_ring_gets_its_flows_share_of_a_nic_an_all_to_all_crosses_with_many():
    """GPU 0 sends a ring all-reduce's one flow and an all-to-all's three flows through its
    NIC at the same time: max-min gives the all-to-all 3/4 of the NIC, not half."""
    cluster, prof = ClusterConfig(gpus_per_node=4, nodes_per_microcluster=2, microclusters=1), profile(nic=40.0)
    timer, flow = models(cluster, prof)
    a2a, ring, phases = fan_out_beside_a_ring(7, 8 * GB)
    analytic = run_analytic(phases, 8, timer, 0.0, 0.0)
    a2a_s = transfer(timer, a2a, durations(analytic)[0])
    assert a2a_s == pytest.approx(3 * GB / (0.75 * 40 * GB), rel=0.02)  # 3 GB at 30 GB/s
    flows = run_flows(phases, 8, flow, 0.0, 0.0)
    assert durations(analytic) == pytest.approx(durations(flows), rel=FLOW_TOLERANCE)


def skewed(members, nbytes, hot, stage="dispatch"):
    """An all-to-all of ``nbytes`` per pair, three times that to member ``hot`` and half
    of it from there."""
    p = len(members)
    m = np.full((p, p), float(nbytes))
    m[:, hot] *= 3.0
    m[hot, :] *= 0.5
    np.fill_diagonal(m, 0.0)
    return CollectiveOp("all_to_all_v", tuple(members), stage, matrix=m)


def by_members(timeline) -> list[tuple[float, float]]:
    """(start, end) of each op, ops in member order (flow mode logs them as they end)."""
    return [(start, end) for _, start, end in sorted(timeline.ops, key=lambda o: o[0].members)]


def taken(timeline) -> list[float]:
    """Seconds each op takes, ops in member order."""
    return [end - start for start, end in by_members(timeline)]


def test_a_ring_takes_no_more_of_a_link_than_a_skewed_all_to_alls_largest_flow():
    """Leaf 0's uplink (40 GB/s) carries the all-to-all's four flows of 0.3, 0.1, 0.3 and
    0.1 GB and a long ring's one flow. Max-min gives the five 8 GB/s; once the small flows
    are done, the ring's flow and the two large ones share the link, so the ring takes as
    much as the all-to-all's largest flow (0.3 GB), not its mean (0.2 GB): 1.1 GB in
    27.5 ms. Flow mode agrees."""
    cluster = ClusterConfig(gpus_per_node=4, nodes_per_microcluster=1, microclusters=2, leaf_spine_oversubscription=1.0)
    timer, flow = models(cluster, profile(nic=400.0, spine=10.0))
    a2a = skewed((0, 1, 4, 5), 0.1 * GB, hot=2)
    ring = CollectiveOp("all_reduce", (2, 6), "expert_sync", size=int(8 * GB))
    phases = [Phase("dispatch", 0, "ops", "comm", (), ops=[a2a]), Phase("expert_sync", 0, "ops", "sync", (), ops=[ring])]
    analytic = run_analytic(phases, 8, timer, 0.0, 0.0)
    assert transfer(timer, a2a, durations(analytic)[0]) == pytest.approx(1.1 * GB / (40 * GB), rel=1e-6)
    assert taken(analytic) == pytest.approx(taken(run_flows(phases, 8, flow, 0.0, 0.0)), rel=FLOW_TOLERANCE)


def test_an_early_all_to_all_waits_for_one_that_joins_it_on_a_busy_uplink():
    """Two skewed all-to-alls that cross the spine, the second starting a tenth of its time
    later: alone, each is held by its hot GPU's NIC; together, the uplinks hold both. The
    first does not finish a tenth earlier: the uplinks carry the second's bytes before the
    first's largest flows finish, as in flow mode."""
    cluster = ClusterConfig(gpus_per_node=4, nodes_per_microcluster=1, microclusters=2, leaf_spine_oversubscription=2.0)
    timer, flow = models(cluster, profile(nic=40.0, spine=40.0))
    a, b = skewed((0, 2, 4, 6), 0.1 * GB, hot=0), skewed((1, 3, 5, 7), 0.1 * GB, hot=1)
    delay = np.zeros(8)
    delay[[1, 3, 5, 7]] = 0.1 * timer.seconds(a)
    phases = [Phase("dispatch", 0, "ops", "comm", (), ops=[a]),
              Phase("experts", 0, "compute", "compute", (), seconds=delay),
              Phase("dispatch", 0, "ops", "sync", (1,), ops=[b])]
    analytic = by_members(run_analytic(phases, 8, timer, 0.0, 0.0))
    flows = by_members(run_flows(phases, 8, flow, 0.0, 0.0))
    assert [end for _, end in analytic] == pytest.approx([end for _, end in flows], rel=0.05)
    assert analytic[1][1] - analytic[0][1] < 0.1 * timer.seconds(a)


def test_a_ring_held_elsewhere_leaves_an_all_to_all_the_rest_of_a_nic():
    """GPU 0's NIC (40 GB/s) carries an all-to-all's three flows and a ring's one, which
    the spine holds to 4 GB/s: max-min gives the all-to-all the other 36 GB/s, not 3/4
    of the NIC."""
    cluster = ClusterConfig(gpus_per_node=4, nodes_per_microcluster=2, microclusters=2, leaf_spine_oversubscription=1.0)
    timer, flow = models(cluster, profile(nic=40.0, spine=0.5))
    a2a, ring, phases = fan_out_beside_a_ring(8, 1 * GB)
    analytic = run_analytic(phases, 16, timer, 0.0, 0.0)
    assert transfer(timer, a2a, durations(analytic)[0]) == pytest.approx(3 * GB / (36 * GB), rel=0.02)
    assert taken(analytic) == pytest.approx(taken(run_flows(phases, 16, flow, 0.0, 0.0)), rel=FLOW_TOLERANCE)


def test_copies_count_their_bytes_once_however_many_passes():
    """A copy next to contending all-to-alls: the fixed point takes several passes, the
    PCIe statistics count the copy once."""
    cluster, prof = two_leaves(), profile()
    timer, _ = models(cluster, prof)
    h2d = np.array([5e8, 0, 0, 0])
    phases = [Phase("dispatch", 0, "ops", "comm", (), ops=[all_to_all((0, 2), 1 * GB), all_to_all((1, 3), 1 * GB)]),
              Phase("paging", 0, "copy", "copy", (), h2d=h2d, d2h=np.zeros(4), pages=np.array([1, 0, 0, 0]))]
    run_analytic(phases, 4, timer, 0.0, 0.0)
    pcie = timer.fabric.offset["h2d"] + np.arange(4)
    assert timer.stats.bytes_by_edge[pcie].tolist() == h2d.tolist()


def overlapped_sync(tmp_path, mode):
    """16 H200s, 4 per node, a node per leaf and an oversubscribed spine; EP groups of 8
    across two leaves; the replicas' gradient all-reduce on the sync stream during the
    backward (M22) crosses the same NICs and uplinks as the backward's all-to-alls."""
    return Scenario.from_dict({
        "model": {"hidden_size": 4096, "ffn_hidden_size": 2048, "num_layers": 2, "num_experts": 16, "dtype": "bf16"},
        "cluster": {"profile": "h200", "gpus_per_node": 4, "nodes_per_microcluster": 1, "microclusters": 4,
                    "leaf_spine_oversubscription": 4.0},
        "parallelism": {"ep_size": 8}, "pager": {"enabled": False},
        "comm": {"expert_sync": "allreduce"}, "overlap": {"sync_with_backward": True},
        "workload": {"tokens_per_rank": 4096, "skew": 1.0},
        "run": {"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path)},
        "sim": {"network_model": mode},
    })


def test_sync_overlapping_the_backward_slows_both_as_in_flow_mode(tmp_path, monkeypatch):
    """With the expert sync on its own stream, analytic mode used to time it and the
    backward's all-to-alls as if each were alone on the fabric: the sync came out 4x too
    fast. Sharing links, both stages and the step agree with flow mode within 10%."""
    flow = run_scenario(overlapped_sync(tmp_path, "flow"), "sim")
    shared = run_scenario(overlapped_sync(tmp_path, "analytic"), "sim")
    monkeypatch.setattr(sim.step.schedule.LinkLoads, "delays", lambda self, begin, length: np.zeros(len(begin)))  # all alone
    alone = run_scenario(overlapped_sync(tmp_path, "analytic"), "sim")
    stages = ("expert_sync", "combine_backward", "dispatch_backward")
    for stage in stages:
        assert shared["stage_time_s"][stage] == pytest.approx(flow["stage_time_s"][stage], rel=0.10), stage
    assert shared["step_time_s"] == pytest.approx(flow["step_time_s"], rel=0.10)
    assert alone["stage_time_s"]["expert_sync"] < 0.5 * flow["stage_time_s"]["expert_sync"]
    assert shared["stage_time_s"]["combine_backward"] > 1.05 * alone["stage_time_s"]["combine_backward"]
    assert shared["bytes_by_stage"] == alone["bytes_by_stage"] == flow["bytes_by_stage"]


def contending_phases(spread=1.0):
    """Skewed all-to-alls of two groups on the spine, then one of both groups after."""
    return [Phase("dispatch", 0, "ops", "comm", (), ops=[skewed((0, 2), 1 * GB, 0), skewed((1, 3), spread * GB, 1)]),
            Phase("combine", 0, "ops", "comm", (0,), ops=[all_to_all((0, 1, 2, 3), 0.5 * GB)])]


def test_a_step_like_the_last_starts_from_its_delays_and_takes_one_pass(monkeypatch):
    """With a WarmStart, a step of the same ops starts from the last step's delays: the
    fixed point holds at once, so one pass checks it (cold: two or more), and the
    timeline is the cold one's within the fixed point's tolerance. Different ops start
    cold."""
    cluster, prof = two_leaves(), profile()
    calls = []
    delays = sim.step.schedule.LinkLoads.delays
    monkeypatch.setattr(sim.step.schedule.LinkLoads, "delays", lambda self, b, n: calls.append(1) or delays(self, b, n))
    cold_timer, _ = models(cluster, prof)
    cold = run_analytic(contending_phases(), 4, cold_timer, 0.0, 0.0)
    cold_passes = len(calls)
    assert cold_passes >= 2
    warm, timer = sim.step.schedule.WarmStart(), models(cluster, prof)[0]
    run_analytic(contending_phases(), 4, timer, 0.0, 0.0, warm)
    calls.clear()
    again = run_analytic(contending_phases(), 4, timer, 0.0, 0.0, warm)
    assert len(calls) == 1
    assert durations(again) == pytest.approx(durations(cold), rel=2 * sim.step.schedule.PASS_RTOL)
    calls.clear()
    other = [Phase("dispatch", 0, "ops", "comm", (), ops=[skewed((0, 2), 1 * GB, 0)])]
    run_analytic(other, 4, timer, 0.0, 0.0, warm)
    assert warm.start(sim.step.schedule.LinkLoads(other, timer), np.zeros(1)).tolist() == [0.0]


def test_the_sweep_in_chunks_of_links_gives_the_sweep_in_one(monkeypatch):
    """Links are independent: sweeping them a link or two at a time gives the delays of
    one sweep over all (to rounding: the running sums start at each chunk)."""
    cluster = ClusterConfig(gpus_per_node=2, nodes_per_microcluster=2, microclusters=2, leaf_spine_oversubscription=4.0)
    timer, _ = models(cluster, profile())
    phases = [Phase("dispatch", 0, "ops", "comm", (), ops=[skewed((0, 2, 4, 6), 1 * GB, 0), skewed((1, 3, 5, 7), 0.7 * GB, 2),
                                                           all_to_all((0, 1, 4, 5), 0.3 * GB)])]
    loads = sim.step.schedule.LinkLoads(phases, timer)
    begin = np.array([0.0, 0.01, 0.02])
    length = np.maximum(loads.alone - loads.fixed, 0.0)
    monkeypatch.setattr(sim.step.link_loads, "SWEEP_CHUNK", 10**9)
    whole = loads.delays(begin, length)
    monkeypatch.setattr(sim.step.link_loads, "SWEEP_CHUNK", 1)
    chunked = loads.delays(begin, length)
    assert whole.max() > 0.01  # they contend
    assert chunked == pytest.approx(whole, rel=1e-9, abs=1e-15)


def test_all_to_alls_of_one_member_set_load_the_links_as_each_alone():
    """AnalyticTimer.all_to_all_loads times a member set's all-to-alls together: each
    stage's latency, bytes and messages per edge are those of the op timed alone, and
    the largest flow on an edge is the largest matrix entry routed over it."""
    cluster = ClusterConfig(gpus_per_node=2, nodes_per_microcluster=1, microclusters=2)
    timer, _ = models(cluster, profile())
    members = (0, 1, 2, 3)
    ops = [skewed(members, 1 * GB, 2), all_to_all(members, 0.25 * GB),
           CollectiveOp("all_to_all_v", members, "dispatch", matrix=np.zeros((4, 4)))]
    loads, largest = timer.all_to_all_loads(members, ops)
    for op, load, big in zip(ops, loads, largest):
        (alone,) = timer.stage_loads(op)
        assert load.fixed_s == pytest.approx(alone.fixed_s, rel=1e-12)
        assert load.edges.tolist() == alone.edges.tolist()
        assert load.nbytes == pytest.approx(alone.nbytes, rel=1e-12)
        assert load.messages.tolist() == alone.messages.tolist()
        assert len(big) == len(load.edges)
    m = ops[0].matrix  # GPU 0 sends 1 GB to GPU 1 (its node: NVLink), 3 GB to 2, 1 GB to 3
    uplink = list(loads[0].edges).index(timer.fabric.paths(np.array([0]), np.array([2])).edges[0])
    assert loads[0].nbytes[uplink] == m[0, 2] + m[0, 3] == 4 * GB  # GPU 0's way out of its node
    assert largest[0][uplink] == m[0, 2] == 3 * GB
    assert len(loads[2].edges) == 0 and loads[2].fixed_s == timer.model.call_latency
