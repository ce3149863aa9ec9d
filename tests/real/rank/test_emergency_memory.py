"""M15 under free device memory (``pager.free_memory = device``) on both backends: when
the device's memory outside the page pool runs short, the pool gives pages up (rows of
reason ``emergency``) until 5% of the device is free; with the budget rule and room for
every page nothing is evicted. The real CPU ranks and the simulator model the device
memory (``pager.device_memory_bytes``); a GPU rank reads its allocator."""

import pytest

from real.backend import RealBackend
from sim.backend import SimBackend
from testbed.core.errors import ScenarioError
from testbed.run.results import summarize
from testbed.scenario.scenario import Scenario

EXPERT_BYTES = 2 * 32 * 48 * 4  # fp32 experts of H = 32, F = 48: 12,288 bytes, 3 pages of 4,096


def scenario(tmp_path, **pager):
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": 4096, **pager},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 3, "warmup_steps": 0, "output_dir": str(tmp_path)},
    })


def emergencies(result) -> int:
    return summarize(result.records, 0)["moves_by_reason"].get("emergency", 0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [SimBackend, RealBackend])
def test_short_device_memory_evicts_pages(tmp_path, backend):
    """4 local experts x 3 pages = 48 KiB of pool. A device of 60 KiB keeps 3 KiB free:
    what the step holds besides pages leaves less than that, so pages go, step after step."""
    roomy = backend().run(scenario(tmp_path / "a"))
    tight = backend().run(scenario(tmp_path / "b", free_memory="device", device_memory_bytes=60 * 1024))
    assert emergencies(roomy) == 0
    assert emergencies(tight) > 0
    plenty = backend().run(scenario(tmp_path / "c", free_memory="device", device_memory_bytes=2**30))
    assert emergencies(plenty) == 0


def test_cpu_ranks_need_the_device_memory_to_model(tmp_path):
    with pytest.raises(ScenarioError, match="device_memory_bytes"):
        RealBackend().check(scenario(tmp_path, free_memory="device"))
