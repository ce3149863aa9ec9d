"""A rank that dies stops the run with a clear error, never a hang."""

import time

import pytest

from real.backend import RealBackend
from testbed.core.errors import RunError
from testbed.scenario.scenario import Scenario


@pytest.mark.slow
def test_a_dead_rank_stops_the_others_quickly(tmp_path):
    s = Scenario.from_dict({
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "run": {"steps": 50, "warmup_steps": 0, "output_dir": str(tmp_path)},
        "real": {"timeout_s": 120},
    })
    t0 = time.monotonic()
    with pytest.raises(RunError, match="rank 1 died"):
        RealBackend().run(s, debug={"fail_at": {"rank": 1, "after_steps": 2}})
    assert time.monotonic() - t0 < 60  # far below the collective timeout: the parent noticed
