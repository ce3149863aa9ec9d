"""A tensor-parallel group shares its micro-batch (issue 25, item 1; Megatron-Core with
sequence parallelism): with ``parallelism.tp_size`` 2 each GPU holds half a sequence
(``workload.tokens_per_rank = transformer.seq_len / 2``), the group's two halves are one
sequence, rank 0's first, which every attention sees whole after the all-gather.

The unsplit run: the same tokens as whole sequences on half the GPUs without tensor
parallelism (GPU g holds what TP group g's ranks 2g and 2g + 1 hold, in that order),
computed by the single-process reference (``real.rank.reference``, written from the
formulas, attention sequence by sequence). The task draws each GPU's tokens by its rank
(``real.kernels.task.TokenTask``), so the reference is given the split run's tokens
joined. Dropless routing without noise or a balance loss: each token's route is its own
(a rank's capacity and its aux loss would see one half or the whole), so in exact
arithmetic every step's loss (the mean over the tokens either way: 4 ranks' means of 16
or 2 ranks' of 32), every output row and every gradient is the same; held to the float
bound of tests/conftest.py. The simulator's replay of the split run's routing moves the
same bytes per stage and per link level.
"""

import pytest
import torch

from real.backend import RealBackend
from real.comm.tensor_parallel import shard
from real.kernels.task import TokenTask
from real.rank import reference
from testbed.run.results import summarize
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

SEQ = 32


def scenario(tmp_path, nodes: int, tp: int, tokens: int) -> Scenario:
    """``nodes`` nodes of 2 CPU ranks, EP 2, 4 experts in 2 MoE layers after a dense layer
    each, grouped-query attention over sequences of ``SEQ``; plain SGD (the reference's)."""
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": nodes, "microclusters": 1},
        "parallelism": {"ep_size": 2, "tp_size": tp, "sequence_parallel": True},
        "router": {"capacity_factor": 0.0, "aux_loss_coef": 0.0, "noise": "none"},
        "pager": {"enabled": False},
        "comm": {"expert_sync": "allreduce"},
        "workload": {"tokens_per_rank": tokens},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": SEQ, "vocab_size": 128,
                        "moe_every": 2, "optimizer": "sgd"},
        "run": {"steps": 3, "warmup_steps": 1, "output_dir": str(tmp_path), "learning_rate": 0.05},
    })


class JoinedTask:
    """GPU g of the unsplit run holds the tokens of the split run's ranks 2g and 2g + 1."""

    def __init__(self, split: Scenario):
        self.task = TokenTask(split)

    def batch(self, step: int, rank: int):
        parts = [self.task.batch(step, 2 * rank + i) for i in range(2)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared")
    split = scenario(tmp, nodes=2, tp=2, tokens=SEQ // 2)
    whole = scenario(tmp, nodes=1, tp=1, tokens=SEQ)
    result = RealBackend().run(split, debug={"capture": True})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "TokenTask", lambda s: JoinedTask(split))
        ref = reference.reference_run(whole)
    return split, whole, result, ref, tmp


@pytest.mark.slow
def test_half_a_sequence_per_gpu_computes_what_whole_sequences_do(runs, float_bound):
    """Every step's loss and every rank's output rows; the first step's gradients of the
    routed experts, the routers and every dense weight (each TP rank's shard of it, summed
    over its DP peers), against the unsplit run's."""
    split, whole, result, ref, _ = runs
    n = float_bound.chain(whole)
    assert float_bound.chain(split) == n  # the same tokens through the same layers
    assert [rec.loss for rec in result.records] == [float_bound.approx(want["loss"], n) for want in ref]
    first = ref[0]
    for rank, cap in enumerate(result.captured):
        group, half = divmod(rank, 2)  # TP group g = ranks 2g, 2g + 1: GPU g of the unsplit run
        rows = slice(half * (SEQ // 2), (half + 1) * (SEQ // 2))
        for step, out in enumerate(cap["outputs"]):
            float_bound.assert_close(out, ref[step]["outputs"][group][rows], n, msg=f"rank {rank} step {step}")
        assert cap["expert_grads"]  # every rank holds experts: its replica's summed gradients
        for inst, grad in cap["expert_grads"].items():
            float_bound.assert_close(grad, first["expert_grads"][inst], n, msg=f"expert {inst}")
        assert cap["named_grads"].keys() == first["named_grads"].keys()
        sharded = 0
        for name, grad in cap["named_grads"].items():
            want = first["named_grads"][name]
            split_dims = [d for d in range(want.dim()) if grad.shape[d] != want.shape[d]]
            if split_dims:  # this rank's half of the weight (heads, FFN columns or rows, vocabulary)
                want, sharded = shard(want, split_dims[0], half, 2), sharded + 1
            float_bound.assert_close(grad, want, n, msg=f"rank {rank} {name}")
        assert sharded >= 8  # Q, K, V, O and the FFN's two of each block, the embedding, the head


@pytest.mark.slow
def test_half_a_sequence_per_gpu_and_its_replay_move_the_same_bytes(runs):
    """The simulator replays the split run's routing: the tensor-parallel gathers and
    reduce-scatters of the group's sequence, the token exchange of each GPU's half, the
    syncs: the same bytes per stage and per link level."""
    split, _, result, _, tmp = runs
    result.routing.save(tmp)
    real = summarize(result.records, split.run.warmup_steps)
    replay = run_scenario(split.replace(workload={"trace": str(tmp)}), "sim")
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    assert real["bytes_by_level"] == replay["bytes_by_level"]
    assert real["bytes_by_stage"]["dense"] > 0 and real["bytes_by_stage"]["dispatch"] > 0


def test_the_split_run_is_megatrons_batch_of_two_sequences(tmp_path):
    """The split run as Megatron-Core states it: 2 sequences a step over DP = 4 GPUs / TP 2,
    one each micro-batch of 1: each GPU routes 32 / 2 = 16 tokens; both backends take it."""
    split = scenario(tmp_path, nodes=2, tp=2, tokens=SEQ // 2)
    data = split.to_dict()
    del data["workload"]["tokens_per_rank"]
    data["workload"].update(global_batch=2, micro_batch_size=1)
    batch = Scenario.from_dict(data)
    assert batch.replace(workload={"global_batch": 0, "tokens_per_rank": SEQ // 2}) == split
    assert (batch.workload.tokens_per_rank, batch.transformer.micro_batches) == (SEQ // 2, 1)
    RealBackend().check(batch)
