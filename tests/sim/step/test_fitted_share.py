"""The share of a simulated step that comes from fitted constants (``fitted_share``):
every fitted constant counts (a calibrated library latency, also one a built-in profile
stores; host costs per stage; a compute scale extrapolated to an unmeasured world; the
per-page host costs), on the rank with the most, and under pipeline parallelism of the
whole step."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sim.backend import ClusterSim, routing_source
from sim.hardware.software_latency import SoftwareLatency, compute_scale_fitted
from sim.step.phases import Phase
from sim.step.schedule import Timeline
from sim.step.step_report import figures
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import Measured, load_profile, save_profile
from testbed.scenario.scenario import Scenario

REPO = Path(__file__).resolve().parents[3]


def small(tmp_path, profile, nodes=2, **sections):
    d = {"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": nodes, "microclusters": 1, "profile": str(profile)},
         "parallelism": {"ep_size": 2}, "sim": {"network_model": "analytic"},
         "run": {"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")}}
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return Scenario.from_dict(d)


def first_step(s: Scenario, profile=None):
    sim = ClusterSim(s, profile or load_profile(s.cluster.profile))
    _, phases, tl, fig, *_ = sim.step(0, routing_source(s)(0), [])
    return sim, phases, tl, fig


def test_the_emulated_profiles_calibrated_library_latency_counts_as_fitted(tmp_path):
    """emulated stores the library latency testbed calibrate fitted (2,500 us a call,
    850 us an algorithm step; its [sources] say "fitted"): the route's counts all-gather
    in an EP group of 2, a ring of 1 step, owes 2,500 + 850 us of its time to them; local-cpu's
    figures are rough defaults, nothing fitted."""
    emulated = load_profile("emulated")
    lat = SoftwareLatency(emulated, 4)
    assert lat.fitted and "fitted" in lat.source and (lat.call_s, lat.step_s) == (2500e-6, 850e-6)
    assert not SoftwareLatency(load_profile("local-cpu"), 4).fitted
    _, phases, tl, fig = first_step(small(tmp_path, "emulated"))
    counts = next(p for p, ph in enumerate(phases) if ph.stage == "route" and ph.kind == "ops")
    assert {(op.kind, len(op.members)) for op in phases[counts].ops} == {("all_gather", 2)}
    assert tl.fitted[counts] == pytest.approx(np.full(4, 2500e-6 + 850e-6), rel=1e-12)
    assert fig.fitted_share > 0.2
    assert first_step(small(tmp_path, "local-cpu"))[3].fitted_share == 0


def with_measured(tmp_path, name, **measured):
    return save_profile(replace(load_profile("local-cpu"), name=name, measured=Measured(**measured)),
                        tmp_path / f"{name}.toml")


def test_a_compute_scale_extrapolated_to_another_world_is_fitted(tmp_path):
    """compute_scale measured at world 2 (1.5x): at world 2 it is a measurement, nothing
    fitted; at world 4 it is extrapolated (3x), so every compute second (all of it
    scaled by the factor) is fitted: the fitted share is the compute's busy share of the
    rank with the most."""
    path = with_measured(tmp_path, "scaled", compute_scale=({"world": 2, "factor": 1.5},))
    profile = load_profile(path)
    assert not compute_scale_fitted(profile, 2) and compute_scale_fitted(profile, 4)
    assert not compute_scale_fitted(profile, 4, shared_cores=True)  # the cores are shared instead
    _, _, _, measured = first_step(small(tmp_path, path, nodes=1))
    assert measured.fitted_share == 0
    sim, phases, tl, fig = first_step(small(tmp_path, path, nodes=2))
    assert sim.builder.compute.scale == pytest.approx(3.0)
    compute = np.array([ph.kind == "compute" for ph in phases])
    assert compute.any()
    busy = (tl.end - tl.start)[compute].sum(axis=0)
    rank_time = tl.end.max(axis=0) - tl.t0
    assert fig.fitted_share == pytest.approx((busy / rank_time).max(), rel=1e-12)


def test_the_per_page_host_costs_are_fitted(tmp_path):
    """copy.read_page_us and update_page_us (testbed calibrate's, 0 on GPU profiles): the
    seconds they add to the experts (reading every computing expert's pages) and to the
    optimizer (updating them) are exactly the phases' fitted seconds."""
    base = load_profile("local-cpu")
    costly = replace(base, copy=replace(base.copy, read_page_us=30.0, update_page_us=12.0))
    s = load_scenario(REPO / "configs" / "paging-pressure.toml").replace(
        sim={"network_model": "analytic"}, run={"output_dir": str(tmp_path)})
    _, plain_phases, _, plain = first_step(s, base)
    _, phases, tl, fig = first_step(s, costly)
    assert plain.fitted_share == 0 and fig.fitted_share > 0
    touched = [p for p, ph in enumerate(phases) if ph.stage in ("experts", "experts_backward", "optimizer")
               and ph.kind == "compute"]
    assert len(touched) == 5  # 2 layers forward and backward, the optimizer
    for p in touched:
        added = phases[p].seconds - plain_phases[p].seconds
        assert added.min() > 0
        assert tl.fitted[p] == pytest.approx(added, rel=1e-9)


def test_the_share_is_the_largest_ranks_not_the_mean():
    """Two ranks of 4 s: rank 0 owes 1 s to a fitted host cost, rank 1 3 s: the step's
    fitted share is 3 / 4, the rank with the most (the mean would say 1 / 2)."""
    host = Phase("route", 0, "compute", "compute", (), seconds=np.array([1.0, 3.0]), fitted=True)
    rest = Phase("experts", 0, "compute", "compute", (0,), seconds=np.array([3.0, 1.0]))
    start, end = np.array([[0.0, 0.0], [1.0, 3.0]]), np.array([[1.0, 3.0], [4.0, 4.0]])
    tl = Timeline(start, end, [], 0.0, fitted=np.array([[1.0, 3.0], [0.0, 0.0]]))
    assert figures([host, rest], tl, np.zeros(2), 1).fitted_share == pytest.approx(0.75)


def pipelined(tmp_path, profile, micro):
    """32 H200s in 2 pipeline stages of 4 MoE layers (16 experts) each after a dense layer."""
    return Scenario.from_dict({
        "model": {"hidden_size": 1024, "ffn_hidden_size": 2048, "num_layers": 8, "num_experts": 16, "dtype": "bf16"},
        "cluster": {"profile": str(profile), "gpus_per_node": 8, "nodes_per_microcluster": 2, "microclusters": 2},
        "parallelism": {"ep_size": 8, "pp_size": 2},
        "pager": {"enabled": False},
        "transformer": {"enabled": True, "num_heads": 8, "seq_len": 1024, "vocab_size": 32000, "moe_every": 2,
                        "micro_batches": micro},
        "workload": {"tokens_per_rank": 8192},
        "run": {"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")},
    })


def test_under_pipeline_parallelism_the_share_is_of_the_whole_step(tmp_path):
    """A host cost of 1 ms per route call (measured.stage_us) and nothing else fitted: each
    GPU routes its stage's 4 MoE layers for each of the m micro-batches, 4 m ms of the
    pipelined step (not 4 ms of one micro-batch's)."""
    h200 = load_profile("h200")
    path = save_profile(replace(h200, name="h200-host", measured=Measured(
        stage_us=({"world": 16, "stage": "route", "variant": "", "us": 1000.0, "us_per_MB": 0.0},))),
        tmp_path / "h200-host.toml")
    for micro in (2, 4):
        r = run_scenario(pipelined(tmp_path, path, micro), "sim")
        assert r["fitted_share"] == pytest.approx(micro * 4 * 1e-3 / r["step_time_s"], rel=1e-9)
