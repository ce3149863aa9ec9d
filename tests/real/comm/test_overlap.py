"""Overlap on the real backend (M22): micro-batches of the flat all-to-all pipelined with
the experts. They compute what one batch computes (the single-process reference), move
the bytes the simulator counts for them, and issue each micro-batch's exchange while
another's experts run."""

import numpy as np
import pytest
import torch

from real.backend import RealBackend
from real.comm import micro_batches as pipeline
from real.rank.reference import reference_run, reference_step
from sim.step.phase_sizes import split_op
from testbed.core.errors import ScenarioError
from testbed.policy.collectives import CollectiveOp
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario


def scenario(world, micro_batches, tmp_path, **overrides):
    d = {
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": world // 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "router": {"capacity_factor": 1.0},
        "pager": {"page_size_bytes": 4096, "gpu_budget_bytes": 16384},
        "comm": {"token_strategy": "alltoall", "expert_sync": "two_stage"},
        "overlap": {"micro_batches": micro_batches},
        "workload": {"tokens_per_rank": 61},  # rows per pair do not divide evenly
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)},
    }
    for section, values in overrides.items():
        d.setdefault(section, {}).update(values)
    return Scenario.from_dict(d)


@pytest.mark.slow
@pytest.mark.parametrize("world, micro_batches", [(2, 2), (4, 3)])
def test_micro_batches_compute_what_one_batch_computes(world, micro_batches, tmp_path, float_bound):
    s = scenario(world, micro_batches, tmp_path)
    result = RealBackend().run(s, debug={"capture": True})
    ref = reference_step(s)
    close, n = float_bound.assert_close, float_bound.chain(s)
    assert result.records[0].loss == float_bound.approx(ref["loss"], n)
    for rank, cap in enumerate(result.captured):
        close(cap["output"], ref["outputs"][rank], n)
        for inst, grad in cap["expert_grads"].items():
            close(grad, ref["expert_grads"][inst], n)
        for (w, b), (rw, rb) in zip(cap["router_grads"], ref["router_grads"]):
            close(w, rw, n)
            close(b, rb, n)


@pytest.mark.slow
@pytest.mark.parametrize("sync_with_backward", [False, True])
def test_overlap_moves_the_bytes_and_pages_the_simulator_counts(sync_with_backward, tmp_path):
    """Per stage and level, the real ranks' bytes equal the simulator's replay of their
    routing, both in 3 micro-batches, and with the sync during the backward; the pager
    makes the same moves (the controller decides in the simulator's order)."""
    s = scenario(4, 3, tmp_path, overlap={"sync_with_backward": sync_with_backward}, run={"steps": 3},
                 heat={"update_interval": 2, "window_steps": 2})
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    assert real["bytes_by_level"] == replay["bytes_by_level"]
    assert real["page_moves_per_step"] == replay["page_moves_per_step"] > 0


def test_a_micro_batch_carries_the_rows_the_simulator_splits_off():
    """Chunk i of every pair: the rows the real backend sends in micro-batch i are the
    simulator's micro-batch i of the op (``split_op``, whole rows of ``row_bytes``)."""
    rows = np.array([[0, 7, 2], [5, 0, 1], [3, 4, 0]])
    op = CollectiveOp("all_to_all_v", (0, 1, 2), "dispatch", 0, matrix=rows * 96, row_bytes=96)
    for i in range(3):
        part = split_op(op, 3, i).matrix
        for sender in range(3):
            chunks = pipeline.plan_chunks(rows[sender], rows[:, sender], np.arange(rows[:, sender].sum()),
                                          [rows[:, sender].sum()], 3, "cpu")
            assert (np.array(chunks[i].send_splits) * 96).tolist() == part[sender].tolist()
            assert (np.array(chunks[i].recv_splits) * 96).tolist() == part[:, sender].tolist()
    assert sum(split_op(op, 3, i).matrix for i in range(3)).tolist() == op.matrix.tolist()


