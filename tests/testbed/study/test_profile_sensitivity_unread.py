"""``unread_by`` (testbed.study.profile_sensitivity): the assumed constants a scenario cannot read,
whose moves experiments/validate_published.py does not run. Each rule is checked on a published
scenario it applies to: the constant moved -20% leaves the simulated step exactly as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.study.profile_sensitivity import assumed_constants, moved_profile_file, unread_by

ROOT = Path(__file__).resolve().parents[3]
#: bf16 on h100, heat map and pager off, one micro-cluster of one leaf, the all-to-all dispatcher
QWEN2 = ROOT / "configs" / "published" / "qwen2-57b-64-h100-mcore.toml"
UNREAD = ["overheads.heat_update_us_per_expert", "compute.block_half_width", "links.pcie.bandwidth_GBps",
          "compute.peak_tflops.fp8", "compute.peak_tflops.fp16", "links.spine.latency_us",
          "links.spine.bandwidth_GBps", "collectives.deepep_dispatch_GBps", "collectives.deepep_combine_GBps"]


def step_seconds(s, tmp_path: Path) -> float:
    return run_scenario(s.replace(run={"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)}), "sim",
                        force=True)["step_time_s"]


@pytest.fixture(scope="module")
def qwen2():
    return load_scenario(QWEN2)


@pytest.fixture(scope="module")
def base_step(qwen2, tmp_path_factory):
    return step_seconds(qwen2, tmp_path_factory.mktemp("base"))


def test_the_rules_name_what_is_off(qwen2):
    keys = [c.key for c in assumed_constants(load_profile("h100")) if unread_by(qwen2, c.key)]
    assert sorted(keys) == sorted(UNREAD)
    assert unread_by(qwen2, "compute.launch_us") == ""  # read by every kernel
    assert "heat.enabled" in unread_by(qwen2, "overheads.heat_update_us_per_expert")
    on = Scenario.from_dict({"heat": {"enabled": True}, "pager": {"enabled": True}, "model": {"gemm_dtype": "fp8"},
                             "cluster": {"microclusters": 2}})
    assert [k for k in UNREAD if unread_by(on, k)] == ["compute.peak_tflops.fp16", "collectives.deepep_dispatch_GBps",
                                                       "collectives.deepep_combine_GBps"]
    assert "comm.token_strategy is 'alltoall'" in unread_by(on, "collectives.deepep_combine_GBps")
    assert unread_by(on.replace(comm={"token_strategy": "deepep"}), "collectives.deepep_combine_GBps") == ""


@pytest.mark.parametrize("key", UNREAD)
def test_an_unread_constant_moved_leaves_the_step_as_it_was(key, qwen2, base_step, tmp_path):
    profile = load_profile("h100")
    path = moved_profile_file(profile, key, 0.8, tmp_path)
    assert step_seconds(qwen2.replace(cluster={"profile": str(path)}), tmp_path) == base_step


def test_a_read_constant_moved_moves_the_step(qwen2, base_step, tmp_path):
    """The check can fail: NCCL's call cost, which the rules keep, moves this step."""
    path = moved_profile_file(load_profile("h100"), "collectives.latency_us", 0.8, tmp_path)
    assert step_seconds(qwen2.replace(cluster={"profile": str(path)}), tmp_path) != base_step
