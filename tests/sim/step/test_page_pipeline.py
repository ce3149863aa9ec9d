"""M14 page pipelining in the simulator (``pager.pipeline_pages``): an expert whose pages
are on the way computes page by page as they arrive, its GEMMs in blocks of one page's
rows, slower the narrower the block (``ComputeModel.block_slowdown``)."""

import numpy as np
import pytest

from sim.backend import ClusterSim, routing_source
from sim.hardware.compute import ComputeModel
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario


def paging(tmp_path, pipeline, page="4MiB", profile="h200", tokens=32768):
    """One node of 8 H200s, 8 experts of 23 MiB each per GPU and room for about 5: every
    layer's forward loads pages while its experts have ~2,000-8,000 tokens each."""
    return Scenario.from_dict({
        "model": {"hidden_size": 4096, "ffn_hidden_size": 1408, "num_layers": 2, "num_experts": 64, "top_k": 2,
                  "dtype": "bf16"},
        "cluster": {"profile": profile, "gpus_per_node": 8, "nodes_per_microcluster": 1, "microclusters": 1},
        "parallelism": {"ep_size": 8},
        "pager": {"page_size_bytes": page, "gpu_budget_bytes": "256MiB", "pipeline_pages": pipeline},
        "workload": {"tokens_per_rank": tokens},
        "run": {"steps": 3, "warmup_steps": 1, "output_dir": str(tmp_path)},
    })


def test_block_slowdown_closed_form():
    """H = F = 1024, k = 256 (h200's assumed half width): a page of 256 rows of either
    matrix runs at 256 / 512 of the efficiency 1024 / 1280 of a full-width GEMM: 1.6x
    slower; a page of a whole matrix or more is not slower; narrower pages are slower."""
    c = ComputeModel(load_profile("h200"), "bf16")
    assert c.profile.compute.block_half_width == 256
    assert c.block_slowdown(1024, 1024, 256 * 1024 * 2) == pytest.approx(1.6)
    assert c.block_slowdown(1024, 1024, 1024 * 1024 * 2) == pytest.approx(1.0)
    assert c.block_slowdown(1024, 1024, 4 * 1024 * 1024 * 2) == pytest.approx(1.0)
    widths = [c.block_slowdown(4096, 1408, 2**20 * m) for m in (1, 4, 16)]
    assert widths[0] > widths[1] > widths[2] >= 1.0


def forward_phases(s):
    """The phases of the first step and their timeline."""
    sim = ClusterSim(s, load_profile(s.cluster.profile))
    decisions, phases, tl, *_ = sim.step(0, routing_source(s)(0), [])
    return phases, tl


def test_experts_start_before_their_last_page_and_end_after_it(tmp_path):
    """With pipelining, a layer's experts start once the first loaded page has arrived,
    while the rest are still copied, and the last block runs after the last page."""
    phases, tl = forward_phases(paging(tmp_path, True))
    first, rest = [i for i, p in enumerate(phases) if p.stage == "paging" and p.kind == "copy" and p.layer == 1][:2]
    head = next(i for i, p in enumerate(phases) if p.stage == "experts" and p.layer == 1)
    tail = head + 1
    assert phases[rest].kind == "copy" and phases[tail].stage == "experts" and rest in phases[tail].deps
    loading = phases[rest].pages > 0
    assert loading.any()
    assert (tl.start[head][loading] < tl.end[rest][loading]).all()
    assert (tl.end[tail][loading] >= tl.end[rest][loading]).all()


def test_pipelining_shortens_a_compute_heavy_paging_step(tmp_path):
    """Pages copied beside compute: pipelined, the experts overlap their own page loads."""
    plain = run_scenario(paging(tmp_path, False), "sim")
    piped = run_scenario(paging(tmp_path, True), "sim")
    assert piped["step_time_s"] < 0.97 * plain["step_time_s"]
    assert piped["bytes_by_level"] == plain["bytes_by_level"]  # the same pages move


def test_pipelining_does_nothing_where_copies_do_not_overlap_compute(tmp_path):
    """local-cpu: copies run in line (copy.overlap = 0), so no expert computes beside them."""
    small = {"model": {"hidden_size": 64, "ffn_hidden_size": 128, "dtype": "fp32"},
             "pager": {"page_size_bytes": "8KiB", "gpu_budget_bytes": "96KiB"}}
    base = Scenario.from_dict({**small, "run": {"steps": 3, "warmup_steps": 1, "output_dir": str(tmp_path)}})
    assert load_profile(base.cluster.profile).copy.overlap == 0
    plain = run_scenario(base, "sim")
    piped = run_scenario(base.replace(pager={"pipeline_pages": True}), "sim")
    assert piped["step_time_s"] == plain["step_time_s"]


def test_the_best_page_size_is_interior_when_pipelined(tmp_path):
    """Small pages: narrow blocks and a latency per page; large pages: the first page
    arrives late. Pipelined, the step is fastest at neither end of 1-64 MiB."""
    times = [run_scenario(paging(tmp_path, True, page), "sim")["step_time_s"] for page in ("1MiB", "4MiB", "64MiB")]
    assert times[1] < times[0] and times[1] < times[2]
    assert np.argmin(times) == 1
