"""The one line on what overflows a device (issue 25, item 8: ``testbed.run.memory_verdict``), and the
summary of a run that does not fit carrying it to ``testbed run``'s output."""

from __future__ import annotations

from testbed.cli.main import format_summary
from testbed.core.units import format_bytes
from testbed.run.memory_verdict import memory_verdict, summary_memory_verdict
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile, profile_from_dict, save_profile
from testbed.scenario.scenario import Scenario

GiB, MiB = 2**30, 2**20


def test_the_line_names_the_categories_largest_first_and_how_much_is_over():
    """60 GiB of activations (13 micro-batches in flight), 20 of parameters, 10 of expert pages, 1 MiB of
    buffers, no gradients, at a peak of 90 GiB on 80 GB (74.51 GiB): 90 x 2^30 - 80 x 10^9 bytes over."""
    breakdown = {"expert_pages": 10 * GiB, "parameters": 20 * GiB, "gradients": 0.0, "activations": 60 * GiB,
                 "comm_buffers": 1 * MiB}
    line = memory_verdict(breakdown, 90 * GiB, 80e9, "h100", stage=0, in_flight=13)
    assert line == ("does not fit: the fullest GPU (pipeline stage 0) needs 90.00 GiB of the h100's 80 GB (74.51 GiB): "
                    "activations 60.00 GiB (micro-batches in flight: 13), parameters 20.00 GiB, expert_pages 10.00 GiB, "
                    "comm_buffers 1.00 MiB (each category at its most); 15.49 GiB over")
    assert "gradients" not in line and "\n" not in line


def test_no_line_when_the_peak_fits_and_no_pipeline_named_without_one():
    breakdown = {"parameters": 30 * GiB, "activations": 10 * GiB}
    assert memory_verdict(breakdown, 80e9, 80e9, "h100") is None  # exactly the device's memory fits
    line = memory_verdict(breakdown, 80e9 + 1, 80e9, "h100")
    assert line.startswith("does not fit: the fullest GPU needs ")
    assert line.index("parameters 30.00 GiB") < line.index("activations 10.00 GiB")
    assert "in flight" not in line and line.endswith("; 1 B over")


def test_a_summary_gives_its_pipeline_stage_and_in_flight_and_none_where_it_fits():
    summary = {"fits_in_device_memory": False, "device_memory_bytes": 80e9, "peak_memory_bytes": 81e9,
               "profile": "h100", "memory_breakdown_bytes": {"activations": 50e9, "parameters": 31e9},
               "pipeline": {"fullest_stage": 2, "in_flight": [4, 3, 2, 1]}}
    line = summary_memory_verdict(summary)
    assert "(pipeline stage 2)" in line and "(micro-batches in flight: 2)" in line
    assert summary_memory_verdict({**summary, "fits_in_device_memory": True}) is None
    assert summary_memory_verdict({"peak_memory_bytes": 1}) is None  # a backend without a device's memory


def _scenario(profile: str, tmp_path) -> Scenario:
    return Scenario.from_dict({
        "model": {"hidden_size": 64, "ffn_hidden_size": 128, "num_experts": 8, "top_k": 2, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1, "profile": profile},
        "parallelism": {"ep_size": 2}, "workload": {"tokens_per_rank": 256},
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)}})


def test_a_run_that_does_not_fit_prints_the_line(tmp_path):
    """The same small step on an h200 (fits: no line) and on an h200 of 10^-4 GB (100 kB, under its
    weights): the summary's line says how far its peak is over, and ``testbed run`` prints it."""
    fits = run_scenario(_scenario("h200", tmp_path / "fits"), "sim")
    assert fits["fits_in_device_memory"] is True and "memory_verdict" not in fits
    d = load_profile("h200").to_dict()
    d["compute"]["device_memory_GB"] = 1e-4
    small = str(save_profile(profile_from_dict(d, "h200-tiny"), tmp_path / "h200-tiny.toml"))
    out = run_scenario(_scenario(small, tmp_path / "small"), "sim")
    assert out["fits_in_device_memory"] is False
    line = out["memory_verdict"]
    largest = max(out["memory_breakdown_bytes"], key=out["memory_breakdown_bytes"].get)
    assert line.startswith(f"does not fit: the fullest GPU needs {format_bytes(out['peak_memory_bytes'])} "
                           f"of the {out['profile']}'s 0.0001 GB (97.66 KiB): {largest} ")
    assert line.endswith(f"; {format_bytes(out['peak_memory_bytes'] - 1e5)} over")
    assert f"WARNING    {line}" in format_summary(out).splitlines()
