"""M18 off the critical path and M13's pending-work check (``heat.deferred``).

A due heat update is applied at the next step's first layer, after its access: its
experts are pinned then, so one that is cold for long enough but about to compute is not
migrated (M13's "no pending work"); its page moves run after that layer's own copies.
Without deferral the same run migrates at the step's end, where nothing is pinned.
Memory heat (M18) is what the pagers counted.
"""

from pathlib import Path

import numpy as np
import pytest

from sim.backend import SimBackend, decide_step, routing_source
from testbed.policy.controller import Controller
from testbed.policy.heat import COLD
from testbed.policy.page_moves import COLD_MIGRATION
from testbed.run.results import summarize
from testbed.scenario.file import load_scenario

ROOT = Path(__file__).resolve().parents[3]


def heat_drift(**heat):
    s = load_scenario(ROOT / "configs" / "heat-drift.toml")
    return s.replace(heat=heat) if heat else s


def test_a_deferred_update_lands_in_the_next_steps_first_layer_and_spares_pinned_experts():
    s = heat_drift(deferred=True)
    c = Controller(s)
    routed = routing_source(s)
    spared = migrated = 0
    for step in range(s.run.steps):
        d = decide_step(c, step, np.asarray(routed(step)))
        assert d.end.heat is None  # never at the step's end
        assert not any((m.reason == COLD_MIGRATION).any() for _, m in d.end.page_moves.groups())
        f0 = d.forward[0]
        if f0.heat is None:
            assert f0.heat_moves.empty
            continue
        assert c.heat.is_due(step - 1)  # the update that was due at the last step's end
        layer0 = np.arange(s.model.num_experts)  # instances of layer 0
        for r in range(c.layout.world):
            pinned = set((layer0[f0.active[c.layout.group_of[r]]]).tolist()) & set(c.local_instances(r).tolist())
            moves = f0.heat_moves.get(r)
            gone = set() if moves is None else set(moves.expert[moves.reason == COLD_MIGRATION].tolist())
            assert not (gone & pinned)  # an expert about to compute has pending work: it stays
            migrated += len(gone)
            spared += sum(1 for i in pinned if f0.heat.states[i] == COLD)
    assert migrated > 0 and spared > 0  # the check had something to decide, both ways


@pytest.mark.slow
def test_deferring_moves_the_heat_work_into_the_next_step():
    plain = SimBackend().run(heat_drift())
    deferred = SimBackend().run(heat_drift(deferred=True))
    a, b = summarize(plain.records, 2), summarize(deferred.records, 2)
    assert a["heat_updates"] == b["heat_updates"] + 1  # the last update is still pending when the run ends
    assert (b["moves_by_reason"] or {}).get("cold", 0) > 0
    # the same heat map, one step later: the same kind of events
    assert set(k for k, v in a["moves_by_reason"].items() if v) == set(k for k, v in b["moves_by_reason"].items() if v)


def test_memory_heat_is_what_the_pagers_counted():
    """Every page of each used replica, forward and backward: 2 x pages x groups using it."""
    s = heat_drift(update_interval=10)  # the steps' heat waits for the update: it can be read
    c = Controller(s)
    routed = routing_source(s)
    for step in range(3):
        d = decide_step(c, step, np.asarray(routed(step)))
        active = np.stack([f.active for f in d.forward])  # [L, R, E]
        assert len(c._heat_pending) == step + 1
        _, memory, _ = c._heat_pending[-1]
        assert memory.sum() > 0
        np.testing.assert_array_equal(memory, (2 * active.sum(axis=1) * c.pages_per_expert).reshape(-1))
