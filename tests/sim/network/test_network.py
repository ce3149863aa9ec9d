"""The network model: max-min sharing against hand-worked cases, latency, statistics,
analytic mode, faults and speed."""

import time

import numpy as np
import pytest
import simpy

from sim.hardware.fabric import build_fabric
from sim.network.max_min import max_min_rates, water_fill
from sim.network.network import Network
from testbed.core.errors import RunError
from testbed.scenario.profile import load_profile, profile_from_dict
from testbed.scenario.sections import ClusterConfig

GB = 1e9


def profile(nvlink=100.0, nic=10.0, spine=10.0, pcie=20.0, latency_us=0.0):
    d = load_profile("h200").to_dict()
    for name, bw in (("nvlink", nvlink), ("nic", nic), ("spine", spine), ("pcie", pcie)):
        d["links"][name] = {"bandwidth_GBps": bw, "latency_us": latency_us}
    return profile_from_dict(d, "test")


def net(gpn=2, npm=2, mcs=1, mode="flow", oversub=1.0, **links):
    c = ClusterConfig(gpus_per_node=gpn, nodes_per_microcluster=npm, microclusters=mcs,
                      leaf_spine_oversubscription=oversub)
    env = simpy.Environment()
    return env, Network(env, build_fabric(c, profile(**links)), mode)


def finish_times(env, events):
    times = {}
    for k, ev in events.items():
        ev.callbacks.append(lambda _, k=k: times.__setitem__(k, env.now))
    env.run()
    return times


# ---- the max-min solver ------------------------------------------------------------------
def reference_max_min(flows, capacity):
    """Textbook progressive filling: all unfrozen flows rise together; the link that fills
    first freezes its flows at that level; one link at a time."""
    rate = np.zeros(len(flows))
    frozen = np.zeros(len(flows), dtype=bool)
    while not frozen.all():
        share = np.full(len(capacity), np.inf)
        for k in range(len(capacity)):
            on = [i for i, f in enumerate(flows) if k in f]
            unfrozen = [i for i in on if not frozen[i]]
            if unfrozen:
                share[k] = (capacity[k] - rate[[i for i in on if frozen[i]]].sum()) / len(unfrozen)
        k = int(np.argmin(share))
        for i, f in enumerate(flows):
            if k in f and not frozen[i]:
                rate[i], frozen[i] = share[k], True
    return rate


def csr(flows):
    indptr = np.concatenate([[0], np.cumsum([len(f) for f in flows])])
    return indptr, np.concatenate([np.array(f) for f in flows])


def test_three_flows_two_links_by_hand():
    # link 0 (10) carries flows a, b; link 1 (4) carries a, c:
    # link 1 fills first at 4/2 = 2 for a and c; b takes the 8 left on link 0
    rates = max_min_rates(*csr([[0, 1], [0], [1]]), np.array([10.0, 4.0]))
    np.testing.assert_allclose(rates, [2, 8, 2])


@pytest.mark.parametrize("seed", range(5))
def test_max_min_matches_textbook_progressive_filling(seed):
    rng = np.random.default_rng(seed)
    links = 12
    flows = [sorted(rng.choice(links, size=rng.integers(1, 4), replace=False).tolist()) for _ in range(40)]
    capacity = rng.uniform(1, 10, links)
    np.testing.assert_allclose(max_min_rates(*csr(flows), capacity), reference_max_min(flows, capacity), rtol=1e-9)


# ---- sharing in time -----------------------------------------------------------------------
def test_single_flow_time_is_bytes_over_bandwidth_plus_latency():
    env, n = net(latency_us=2.0)
    ev = n.transfer(0, 2, 5 * GB)  # gpu0 -> leaf -> gpu2: two NIC links of 10 GB/s
    env.run(ev)
    assert env.now == pytest.approx(0.5 + 4e-6)
    env, n = net(latency_us=2.0)
    env.run(n.transfer(0, 2, 5 * GB, path_latency=False))
    assert env.now == pytest.approx(0.5)


def test_two_flows_sharing_a_link_take_twice_as_long():
    env, n = net()
    t = finish_times(env, {"a": n.transfer(0, 2, 10 * GB), "b": n.transfer(0, 3, 10 * GB)})
    assert t == pytest.approx({"a": 2.0, "b": 2.0})  # both leave through gpu0's NIC


def test_a_flow_over_two_links_runs_at_the_slower():
    # one GPU per micro-cluster: the leaf uplink carries 1 x 4 GB/s, the NICs 10 GB/s
    env, n = net(gpn=1, npm=1, mcs=2, spine=4.0)
    env.run(n.transfer(0, 1, 8 * GB))
    assert env.now == pytest.approx(2.0)


