"""The synthetic task's targets are computed teacher by teacher: the same numbers as
the per-token formula y = tanh(x A_c) over a [T, H, H] gather of teachers (within the
float32 bound: the same per-row dot products), without ever allocating that gather, and
the memory the task holds is what the size guard counts (``testbed.run.guards.task_bytes``)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from real.kernels.task import SyntheticTask, TokenTask
from testbed.run.guards import task_bytes
from testbed.scenario.scenario import Scenario


def scenario(**model):
    return Scenario.from_dict({"model": {"hidden_size": 64, "num_experts": 8, **model},
                               "workload": {"tokens_per_rank": 256, "skew": 1.2},
                               "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
                               "parallelism": {"ep_size": 2}})


@pytest.mark.parametrize("step, rank", [(0, 0), (3, 1)])
def test_targets_are_the_per_token_teachers_formula(step, rank, float_bound):
    task = SyntheticTask(scenario())
    x, y = task.batch(step, rank)
    c, x_again = task.inputs(step, rank)
    assert torch.equal(x, x_again) and len(c.unique()) > 1  # several teachers in one batch
    gathered = torch.tanh(torch.einsum("th,thk->tk", x, task.teachers_CHH[c]))  # the old [T, H, H] formula
    float_bound.assert_close(y, gathered, task.hidden)  # H-long dot products, maybe in another order


def test_a_batch_never_allocates_a_teacher_per_token():
    """Largest single allocation of one batch: a few [T, H] tensors, not [T, H, H] (which
    would be 64 times more here, and 69 GB at H 2048 and 4,096 tokens)."""
    task = SyntheticTask(scenario())
    T, H = task.tokens, task.hidden
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        task.batch(0, 0)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= 2 * T * H * 4 < T * H * H * 4


def test_the_guard_counts_what_the_task_holds():
    s = scenario()
    task = SyntheticTask(s)
    x, y = task.batch(0, 0)
    held = sum(t.numel() * t.element_size() for t in (task.centers_CH, task.teachers_CHH, x, y))
    assert task_bytes(s) == held
    tokens = scenario().replace(transformer={"enabled": True, "vocab_size": 1000})
    t = TokenTask(tokens)
    ids, targets = t.batch(0, 0)
    assert task_bytes(tokens) == sum(v.numel() * v.element_size() for v in (t.target_of, ids, targets))
