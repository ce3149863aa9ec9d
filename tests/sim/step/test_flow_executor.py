"""The flow-mode executor without a process per GPU stream (sim.step.flow_executor) against the
process-per-stream one (sim.step.schedule.run_flows) on the same phases: skewed routing across
nodes and micro-clusters, micro-batch overlap, sync overlapped with the backward, page
copies, a degraded link. With exact event times (coalesce=0) both give the same times to
float rounding; with the default coalescing within its 1% bound."""

import numpy as np
import pytest

from sim.backend import ClusterSim, decide_step, routing_source
from sim.hardware.cores import CorePool
from sim.network.network import COALESCE
from sim.step import flow_executor, schedule
from sim.step.phases import Phase
from testbed.policy.collectives import CollectiveOp
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

CLUSTER = {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 2, "profile": "h200"}
SCENARIOS = {
    "skewed": {},
    "micro_batches": {"overlap": {"micro_batches": 2}},
    "sync_with_backward": {"overlap": {"sync_with_backward": True}, "comm": {"expert_sync": "allreduce"}},
    # many single-op sync phases in a row, each also waiting for its layer's backward
    "sync_with_backward_two_stage": {"overlap": {"sync_with_backward": True}},
    "paging": {"pager": {"enabled": True, "page_size_bytes": "2MiB", "gpu_budget_bytes": "8MiB"}},
    "degraded_spine": {"faults": [{"at_step": 1, "kind": "link_degraded", "target": "spine", "factor": 0.25}]},
}


def scenario(**sections) -> Scenario:
    data = {"cluster": dict(CLUSTER), "parallelism": {"ep_size": 8},
            "model": {"hidden_size": 1024, "ffn_hidden_size": 1024, "num_layers": 2, "num_experts": 16,
                      "dtype": "bf16"},
            "workload": {"tokens_per_rank": 2048, "skew": 1.5},
            "pager": {"enabled": False}, "comm": {"expert_sync": "two_stage"},
            "run": {"steps": 2, "warmup_steps": 0}}
    for k, v in sections.items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            data[k] = v
    return Scenario.from_dict(data)


def simulate(s: Scenario, run_flows, coalesce: float = COALESCE, steps: int = 2):
    """Per step: (timeline, phases, the network's bytes, busy seconds and messages per edge
    and bytes per tag so far, the clock after it)."""
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    sim.network.coalesce = coalesce
    routed_at = routing_source(s)
    out = []
    for step in range(steps):
        sim.faults.apply(step, [])
        sim.network.refresh()
        phases = sim.builder.build(decide_step(sim.controller, step, np.asarray(routed_at(step))))
        tl = run_flows(phases, sim.layout.world, sim.collectives, sim.env.now, sim.copy_latency, sim.cores)
        net = sim.network
        out.append((tl, phases, net.bytes_by_edge.copy(), net.busy_by_edge.copy(), net.messages_by_edge.copy(),
                    dict(net.bytes_by_tag), sim.env.now))
    return out


def op_times(tl, phases) -> np.ndarray:
    """[ops, 2] start and end of each op (s), in the order the phases list them."""
    times = {id(op): (began, ended) for op, began, ended in tl.ops}
    return np.array([times[id(op)] for ph in phases if ph.kind == "ops" for op in ph.ops])


def compare(s: Scenario, coalesce: float, rtol: float, steps: int = 2):
    """Largest relative difference of step time, after checking every phase and op time
    (within ``rtol`` of the step time), the clock and the network statistics. Step 0,
    which mostly waits for communicators to be created, is left out of the check of
    coalesced times (its 0.5 s would hide any difference)."""
    old = simulate(s, schedule.run_flows, coalesce, steps + 1)
    new = simulate(s, flow_executor.run_flows, coalesce, steps + 1)
    worst = 0.0
    first = 0 if coalesce == 0 else 1
    for (a, phases, ba, ua, ma, ta, na), (b, phases_b, bb, ub, mb, tb, nb) in zip(old[first:], new[first:]):
        step = a.end.max() - a.t0
        assert b.t0 == pytest.approx(a.t0, rel=max(rtol, 1e-12))
        worst = max(worst, abs((b.end.max() - b.t0) - step) / step)
        np.testing.assert_allclose(b.start, a.start, rtol=0, atol=rtol * step)
        np.testing.assert_allclose(b.end, a.end, rtol=0, atol=rtol * step)
        np.testing.assert_array_equal(b.fitted, a.fitted)
        assert nb == pytest.approx(na, rel=rtol)  # the clock ends at the step's last end
        assert nb == pytest.approx(b.end.max(), rel=1e-12)
        assert len(b.ops) == len(a.ops) == sum(len(ph.ops) for ph in phases if ph.kind == "ops")
        np.testing.assert_allclose(op_times(b, phases_b), op_times(a, phases), rtol=0, atol=rtol * step)
        np.testing.assert_allclose(bb, ba, rtol=1e-9, atol=1e-6)
        np.testing.assert_array_equal(mb, ma)
        assert tb == pytest.approx(ta, rel=1e-12)
        np.testing.assert_allclose(ub, ua, rtol=0, atol=max(rtol, 1e-9) * na)
    return worst


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_times_as_the_process_per_stream_executor(name):
    worst = compare(scenario(**SCENARIOS[name]), coalesce=0.0, rtol=1e-9)
    assert worst < 1e-9