def test_three_flows_on_two_links_in_time():
    # GPUs 0, 1 on leaf 0 and 2, 3 on leaf 1; uplink = 2 GPUs x 2 GB/s = 4 GB/s
    env, n = net(gpn=1, npm=2, mcs=2, spine=2.0)
    t = finish_times(env, {
        "f1": n.transfer(0, 2, 4 * GB),   # gpu0 NIC + uplink: 2 GB/s
        "f2": n.transfer(0, 1, 24 * GB),  # gpu0 NIC only: 8 GB/s, then 10 when f1 ends
        "f3": n.transfer(1, 3, 4 * GB),   # uplink: 2 GB/s
    })
    # f1, f3 end at 2 s; f2 has 24 - 16 = 8 GB left and runs alone at 10 GB/s: 2.8 s
    assert t == pytest.approx({"f1": 2.0, "f3": 2.0, "f2": 2.8})


def test_a_flow_that_starts_later_shares_from_then_on():
    env, n = net()
    times = {}

    def late():
        yield env.timeout(0.5)
        yield n.transfer(0, 3, 2.5 * GB)
        times["b"] = env.now

    a = n.transfer(0, 2, 10 * GB)
    a.callbacks.append(lambda _: times.__setitem__("a", env.now))
    env.process(late())
    env.run()
    # a alone for 0.5 s (5 GB), then 5 GB/s each: b done at 1.0 (a has 2.5 left), a at 1.25
    assert times == pytest.approx({"b": 1.0, "a": 1.25})


def test_empty_groups_fire_at_once_and_local_flows_move_nothing():
    env, n = net()
    assert n.start_flows([], [], []).triggered
    assert n.start_flows([1, 2], [1, 2], [5.0, 5.0]).triggered  # to itself
    assert n.start_flows([0], [1], [0]).triggered
    assert n.bytes_by_edge.sum() == 0


def test_pcie_copies_use_the_gpu_link_to_host():
    env, n = net(pcie=20.0)
    up = n.start_flows([3], [3], [10 * GB], kind="h2d")
    down = n.start_flows([3], [3], [10 * GB], kind="d2h")  # the other direction: no sharing
    t = finish_times(env, {"up": up, "down": down})
    assert t == pytest.approx({"up": 0.5, "down": 0.5})
    assert n.bytes_by_level()["pcie"] == pytest.approx(20 * GB)


# ---- statistics ------------------------------------------------------------------------------
def test_statistics_per_edge_level_and_tag():
    env, n = net()
    n.start_flows([0, 0], [2, 1], [10 * GB, 50 * GB], tag="dispatch")
    env.run()
    f = n.fabric
    nic_up0 = f.edge_index(("gpu", 0), ("leaf", 0))
    nv_up0 = f.edge_index(("gpu", 0), ("nvswitch", 0))
    assert n.bytes_by_edge[nic_up0] == pytest.approx(10 * GB)
    assert n.bytes_by_edge[nv_up0] == pytest.approx(50 * GB)
    assert n.busy_by_edge[nic_up0] == pytest.approx(1.0) and n.busy_by_edge[nv_up0] == pytest.approx(0.5)
    assert n.bytes_by_tag == {"dispatch": pytest.approx(60 * GB)}
    assert n.bytes_by_level() == pytest.approx({"nvlink": 100 * GB, "leaf": 20 * GB, "spine": 0, "pcie": 0})
    util = n.utilization_by_level(env.now)  # 4 GPUs: 8 NVLink edges of 100 GB/s over 1 s
    assert util["nvlink"] == pytest.approx(100 / 800) and util["leaf"] == pytest.approx(20 / 80)
    assert n.utilization_by_level(env.now, active_only=True)["leaf"] == pytest.approx(1.0)
    hot = n.hottest_links(2, elapsed=env.now)
    assert [h["name"] for h in hot] == ["gpu0->leaf0", "leaf0->gpu2"]
    assert hot[0]["utilization"] == pytest.approx(1.0)


# ---- analytic mode ---------------------------------------------------------------------------
def uniform_all_to_all(n, ranks, nbytes):
    r = np.arange(ranks)
    src, dst = np.repeat(r, ranks), np.tile(r, ranks)
    return n.start_flows(src, dst, nbytes)


def test_analytic_and_flow_agree_on_a_uniform_all_to_all_of_16_gpus():
    h200 = load_profile("h200")
    c = ClusterConfig(gpus_per_node=8, nodes_per_microcluster=2, microclusters=1)
    times = {}
    for mode in ("flow", "analytic"):
        env = simpy.Environment()
        n = Network(env, build_fabric(c, h200), mode)
        env.run(uniform_all_to_all(n, 16, 4e6))
        times[mode] = env.now
    assert times["analytic"] == pytest.approx(times["flow"], rel=0.05)
    assert times["flow"] == pytest.approx(8 * 4e6 / 48e9 + 3e-6, rel=1e-6)  # 8 peers per NIC


