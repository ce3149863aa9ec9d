"""Shared fixtures: the repository root and small scenarios."""

import copy
from pathlib import Path

import pytest

from testbed.scenario import Scenario

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


#: 2 CPU ranks on one node, EP 2, a tiny model: a real run of a few seconds
TWO_RANKS = {
    "model": {"hidden_size": 32, "ffn_hidden_size": 64},
    "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
    "parallelism": {"ep_size": 2},
    "pager": {"page_size_bytes": "4KiB", "gpu_budget_bytes": "24KiB"},
    "workload": {"tokens_per_rank": 64},
    "run": {"steps": 3, "warmup_steps": 1},
}


@pytest.fixture
def two_ranks() -> dict:
    """The ``TWO_RANKS`` scenario tables (a fresh copy to change)."""
    return copy.deepcopy(TWO_RANKS)


@pytest.fixture
def small(tmp_path):
    """A 4-rank scenario (2 per node, 2 nodes, EP 2 x 2 replicas) writing into tmp_path."""
    def make(**sections) -> Scenario:
        data = {
            "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
            "parallelism": {"ep_size": 2},
            "pager": {"page_size_bytes": 16384, "gpu_budget_bytes": 65536},
            "heat": {"window_steps": 4, "update_interval": 2},
            "run": {"steps": 3, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")},
        }
        for name, fields in sections.items():
            data.setdefault(name, {}).update(fields)
        return Scenario.from_dict(data)
    return make
