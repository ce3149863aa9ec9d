"""The heat map (M18), score and states (M19) and wake-up probes (M20)."""

import numpy as np
import pytest

from testbed.policy.heat import COLD, HOT, STATE_NAMES, WARM, HeatMap, below
from testbed.scenario.sections import HeatConfig


def heatmap(n, seed=0, **cfg):
    return HeatMap(n, HeatConfig(**cfg), np.random.default_rng(seed))


def test_state_codes():
    assert (HOT, WARM, COLD) == (0, 1, 2)
    assert STATE_NAMES[COLD] == "cold"


def test_score_normalises_each_metric_by_its_max_then_weights():
    h = heatmap(4, alpha=0.5, beta=0.3, gamma=0.2, update_interval=1)
    h.record(compute=[4, 2, 0, 1], memory=[0, 10, 5, 0], comm=[1, 1, 1, 0])
    u = h.update(0)
    # c = [1, .5, 0, .25], m = [0, 1, .5, 0], k = [1, 1, 1, 0]
    np.testing.assert_allclose(u.scores, [0.7, 0.75, 0.35, 0.125])
    assert u.scores.dtype == np.float64


def test_weights_are_not_renormalised_and_sums_cover_the_window():
    h = heatmap(4, alpha=1.0, beta=1.0, gamma=1.0, update_interval=2)
    h.record([1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 2, 0])
    h.record([1, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0])
    u = h.update(1)
    # compute sums [2, 2, 0, 0] -> [1, 1, 0, 0]; memory all 0 -> 0; comm [0, 0, 2, 0] -> [0, 0, 1, 0]
    np.testing.assert_allclose(u.scores, [1.0, 1.0, 1.0, 0.0])
    assert u.window_steps == 2


def test_percentile_levels_and_states():
    h = heatmap(10, alpha=1.0, beta=0.0, gamma=0.0, hot_percentile=90, cold_percentile=30)
    h.record(np.arange(10), np.zeros(10), np.zeros(10))
    u = h.update(9)
    assert u.hot_level == pytest.approx(8.1 / 9)
    assert u.cold_level == pytest.approx(2.7 / 9)
    assert u.states.dtype == np.int8
    np.testing.assert_array_equal(u.states, [COLD] * 3 + [WARM] * 6 + [HOT])
    np.testing.assert_array_equal(h.states, u.states)


def test_zero_heat_experts_are_cold_even_at_level_zero():
    h = heatmap(10, alpha=1.0, beta=0.0, gamma=0.0)
    h.record([0, 0, 0, 0, 0, 1, 2, 3, 4, 5], np.zeros(10), np.zeros(10))
    u = h.update(9)
    assert u.cold_level == 0.0
    np.testing.assert_array_equal(u.states[:5], [COLD] * 5)
    assert not np.any(u.states[5:] == COLD)
    np.testing.assert_array_equal(u.zero_window, [True] * 5 + [False] * 5)


def test_below():
    np.testing.assert_array_equal(below(np.array([0.0, 0.1, 0.2, 0.3]), 0.2), [True, True, False, False])
    np.testing.assert_array_equal(below(np.array([0.0, 0.1]), 0.0), [True, False])


def test_all_warm_before_first_update_and_no_experts_rejected():
    h = heatmap(3)
    np.testing.assert_array_equal(h.states, [WARM] * 3)
    with pytest.raises(ValueError):
        heatmap(0)
    with pytest.raises(ValueError):
        h.record([1, 2], [0, 0, 0], [0, 0, 0])


def test_is_due_every_interval():
    h = heatmap(2, update_interval=10)
    assert [s for s in range(40) if h.is_due(s)] == [9, 19, 29, 39]


def test_window_drops_old_steps():
    h = heatmap(2, alpha=1.0, beta=0.0, gamma=0.0, window_steps=3, update_interval=1)
    h.record([100, 0], [0, 0], [0, 0])
    assert h.update(0).window_steps == 1
    for step in range(1, 4):
        h.record([0, 1], [0, 0], [0, 0])
    u = h.update(3)
    assert u.window_steps == 3
    np.testing.assert_array_equal(u.zero_window, [True, False])
    np.testing.assert_allclose(u.scores, [0.0, 1.0])


# ---- M20 wake-up ------------------------------------------------------------------------
ZEROS = [0.0] * 20


def slow_below(n):
    """A probe activation (M20) where experts below ``n`` take 50 ms to answer, the rest 1 ms."""
    return lambda idx: np.where(np.asarray(idx) < n, 0.050, 0.001)