def test_analytic_groups_do_not_interact():
    env, n = net(mode="analytic")
    t = finish_times(env, {"a": n.transfer(0, 2, 10 * GB), "b": n.transfer(0, 3, 10 * GB)})
    assert t == pytest.approx({"a": 1.0, "b": 1.0})


# ---- faults ------------------------------------------------------------------------------------
def test_a_degraded_link_slows_its_flows():
    env, n = net()
    n.fabric.set_capacity("leaf", 0.5)
    env.run(n.transfer(0, 2, 10 * GB))
    assert env.now == pytest.approx(2.0)


def test_degrading_mid_run_reshares_on_refresh():
    env, n = net()
    done = n.transfer(0, 2, 10 * GB)

    def fault():
        yield env.timeout(0.5)
        n.fabric.set_capacity((("gpu", 0), ("leaf", 0)), 0.25)
        n.refresh()

    env.process(fault())
    env.run(done)
    assert env.now == pytest.approx(0.5 + 5 / 2.5)


def test_a_link_that_is_down_raises():
    env, n = net()
    n.fabric.set_capacity((("gpu", 0), ("leaf", 0)), 0.0)
    with pytest.raises(RunError, match="gpu0->leaf0 is down"):
        n.transfer(0, 2, GB)
    n.transfer(0, 1, GB)  # NVLink still works


# ---- events, determinism and speed ---------------------------------------------------------------
def test_coalescing_trades_events_for_a_bounded_error():
    h200 = load_profile("h200")
    c = ClusterConfig(gpus_per_node=8, nodes_per_microcluster=2, microclusters=1)
    sizes = np.random.default_rng(0).integers(1, 4_000_000, 256).astype(float)
    result = {}
    for coalesce in (0.0, 0.01):
        env = simpy.Environment()
        n = Network(env, build_fabric(c, h200), "flow", coalesce=coalesce)
        env.run(uniform_all_to_all(n, 16, sizes))
        result[coalesce] = (env.now, n.recomputations)
    assert result[0.01][0] == pytest.approx(result[0.0][0], rel=0.02)
    assert result[0.01][1] < result[0.0][1]
    assert n.bytes_by_edge.sum() == pytest.approx(sum(sizes[np.repeat(np.arange(16), 16) != np.tile(np.arange(16), 16)]) * 2)


def test_same_inputs_same_times():
    runs = []
    for _ in range(2):
        env, n = net(gpn=4, npm=2, mcs=2)
        sizes = np.arange(1, 257, dtype=float) * 1e6
        env.run(uniform_all_to_all(n, 16, sizes))
        runs.append((env.now, n.bytes_by_edge.copy(), n.recomputations))
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_64_gpu_all_to_all_in_flow_mode_is_fast():
    c = ClusterConfig(gpus_per_node=8, nodes_per_microcluster=8, microclusters=1)
    env = simpy.Environment()
    n = Network(env, build_fabric(c, load_profile("h200")), "flow")
    start = time.perf_counter()
    env.run(uniform_all_to_all(n, 64, 1e6))  # 4,032 flows
    elapsed = time.perf_counter() - start
    assert n.active_flows == 0
    assert env.now == pytest.approx(56e6 / 48e9 + 3e-6, rel=1e-6)  # 56 remote peers per NIC
    assert elapsed < 0.5, f"64-GPU all-to-all took {elapsed:.3f} s of wall time"


def test_wire_bytes_add_headers_acknowledgements_and_a_cost_per_message():
    """A ring all-reduce of 2 ranks across two NICs: payload / payload_fraction forward,
    ack_fraction back, and message_bytes for each of gloo's 4(p-1) messages per hop on
    every link it crosses."""
    import dataclasses

    from sim.network.collective_model import seconds_alone
    from testbed.policy.collectives import CollectiveOp
    from testbed.scenario.profile import Protocol, load_profile
    from testbed.scenario.scenario import Scenario

    s = Scenario.from_dict({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
                            "parallelism": {"ep_size": 1}})
    p = dataclasses.replace(load_profile("emulated"), protocol=Protocol(0.9, 0.01, 300.0))
    _, wire = seconds_alone(s, p, CollectiveOp("all_reduce", (0, 2), "expert_sync", size=10_000))
    payload = 2 * 10_000  # each of the 2 flows carries 2(p-1)/p x size = size, over 2 NIC links
    assert wire["leaf"] == round(2 * payload * (1 / 0.9 + 0.01) + 2 * 2 * 4 * 300)
    assert wire["nvlink"] == 0 and wire["spine"] == 0


