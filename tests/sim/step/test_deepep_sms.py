"""deepep's kernels hold comm.deepep_sms of the GPU's compute.sm_count SMs while they run:
compute beside them (micro-batched experts, M22) runs at 1 - f of its speed, f their
share: t seconds of it beside c seconds of them take t + min(t f / (1 - f), f c)."""

import numpy as np
import pytest

from sim.backend import ClusterSim, routing_source
from testbed.core.errors import ScenarioError
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario


def scenario(sms, hidden, ffn, micro_batches=2, profile="h200"):
    return Scenario.from_dict({
        "model": {"hidden_size": hidden, "ffn_hidden_size": ffn, "num_experts": 8, "num_layers": 1, "dtype": "bf16"},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1, "profile": profile},
        "parallelism": {"ep_size": 4},
        "comm": {"token_strategy": "deepep", "deepep_sms": sms},
        "overlap": {"micro_batches": micro_batches},
        "workload": {"tokens_per_rank": 2048},
        "pager": {"enabled": False},
        "run": {"steps": 1, "warmup_steps": 0},
    })


def simulate(s):
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    _, phases, _, fig, *_ = sim.step(0, routing_source(s)(0), [])
    return sim, phases, fig


def experts(phases):
    return [i for i, p in enumerate(phases) if p.stage in ("experts", "experts_backward") and p.kind == "compute"]


def alone_s(sim, phase) -> np.ndarray:
    """[W] seconds of a comm phase's ops, each alone on the fabric, on each member."""
    out = np.zeros(sim.layout.world)
    for op in phase.ops:
        t = sum(sim.timer.stage_seconds(load) for load in sim.timer.stage_loads(op))
        out[list(op.members)] = np.maximum(out[list(op.members)], t)
    return out


def test_experts_beside_a_longer_exchange_run_on_the_sms_left():
    """A wide, thin expert (H 4096, F 128) finishes inside the micro-batch's exchange: it
    takes 132 / (132 - 20) times as long on the H200's 132 SMs."""
    _, free, _ = simulate(scenario(0, 4096, 128))
    _, held, _ = simulate(scenario(20, 4096, 128))
    for i in experts(free):
        np.testing.assert_allclose(held[i].seconds, free[i].seconds * 132 / 112, rtol=1e-12)


def test_experts_longer_than_the_exchange_lose_its_share_of_its_time():
    """Each micro-batch's experts: t + min(t f / (1 - f), f c), c the seconds of the ops
    beside them alone on the fabric: micro-batch 0's beside micro-batch 1's dispatch
    (its fanout all-gather, then its hops), 1's beside 0's combine."""
    sim, free, _ = simulate(scenario(0, 1024, 4096))
    _, held, _ = simulate(scenario(20, 1024, 4096))
    f = 20 / 132
    long_enough = 0
    for x_stage, b_stage, a_stage in (("experts", "dispatch", "combine"),
                                      ("experts_backward", "combine_backward", "dispatch_backward")):
        b = [p for p in free if p.stage == b_stage]
        a = [p for p in free if p.stage == a_stage]
        beside = [b[len(b) // 2:], a[:len(a) // 2]]  # micro-batch 1's dispatch, 0's combine
        for j, i in enumerate(i for i in experts(free) if free[i].stage == x_stage):
            c = sum(alone_s(sim, p) for p in beside[j])
            t = free[i].seconds
            np.testing.assert_allclose(held[i].seconds, t + np.minimum(t * f / (1 - f), f * c), rtol=1e-12)
            long_enough += int((t * f / (1 - f) > f * c).all())
    assert long_enough > 0  # the f c branch was taken


def test_without_micro_batches_or_sms_nothing_is_slowed():
    for s_free, s_held in ((scenario(0, 1024, 4096, micro_batches=1), scenario(20, 1024, 4096, micro_batches=1)),
                           (scenario(0, 64, 128, profile="local-cpu"), scenario(20, 64, 128, profile="local-cpu"))):
        _, free, fig_free = simulate(s_free)
        _, held, fig_held = simulate(s_held)
        for i in experts(free):
            np.testing.assert_array_equal(held[i].seconds, free[i].seconds)
        assert fig_held.step_time_s == fig_free.step_time_s


def test_sms_that_leave_none_for_compute_are_refused():
    with pytest.raises(ScenarioError) as e:
        simulate(scenario(132, 1024, 4096))
    assert e.value.field == "comm.deepep_sms" and "132" in e.value.reason