@pytest.mark.parametrize("name", ["skewed", "micro_batches", "sync_with_backward_two_stage", "paging"])
def test_within_the_coalescing_bound_with_the_default_coalescing(name):
    assert compare(scenario(**SCENARIOS[name]), coalesce=COALESCE, rtol=COALESCE) < COALESCE


def test_the_scenarios_exercise_what_they_name():
    s = scenario(**SCENARIOS["paging"])
    (_, phases, *_), = simulate(s, flow_executor.run_flows, steps=1)
    copies = [ph for ph in phases if ph.kind == "copy" and ph.pages.any()]
    assert copies and any(ph.stream == "copy" for ph in copies)  # h200: copies overlap the dispatch
    (_, phases, *_), = simulate(scenario(**SCENARIOS["sync_with_backward"]), flow_executor.run_flows, steps=1)
    assert any(ph.stream == "sync" and ph.kind == "ops" for ph in phases)
    (_, phases, *_), = simulate(scenario(**SCENARIOS["skewed"]), flow_executor.run_flows, steps=1)
    a2a = [op for ph in phases if ph.kind == "ops" for op in ph.ops if op.kind == "all_to_all_v"]
    sizes = np.concatenate([op.matrix.sum(axis=0) for op in a2a])
    assert sizes.max() > 1.5 * sizes.mean()  # skewed: the ranks of hot experts receive far more


def test_cpu_ranks_sharing_cores_run_on_the_process_per_stream_executor():
    s = scenario(cluster={"profile": "local-cpu"})
    steps = {}
    for name, fn in (("old", schedule.run_flows), ("new", flow_executor.run_flows)):
        sim = ClusterSim(s, load_profile("local-cpu"))
        cores = CorePool(sim.env, 2)
        phases = sim.builder.build(decide_step(sim.controller, 0, np.asarray(routing_source(s)(0))))
        steps[name] = fn(phases, sim.layout.world, sim.collectives, sim.env.now, sim.copy_latency, cores).end
    np.testing.assert_array_equal(steps["new"], steps["old"])


def test_ranks_that_disagree_on_the_ops_raise():
    sim = ClusterSim(scenario(), load_profile("h200"))
    W = sim.layout.world
    phases = [Phase("route", 0, "compute", "compute", (), seconds=np.full(W, 1e-3)),
              Phase("route", 0, "ops", "comm", (0,), ops=[CollectiveOp("all_gather", (0, 1), "route", size=8)]),
              # a member outside the world never arrives
              Phase("route", 0, "ops", "comm", (1,), ops=[CollectiveOp("all_gather", (1, W), "route", size=8)])]
    with pytest.raises(RuntimeError, match="1 collectives never started"):
        flow_executor.run_flows(phases, W, sim.collectives, sim.env.now, sim.copy_latency)


def test_a_step_of_compute_only_ends_at_its_last_kernel():
    env_sim = ClusterSim(scenario(), load_profile("h200"))
    W = env_sim.layout.world
    phases = [Phase("experts", 0, "compute", "compute", (), seconds=np.linspace(1.0, 2.0, W)),
              Phase("paging", 0, "copy", "copy", (), h2d=np.full(W, 1e9), d2h=np.zeros(W), pages=np.ones(W, int))]
    tl = flow_executor.run_flows(phases, W, env_sim.collectives, env_sim.env.now, 1e-6)
    assert env_sim.env.now == pytest.approx(2.0)
    bw = env_sim.fabric.capacity[env_sim.fabric.offset["h2d"]]
    np.testing.assert_allclose(tl.end[1], 1e9 / bw + 1e-6)
    assert env_sim.network.bytes_by_tag["paging"] == pytest.approx(W * 1e9)


def test_hand_made_phases_with_overlapping_ops_and_streams():
    """A rank in two ops of one phase, a comm stream that runs ahead of compute, a copy
    beside them and a run of single-op phases most ranks pass at once: the same times as
    the process-per-stream executor."""

    def phases(W):
        rng = np.random.default_rng(3)
        ops = lambda *groups: [CollectiveOp("all_reduce", g, "expert_sync", size=int(rng.integers(1, 64)) * 2**20)
                               for g in groups]
        ph = [Phase("experts", 0, "compute", "compute", (), seconds=rng.uniform(0, 1e-3, W)),
              Phase("expert_sync", 0, "ops", "comm", (0,), ops=ops((0, 1, 4), (0, 2), (3, 5, 6, 7))),
              Phase("paging", 0, "copy", "copy", (0,), h2d=rng.uniform(0, 1e8, W), d2h=rng.uniform(0, 1e8, W),
                    pages=np.arange(W) % 3),
              Phase("experts", 0, "compute", "compute", (1,), seconds=rng.uniform(0, 1e-3, W))]
        for g in [(0, 8), (1, 9), (2, 10), (0, 15), (3, 11, 12), (4, 13)]:  # a sync chain
            ph.append(Phase("expert_sync", 0, "ops", "comm", (len(ph) - 1,), ops=ops(g)))
        ph.append(Phase("optimizer", -1, "compute", "compute", (len(ph) - 1, 2, 3), seconds=np.full(W, 1e-4)))
        return ph

    times = {}
    for name, fn in (("old", schedule.run_flows), ("new", flow_executor.run_flows)):
        sim = ClusterSim(scenario(), load_profile("h200"))
        sim.network.coalesce = 0.0
        W = sim.layout.world
        tl = fn(phases(W), W, sim.collectives, sim.env.now, 2e-6)
        times[name] = (tl.start, tl.end, sorted((s, e) for _, s, e in tl.ops))
    for a, b in zip(times["old"], times["new"]):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-15)
