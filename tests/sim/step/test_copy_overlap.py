"""Copy overlap (``copy.overlap`` f, ``sim.step.phases``): a copy of c seconds runs on the copy
stream and the rank's in-order work first waits the (1 - f) c that nothing hides, so
compute of t seconds issued with the copy and the copy end together after
max(c, (1 - f) c + t); at f = 0 the copy runs in line (t + c), at f = 1 nothing waits
(max(t, c))."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sim.backend import ClusterSim
from sim.step import schedule
from sim.step.flow_executor import run_flows
from sim.step.schedule import run_analytic
from sim.step.step_report import figures
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import load_profile, save_profile
from testbed.scenario.scenario import Scenario

REPO = Path(__file__).resolve().parents[3]
MiB = 2**20
W = 2  # GPUs of the hand-made steps
EXECUTORS = ("analytic", "flow", "flow_processes")


def h200(overlap: float):
    p = load_profile("h200")
    return replace(p, copy=replace(p.copy, overlap=overlap))


def cluster_sim(tmp_path, overlap: float, mode: str) -> ClusterSim:
    s = Scenario.from_dict({
        "cluster": {"profile": "h200", "gpus_per_node": W, "nodes_per_microcluster": 1, "microclusters": 1},
        "parallelism": {"ep_size": W}, "sim": {"network_model": "analytic" if mode == "analytic" else "flow"},
        "run": {"output_dir": str(tmp_path)}})
    return ClusterSim(s, h200(overlap))


def copy_seconds_by_hand(h2d_bytes: float, pages: int) -> float:
    """One copy alone on an H200's PCIe link: its bytes at links.pcie, 7 us a page."""
    p = load_profile("h200")
    return h2d_bytes / (p.links.pcie.bandwidth_GBps * 1e9) + pages * p.copy.latency_us * 1e-6


def copy_beside_compute(tmp_path, overlap: float, compute_s: float, h2d_bytes: float, mode: str = "analytic"):
    """A layer's page copy of ``h2d_bytes`` in one page, compute of ``compute_s`` seconds
    issued after it, and the experts waiting for both: (phases, timeline, experts' index)."""
    sim = cluster_sim(tmp_path, overlap, mode)
    b = sim.builder
    b.phases, b.main, zero = [], -1, np.zeros(W)
    copy = b.copy_phase(0, (np.full(W, h2d_bytes), zero, np.ones(W), zero))
    b.chain("dense", 0, "compute", "compute", seconds=np.full(W, compute_s))
    experts = b.add("experts", 0, "compute", "compute", (b.main, copy), seconds=zero, waits_for_pages=copy)
    if mode == "analytic":
        tl = run_analytic(b.phases, W, sim.timer, 0.0, sim.copy_latency)
    elif mode == "flow":
        tl = run_flows(b.phases, W, sim.collectives, sim.env.now, sim.copy_latency)
    else:
        tl = schedule.run_flows(b.phases, W, sim.collectives, sim.env.now, sim.copy_latency)
    return b.phases, tl, experts


@pytest.mark.parametrize("mode", EXECUTORS)
@pytest.mark.parametrize("overlap, t_over_c", [(0.0, 0.5), (0.01, 0.5), (0.5, 0.3), (0.864, 0.5), (0.864, 2.0),
                                               (1.0, 0.5), (1.0, 2.0)])
def test_a_copy_beside_compute_in_closed_form(tmp_path, mode, overlap, t_over_c):
    """c = 64 MiB / 55.19 GB/s + 7 us. Experts waiting for both start at
    max(c, (1 - f) c + t) (f > 0) or t + c (f = 0, in line), on every executor; the
    stall is the wait (1 - f) c plus what is left of the copy after the compute,
    max(0, f c - t) (in line: the whole copy)."""
    c = copy_seconds_by_hand(64 * MiB, 1)
    t = t_over_c * c
    phases, tl, experts = copy_beside_compute(tmp_path, overlap, t, 64 * MiB, mode)
    pair = t + c if overlap == 0 else max(c, (1 - overlap) * c + t)
    assert tl.start[experts] == pytest.approx(np.full(W, pair), rel=1e-12)
    stall = c if overlap == 0 else (1 - overlap) * c + max(0.0, overlap * c - t)
    assert figures(phases, tl, np.zeros(W), 1).page_stall_s == pytest.approx(stall, rel=1e-12)
    waits = [ph for ph in phases if ph.kind == "wait"]
    if 0 < overlap < 1:  # the in-order work's wait, on the compute stream, before the compute
        assert len(waits) == 1 and waits[0].stream == "compute" and waits[0].stage == "paging"
        assert waits[0].seconds == pytest.approx(np.full(W, (1 - overlap) * c), rel=1e-12)
    else:  # f = 1: the phases of a perfect overlap; f = 0: the copy in line
        assert waits == []