class Recorder:
    """A fake rank for PipelinedExchange: a one-member exchange whose all-to-alls,
    waits, clock and experts append to ``events``."""

    def __init__(self):
        self.events = []
        self.current = None

    def all_to_all(self, x, send_splits, recv_splits, members, group, async_op=False, stage=None):
        n = sum(1 for e in self.events if e[0] == "issue" and e[1] == stage)
        self.events.append(("issue", stage, n))
        events = self.events

        class Work:
            def wait(self):
                events.append(("wait", stage, n))
        return x.clone(), Work()

    def switch(self, stage):
        self.current = stage

    def experts(self, rows, counts):
        n = sum(1 for e in self.events if e[0] == "experts")
        self.events.append(("experts", n))
        return rows * 2.0


def test_each_micro_batch_is_in_flight_while_the_experts_of_another_run():
    """Forward: dispatch 0 and 1 are issued before experts 0 run; combine 0 and dispatch
    2 before experts 1; ... (the simulator's comm-stream order). Backward: the next
    combine gradient is issued before a micro-batch's experts run backward, and the
    previous dispatch gradient is still in flight. The output is the experts' (x 2)."""
    fake = Recorder()
    sizes = [4, 3, 5]  # rows of micro-batch 0, 1, 2 to the one member
    chunks = [pipeline.Chunk([n], [n], torch.arange(sum(sizes[:i]), sum(sizes[:i + 1])), torch.arange(n), [n])
              for i, n in enumerate(sizes)]
    ex = pipeline.Exchange(fake, fake, (0,), None, None, chunks, fake.experts)
    x = torch.randn(sum(sizes), 2, requires_grad=True)
    y = pipeline.PipelinedExchange.apply(x, ex)
    torch.testing.assert_close(y, 2 * x)
    forward = fake.events[:]
    assert forward[:4] == [("issue", "dispatch", 0), ("issue", "dispatch", 1), ("wait", "dispatch", 0), ("experts", 0)]
    assert forward.index(("issue", "dispatch", 2)) < forward.index(("experts", 1))
    assert forward.index(("issue", "combine", 0)) < forward.index(("experts", 1))
    assert forward.index(("wait", "combine", 0)) > forward.index(("experts", 2))  # combines are waited for last
    fake.events.clear()
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    back = fake.events
    assert back[:3] == [("issue", "combine_backward", 0), ("issue", "combine_backward", 1),
                        ("wait", "combine_backward", 0)]
    assert back.index(("issue", "dispatch_backward", 0)) < back.index(("wait", "combine_backward", 1))
    assert back.index(("wait", "dispatch_backward", 0)) > back.index(("issue", "dispatch_backward", 2))


def test_micro_batches_with_another_token_strategy_are_refused(tmp_path):
    s = scenario(2, 2, tmp_path, comm={"token_strategy": "allgather"})
    with pytest.raises(ScenarioError, match="overlap.micro_batches"):
        RealBackend().check(s)


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["allreduce", "two_stage"])
def test_sync_during_the_backward_gives_the_gradients_and_weights_of_sync_after_it(sync, tmp_path, float_bound):
    """overlap.sync_with_backward: expert and router gradients are synced as their layers'
    backward completes, with micro-batches too; the synced gradients and the weights
    after the step are the single-process reference's, over several steps."""
    s = scenario(4, 2, tmp_path, comm={"expert_sync": sync, "grad_bucket_bytes": 1},
                 overlap={"sync_with_backward": True}, run={"steps": 3},
                 model={"num_layers": 3}, workload={"tokens_per_rank": 16})
    result = RealBackend().run(s, debug={"capture": True})
    ref = reference_run(s)
    close, n, steps = float_bound.assert_close, float_bound.chain(s), float_bound.updates(s)
    for step, (rec, want) in enumerate(zip(result.records, ref)):
        assert rec.loss == float_bound.approx(want["loss"], n), step
    for cap in result.captured:
        for inst, grad in cap["expert_grads"].items():
            close(grad, ref[0]["expert_grads"][inst], n)
        for (w, b), (rw, rb) in zip(cap["router_grads"], ref[0]["router_grads"]):
            close(w, rw, n)
            close(b, rb, n)
        for inst, w in cap["final_experts"].items():
            close(w, ref[-1]["experts_after"][inst], steps)
        for (w, b), (rw, rb) in zip(cap["final_router"], ref[-1]["router_after"]):
            close(w, rw, steps)
            close(b, rb, steps)
