"""M20's probe activation on both backends (heat-drift: a heat update every step, frozen
experts probed when the cold level rises). A probed expert is run for real on the real
ranks, its time modelled by the simulator (its pages across PCIe, then its forward on
``heat.probe_tokens`` tokens); it wakes only when it answered within
``heat.probe_timeout_ms``: never with a timeout of 0."""

from pathlib import Path

import numpy as np
import pytest

from real.backend import RealBackend
from sim.backend import ClusterSim, SimBackend, routing_source
from sim.step.probe import ModelledProbe
from testbed.run.results import summarize
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import load_profile

ROOT = Path(__file__).resolve().parents[3]


def heat_drift(tmp_path, steps, timeout_ms):
    s = load_scenario(ROOT / "configs" / "heat-drift.toml")
    return s.replace(heat={"probe_timeout_ms": timeout_ms}, run={"steps": steps, "output_dir": str(tmp_path)})


def wakes(result) -> int:
    return summarize(result.records, 0)["moves_by_reason"].get("wake", 0)


@pytest.mark.slow
@pytest.mark.parametrize("backend, steps", [(SimBackend, 40), (RealBackend, 12)])
def test_only_probes_that_answer_in_time_wake(tmp_path, backend, steps):
    assert wakes(backend().run(heat_drift(tmp_path / "a", steps, 1000.0))) > 0
    assert wakes(backend().run(heat_drift(tmp_path / "b", steps, 0.0))) == 0


def test_the_modelled_answer_is_the_pages_copied_then_the_forward(tmp_path):
    """A frozen expert of heat-drift: 4 pages of 16 KiB on the host, each a copy on the
    profile's table, then its forward on 16 tokens; a resident one only computes."""
    s = heat_drift(tmp_path, 40, 10.0)
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    probe = sim.probe
    assert isinstance(probe, ModelledProbe)
    m = s.model
    compute = sim.builder.compute.expert_time([16], m.hidden_size, m.ffn_hidden_size, s.sim.expert_kernel)
    inst = int(sim.controller.local_instances(0)[0])
    assert probe.answer_s(0, inst) == pytest.approx(compute)  # every page resident at the start
    routed = routing_source(s)
    for step in range(40):
        sim.step(step, np.asarray(routed(step)), [])
        frozen = sim.controller.pager_of(0).frozen_experts()
        if len(frozen):
            break
    assert len(frozen), "heat-drift freezes an expert of rank 0 within 40 steps"
    pager = sim.controller.pager_of(0)
    copies = 4 * sim.builder.compute.copy_time(16 * 1024)
    own = int(sim.controller.local_instances(0)[list(pager.experts).index(int(frozen[0]))])
    assert probe.answer_s(0, own) == pytest.approx(copies + compute)


@pytest.mark.slow
def test_a_deferred_heat_update_on_real_ranks(tmp_path):
    """heat.deferred (M18) on 4 CPU ranks with checkpoints (the controller is pickled with
    an update pending): cold migrations and wake-ups still happen, at the next step's
    first layer, and the heat stage is timed there."""
    s = heat_drift(tmp_path, 12, 1000.0).replace(heat={"deferred": True},
                                                 checkpoint={"enabled": True, "optimizer_interval": 1,
                                                             "directory": str(tmp_path / "ckpt")})
    result = RealBackend().run(s)
    summary = summarize(result.records, 0)
    moves = summary["moves_by_reason"]
    assert moves.get("cold", 0) > 0 and moves.get("wake", 0) > 0
    assert summary["heat_updates"] > 0
    assert all(r.stage_time_s["heat"] > 0 for r in result.records[2:] if r.expert_states is not None)