# ---- incremental sharing: components and warm starts --------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_a_warm_start_after_flows_end_gives_the_rates_of_a_solve_anew(seed):
    """Flows that progressive filling froze below the lowest rate of the flows that ended
    keep their rates; filling only the others gives the same max-min rates (ties too)."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        links, n = int(rng.integers(5, 20)), int(rng.integers(2, 60))
        hops = rng.integers(1, 5, n)
        e = np.concatenate([rng.choice(links, h, replace=False) for h in hops])
        capacity = np.round(rng.uniform(1, 10, links)) if rng.random() < 0.5 else rng.uniform(1, 10, links)
        rate = water_fill(hops, e, capacity)
        gone = rng.random(n) < rng.uniform(0.05, 0.5)
        if gone.all() or not gone.any():
            continue
        keep = ~gone
        left_e = e[np.repeat(keep, hops)]
        free = rate[keep] >= rate[gone].min() * (1 - 1e-9)
        warm = water_fill(hops[keep], left_e, capacity, rate[keep], free)
        np.testing.assert_allclose(warm, water_fill(hops[keep], left_e, capacity), rtol=1e-12)


def reference_finish_times(fabric, flows):
    """Finish time of each flow (start s, src, dst, bytes), by re-solving every active
    flow from scratch at every start and finish (no components, no warm start)."""
    order = sorted(range(len(flows)), key=lambda i: flows[i][0])
    now, active, out = 0.0, {}, {}
    while order or active:
        ids = list(active)
        nxt_start = flows[order[0]][0] if order else np.inf
        if ids:
            routes = [fabric.path(flows[i][1], flows[i][2]) for i in ids]
            indptr = np.concatenate([[0], np.cumsum([len(r) for r in routes])])
            rate = max_min_rates(indptr, np.concatenate(routes), fabric.capacity)
            left = np.array([active[i] for i in ids]) / rate
            dt = min(left.min(), nxt_start - now)
        else:
            dt = nxt_start - now
        for k, i in enumerate(ids):
            active[i] -= rate[k] * dt
        now += dt
        for k, i in enumerate(ids):
            if left[k] <= dt * (1 + 1e-12):
                out[i] = now
                del active[i]
        while order and flows[order[0]][0] <= now:
            i = order.pop(0)
            active[i] = flows[i][3]
    return [out[i] for i in range(len(flows))]


@pytest.mark.parametrize("seed", range(4))
def test_incremental_sharing_matches_re_solving_everything(seed):
    """Random flows starting at random times over NVLink, leaf and spine links: flows
    merge into components and leave them; with exact events the finish times are those
    of solving every flow anew at every change."""
    rng = np.random.default_rng(seed)
    env, n = net(gpn=2, npm=2, mcs=2, spine=5.0)
    n.coalesce = 0.0
    W = n.fabric.world
    flows = []
    for _ in range(30):
        src, dst = rng.choice(W, 2, replace=False)
        flows.append((float(rng.choice([0.0, rng.uniform(0, 2)])), int(src), int(dst), float(rng.uniform(1, 20)) * GB))
    got = {}

    def start(i, t, src, dst, nbytes):
        yield env.timeout(t)
        yield n.transfer(src, dst, nbytes, path_latency=False)
        got[i] = env.now

    for i, f in enumerate(flows):
        env.process(start(i, *f))
    env.run()
    expected = reference_finish_times(n.fabric, flows)
    np.testing.assert_allclose([got[i] for i in range(len(flows))], expected, rtol=1e-9)
    assert n.active_flows == 0 and not n._comps
    assert n.bytes_by_edge.sum() == pytest.approx(sum(f[3] * len(n.fabric.path(f[1], f[2])) for f in flows))


def test_flows_on_disjoint_links_are_shared_apart():
    """Two NVLink transfers in different nodes share no link: each is its own component,
    re-shared only at its own start and finish."""
    env, n = net(gpn=2, npm=2, mcs=1)
    a, b = n.transfer(0, 1, 10 * GB), n.transfer(2, 3, 30 * GB)  # 100 GB/s NVLink each
    assert len(n._comps) == 2
    t = finish_times(env, {"a": a, "b": b})
    assert t == pytest.approx({"a": 0.1, "b": 0.3})
    assert n.recomputations == 2  # one share each at the start; nothing left to share after
    assert not n._comps and (n._edge_comp == -1).all()


def test_a_flow_across_two_components_merges_them():
    env, n = net(gpn=2, npm=2, mcs=1)
    n.transfer(0, 2, 10 * GB)  # gpu0 NIC up, gpu2 NIC down
    n.transfer(1, 3, 10 * GB)  # gpu1 NIC up, gpu3 NIC down
    assert len(n._comps) == 2
    n.transfer(0, 3, 10 * GB)  # shares gpu0's uplink with the first, gpu3's downlink with the second
    assert len(n._comps) == 1 and n.active_flows == 3
    env.run()
    # gpu0's uplink and gpu3's downlink each carry two flows: 5 GB/s for all three
    assert env.now == pytest.approx(2.0)