def feed(h, positives, probe=slow_below(20)):
    """One step, one update: 20 silent experts then 80 with compute ``positives``."""
    h.record(ZEROS + list(positives), np.zeros(100), np.zeros(100))
    return h.update(h.window_steps, probe)


def wake_run(seed=0, fraction=0.5):
    """Experts 0..29 are Cold at every update; the cold level rises at the third."""
    h = heatmap(100, seed, alpha=1.0, beta=0.0, gamma=0.0, window_steps=1, update_interval=1,
                cold_percentile=30, hot_percentile=90, wake_fraction=fraction)
    low, high = np.linspace(1, 100, 80), np.linspace(50, 100, 80)
    return [feed(h, low), feed(h, low), feed(h, high)]


def test_wake_only_when_cold_level_rises():
    first, same, risen = wake_run()
    np.testing.assert_array_equal(np.flatnonzero(first.states == COLD), np.arange(30))
    assert not first.probed.any()  # nothing was Cold before
    assert same.cold_level == first.cold_level
    assert not same.probed.any()   # frozen, but the level did not rise
    assert risen.cold_level > same.cold_level
    assert risen.probed.sum() == 15  # 50% of the 30 frozen
    assert not risen.probed[30:].any()
    # Experts 20..29 answer their probe within the 10 ms timeout; 0..19 take 50 ms.
    probed = np.flatnonzero(risen.probed)
    np.testing.assert_array_equal(risen.response_s[probed], np.where(probed < 20, 0.050, 0.001))
    assert np.all(np.isinf(risen.response_s[~risen.probed]))
    assert 0 < risen.woken.sum() < risen.probed.sum()
    np.testing.assert_array_equal(np.flatnonzero(risen.woken), probed[probed >= 20])
    assert np.all(risen.states[risen.woken] == WARM)
    assert np.all(risen.states[risen.probed & ~risen.woken] == COLD)


def test_wake_is_deterministic_for_a_seed():
    a, b, c = wake_run(seed=7)[2], wake_run(seed=7)[2], wake_run(seed=8)[2]
    np.testing.assert_array_equal(a.probed, b.probed)
    assert not np.array_equal(a.probed, c.probed)


@pytest.mark.parametrize("fraction, probed", [(0.05, 2), (0.01, 1), (0.0, 0), (1.0, 30)])
def test_wake_probes_about_wake_fraction_at_least_one(fraction, probed):
    assert wake_run(fraction=fraction)[2].probed.sum() == probed


def test_wake_fraction_on_many_frozen_experts():
    n = 2000
    h = heatmap(n, 3, alpha=1.0, beta=0.0, gamma=0.0, window_steps=1, update_interval=1,
                wake_fraction=0.05)
    silent = np.zeros(500)
    updates = []
    for positives in (np.linspace(1, 100, 1500), np.linspace(1, 100, 1500), np.linspace(90, 100, 1500)):
        h.record(np.r_[silent, positives], np.zeros(n), np.zeros(n))
        updates.append(h.update(len(updates), slow_below(500)))
    frozen = (updates[1].states == COLD) & ((updates[2].states == COLD) | updates[2].woken)
    assert frozen.sum() == 600  # P30 of 2000 cuts at the 600th expert
    assert updates[2].probed.sum() == 30
    assert not (updates[2].probed & ~frozen).any()
    # Only the probed ones that answer in time respond.
    np.testing.assert_array_equal(updates[2].woken, updates[2].probed & (np.arange(n) >= 500))


@pytest.mark.parametrize("answer_ms, woken", [(10.0, True), (10.001, False), (0.0, True)])
def test_a_probe_responds_within_the_timeout(answer_ms, woken):
    """heat.probe_timeout_ms = 10: an answer in exactly 10 ms wakes the expert, later does not."""
    h = heatmap(100, 0, alpha=1.0, beta=0.0, gamma=0.0, window_steps=1, update_interval=1,
                cold_percentile=30, hot_percentile=90, wake_fraction=1.0, probe_timeout_ms=10.0)
    low, high = np.linspace(1, 100, 80), np.linspace(50, 100, 80)
    probe = lambda idx: np.full(len(idx), answer_ms * 1e-3)  # noqa: E731
    feed(h, low, probe), feed(h, low, probe)
    risen = feed(h, high, probe)
    assert risen.probed.sum() == 30 and risen.woken.sum() == (30 if woken else 0)