def test_overlap_zero_and_one_are_the_serial_sum_and_the_longer(tmp_path):
    """The two ends, checked against each other: at f = 0 compute and copy add up, at
    f = 1 the longer of the two is the pair."""
    c = copy_seconds_by_hand(64 * MiB, 1)
    for t in (0.5 * c, 2 * c):
        _, serial, e = copy_beside_compute(tmp_path, 0.0, t, 64 * MiB)
        _, hidden, _ = copy_beside_compute(tmp_path, 1.0, t, 64 * MiB)
        assert serial.start[e] == pytest.approx(np.full(W, t + c), rel=1e-12)
        assert hidden.start[e] == pytest.approx(np.full(W, max(t, c)), rel=1e-12)


def test_the_model_gives_back_the_h200_measurement_it_comes_from(tmp_path):
    """benchmarks/h200-ceilings.json: a matmul of overlap_mm_s alone and a 256 MB copy of
    overlap_copy_s alone took overlap_both_s together; overlap_hidden_frac = 1 - (both -
    mm) / copy. The model times that pair as mm + (1 - f) copy: the measurement itself
    at f = overlap_hidden_frac; with the profile's 0.864 (rounded), within the rounding
    times the copy (0.0001 x 4.86 ms = 0.5 us of 16.38 ms)."""
    m = json.loads((REPO / "benchmarks" / "h200-ceilings.json").read_text())
    mm, copy, both, frac = m["overlap_mm_s"], m["overlap_copy_s"], m["overlap_both_s"], m["overlap_hidden_frac"]
    latency = load_profile("h200").copy.latency_us * 1e-6
    bw = load_profile("h200").links.pcie.bandwidth_GBps * 1e9
    nbytes = (copy - latency) * bw  # one page whose copy takes overlap_copy_s
    for f, tol in ((frac, 1e-12 * both), (load_profile("h200").copy.overlap, abs(0.864 - frac) * copy + 1e-12)):
        _, tl, e = copy_beside_compute(tmp_path, f, mm, nbytes)
        assert np.abs(tl.start[e] - both).max() <= tol
    assert load_profile("h200").copy.overlap == 0.864


def paging_pressure(tmp_path, overlap: float, **sections):
    """configs/paging-pressure.toml on h200 with ``copy.overlap`` = ``overlap``."""
    path = save_profile(h200(overlap), tmp_path / f"h200-{overlap}.toml")
    s = load_scenario(REPO / "configs" / "paging-pressure.toml")
    sections["run"] = {**sections.get("run", {}), "output_dir": str(tmp_path / "runs")}
    return run_scenario(s.replace(cluster={"profile": str(path)}, **sections), "sim")


def test_paging_pressure_step_and_stall_follow_the_overlap(tmp_path):
    """configs/paging-pressure.toml on h200: each step copies 11 pages of 64 KiB in and
    11 out for layer 1's forward (c = 22 x 7 us + 704 KiB at 55.19 GB/s = 167 us) and 11
    in for layer 0's backward (90 us), each beside a 19 us all-to-all only. While f c
    exceeds the all-to-all's 19 us (f > 0.21) the experts wait for the copy anyway: the
    wait (1 - f) c falls within it, and the step (0.930 ms) and the stall (0.219 ms: c -
    19 us a copy) are those of a perfect overlap. At f = 0.01 the all-to-all waits 0.99 c
    first and the experts wait for the all-to-all: the step is 0.965 ms (+ 19 us - 0.01 c
    a copy), the stall the two waits, 0.255 ms. With 2,048 times the tokens (65,536 per
    GPU) the all-to-all outlasts f c at 0.864 too, and step and stall move at every f."""
    runs = {f: paging_pressure(tmp_path, f) for f in (0.01, 0.864, 1.0)}
    step = {f: r["step_time_s"] for f, r in runs.items()}
    stall = {f: r["page_stall_s"] for f, r in runs.items()}
    assert step[0.01] > 1.02 * step[0.864] and stall[0.01] > 1.1 * stall[0.864]
    assert step[0.864] == pytest.approx(step[1.0], rel=1e-12) and stall[0.864] == pytest.approx(stall[1.0], rel=1e-9)
    many = {f: paging_pressure(tmp_path, f, workload={"tokens_per_rank": 65536}, run={"steps": 3, "warmup_steps": 1})
            for f in (0.01, 0.864, 1.0)}
    assert many[0.01]["step_time_s"] > many[0.864]["step_time_s"] > many[1.0]["step_time_s"]
    assert many[0.01]["page_stall_s"] > many[0.864]["page_stall_s"] > many[1.0]["page_stall_s"]
