"""Shared fixtures: the repository root and small scenarios."""

import copy
import math
from pathlib import Path

import pytest

from testbed.scenario.scenario import Scenario

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


# ---- float tolerances -----------------------------------------------------------------------
class FloatBound:
    """Tolerances for float results that two computations reach by different reduction
    orders (a distributed run and its single-process reference, two kernels, two thread
    counts: BLAS blocking and thread partitioning change with the machine).

    A sum of n rounded terms in another order differs by at most about 2 (n - 1) u
    sum |terms| (u = eps / 2; Higham, *Accuracy and Stability of Numerical Algorithms*,
    2nd ed., section 4.2); rounding errors of independent terms add up like a random walk,
    so in practice the difference stays below about sqrt(n) u times the terms'
    magnitude (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019). The bound used:

        |actual - expected| <= k * eps * sqrt(n) * max|expected|    (elementwise, rtol 0)

    with eps the dtype's machine epsilon, ``n`` the reduction length behind one element
    (for a result at the end of a chain of reductions, as a gradient is: the rounded
    products it accumulates along the chain, e.g. tokens x (H + F) x layers; each test
    states its n), and ``k`` = ``K`` a safety factor for cancellation (a softmax backward,
    a residual y - target small next to y) and chained rounding. The largest differences
    measured in the real-vs-reference tests are on router gradients: 192 eps max|expected|
    with n = 5,120 here (k = 2.7), 109 with n = 2,560 on a machine like CI's (k = 2.2);
    ``K`` = 16 leaves six times that. A wrong result (a rank's share of four missing, a
    stale weight) is off by a quarter of max|expected| or more: over a thousand times the
    bound at these n. (torch is imported only when a bound is asked for.)
    """

    K = 16.0

    @staticmethod
    def chain(scenario: Scenario) -> int:
        """n for a real run's outputs, loss and gradients against its reference: every
        rank's tokens (x top-k) through the layers' H- and F-long dot products."""
        m = scenario.model
        return (scenario.workload.tokens_per_rank * scenario.world_size * m.top_k
                * (m.hidden_size + m.ffn_hidden_size) * m.num_layers)

    @staticmethod
    def updates(scenario: Scenario) -> int:
        """n for weights after the run's SGD steps: one rounding of w - lr g per step (the
        gradient's own error, times lr, stays below the weight's)."""
        return scenario.run.steps

    @staticmethod
    def atol(expected, n: int, k: float = K) -> float:
        """The bound's absolute tolerance for ``expected`` (a tensor) at reduction length ``n``."""
        import torch
        expected = torch.as_tensor(expected)
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        return k * torch.finfo(expected.dtype).eps * math.sqrt(max(n, 1)) * scale

    @classmethod
    def assert_close(cls, actual, expected, n: int, k: float = K, msg=None) -> None:
        """``torch.testing.assert_close`` within the bound (same dtype and shape)."""
        import torch
        torch.testing.assert_close(actual, expected, rtol=0.0, atol=cls.atol(expected, n, k), msg=msg)

    @staticmethod
    def approx(expected: float, n: int, k: float = K, dtype=None):
        """``pytest.approx`` for a scalar computed in ``dtype`` (default float32): relative
        ``k eps sqrt(n)``."""
        import torch
        eps = torch.finfo(dtype or torch.float32).eps
        return pytest.approx(expected, rel=k * eps * math.sqrt(max(n, 1)), abs=0.0)


@pytest.fixture
def float_bound() -> type[FloatBound]:
    """``FloatBound``: tolerances from the dtype's error bound."""
    return FloatBound
