"""The synthetic workload (M4), the routing trace and the group cache (M10)."""

import numpy as np
import pytest

from testbed.core.errors import ScenarioError
from testbed.policy.group_cache import GroupCache
from testbed.policy.workload import SyntheticWorkload
from testbed.run.routing_trace import RoutingTrace
from testbed.scenario.scenario import Scenario


def test_routed_counts_sum_to_slots_and_respect_one_slot_per_token():
    s = Scenario.from_dict({"workload": {"skew": 3.0, "tokens_per_rank": 64}})
    counts = SyntheticWorkload(s).routed_counts(0)
    assert counts.shape == (2, 8, 8)
    assert (counts.sum(-1) == 64 * 2).all() and (counts <= 64).all()


def test_skew_makes_a_hot_expert_about_three_times_the_mean():
    s = Scenario.from_dict({"workload": {"skew": 1.0, "locality": 0.0}})
    p = SyntheticWorkload(s).popularity(0)
    assert p.max() / p.mean() == pytest.approx(8 / sum(1 / k for k in range(1, 9)), rel=1e-6)  # ~2.94
    uniform = SyntheticWorkload(Scenario.from_dict({"workload": {"skew": 0.0}})).popularity(0)
    assert np.allclose(uniform, 1 / 8)


def test_locality_makes_ranks_differ_and_drift_moves_slowly():
    s = Scenario.from_dict({"workload": {"locality": 0.8, "drift": 0.05}})
    w = SyntheticWorkload(s)
    p0 = w.popularity(0)
    assert not np.allclose(p0[0, 0], p0[0, 1])
    p1, p30 = w.popularity(1), w.popularity(30)
    assert np.abs(p1 - p0).sum() < np.abs(p30 - p0).sum()
    assert np.array_equal(SyntheticWorkload(s).popularity(30), p30)  # any process, same numbers
    assert np.array_equal(w.popularity(1), p1)  # going back replays the drift


def test_workload_is_seeded():
    a = SyntheticWorkload(Scenario.from_dict({"workload": {"seed": 1}})).routed_counts(3)
    b = SyntheticWorkload(Scenario.from_dict({"workload": {"seed": 1}})).routed_counts(3)
    c = SyntheticWorkload(Scenario.from_dict({"workload": {"seed": 2}})).routed_counts(3)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_rankings_are_the_stream_of_one_permutation_per_row():
    """``Generator.permuted`` over rows gives what one ``permutation`` call per row gave, so
    a seed keeps its counts (a numpy that changed this would fail here first)."""
    s = Scenario.from_dict({"workload": {"seed": 3}, "model": {"num_experts": 8, "num_layers": 3}})
    w = SyntheticWorkload(s)
    rng = np.random.default_rng([3, 0x5EED])
    ranking = np.stack([rng.permutation(8) for _ in range(3)])
    pref = np.stack([np.stack([rng.permutation(8) for _ in range(s.world_size)]) for _ in range(3)])
    assert np.array_equal(w._ranking, ranking) and np.array_equal(w._rank_pref, pref)
    local_p = w._zipf[pref]
    assert np.array_equal(w.popularity(0), (1 - w.locality) * w._zipf[ranking][:, None, :] + w.locality * local_p)


def test_routing_trace_round_trip_and_fit(tmp_path):
    s = Scenario.from_dict({"run": {"steps": 2, "warmup_steps": 0}})
    routed = np.stack([SyntheticWorkload(s).routed_counts(i) for i in range(2)])
    RoutingTrace(routed, 256, 2).save(tmp_path)
    t = RoutingTrace.load(tmp_path)
    assert np.array_equal(t.routed, routed) and t.tokens_per_rank == 256
    t.check_fits(s, str(tmp_path))
    with pytest.raises(ScenarioError, match="the trace has 2 steps but run.steps = 5"):
        t.check_fits(s.replace(run={"steps": 5}), str(tmp_path))
    with pytest.raises(ScenarioError, match="no routing trace"):
        RoutingTrace.load(tmp_path / "elsewhere")


def test_group_cache_is_lru():
    c = GroupCache(2)
    ev = c.lookup([(0, 1), (0, 2), (0, 1)])
    assert (ev.hits, ev.misses, ev.created, ev.evicted) == (1, 2, [(0, 1), (0, 2)], [])
    ev = c.lookup([(1, 2)])  # evicts the least recently used: (0, 2)
    assert ev.evicted == [(0, 2)] and (0, 1) in c and (0, 2) not in c
    assert c.hit_rate == pytest.approx(1 / 4)
    with pytest.raises(ValueError):
        GroupCache(0)
