"""Shared experts under tensor parallelism on real CPU ranks (``real.rank.shared_experts``):
split over each TP group as Megatron-Core's SharedExpertMLP, an MLP split as a dense FFN
(w1's columns, SwiGLU's gate and up alike, and w2's rows), on the group's rows with sequence
parallelism (the input all-gathered, the partial outputs reduce-scattered).

4 ranks in 2 nodes, EP 2, TP 2 (groups {0, 1} and {2, 3}) against TP 1 on the same ranks:
each rank draws the same tokens (``real.kernels.task.TokenTask``, by rank) and holds whole
sequences either way (32 tokens, sequences of 16), so every step's loss, and every shared
weight's first-step gradient (summed over the ranks of one TP index: each rank's shard of
the unsplit run's), are the same in exact arithmetic; held to the float bound of
tests/conftest.py. The simulator's replay of the split run's routing moves the same bytes
per stage and per link level: the plan's shared-expert collectives
(``testbed.policy.tensor_parallel_ops.shared_expert_parts``) and gradient sums.
"""

import pytest
import torch

from real.backend import RealBackend
from real.comm.tensor_parallel import shard
from real.rank.dense_model import TensorGroup
from real.rank.shared_experts import SharedExperts
from testbed.core.errors import ScenarioError
from testbed.run.results import summarize
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

SHARED_FFN = 40  # the shared experts' width: of their own, split 20 + 20


def scenario(tmp_path, **over) -> Scenario:
    """4 CPU ranks in nodes of 2, EP 2; 4 SwiGLU experts of F 48 in 2 MoE layers, H 32, two
    SwiGLU shared experts of F 40; a dense FFN in each block; plain SGD."""
    d = {
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2,
                  "ffn_activation": "swiglu", "shared_experts": 2, "shared_ffn_hidden_size": SHARED_FFN},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2, "sequence_parallel": True},
        "router": {"capacity_factor": 1.0},
        "pager": {"enabled": False},
        "comm": {"expert_sync": "allreduce"},
        "workload": {"tokens_per_rank": 32},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": 16, "vocab_size": 128,
                        "moe_every": 2, "dense_ffn_hidden_size": 40, "optimizer": "sgd"},
        "run": {"steps": 3, "warmup_steps": 0, "output_dir": str(tmp_path), "learning_rate": 0.05},
    }
    for name, values in over.items():
        d.setdefault(name, {}).update(values)
    return Scenario.from_dict(d)


def want_shard(name: str, whole: torch.Tensor, index: int) -> torch.Tensor:
    """TP index ``index``'s half of an unsplit shared weight: w1's columns (the gate's and
    the up's halves alike, side by side), w2's rows."""
    if name.endswith(".w2"):
        return shard(whole, 0, index, 2)
    gate, up = whole[:, :SHARED_FFN], whole[:, SHARED_FFN:]
    return torch.cat([shard(gate, 1, index, 2), shard(up, 1, index, 2)], dim=1)


def test_each_tp_rank_holds_its_half_of_the_whole_weights(tmp_path):
    """The split run's shards are cut from the unsplit run's weights: w1's columns of the
    gate and of the up, w2's rows; a width the group does not divide is refused."""
    s = scenario(tmp_path, parallelism={"tp_size": 2})
    whole = SharedExperts(s, 2, torch.float32, torch.device("cpu"))
    for index in range(2):
        tp = TensorGroup(2, index, (0, 1), group=None, comm=None)
        split = SharedExperts(s, 2, torch.float32, torch.device("cpu"), tp=tp)
        for layer in range(2):
            for name, w in split.named_layer_params(layer):
                full = dict(whole.named_layer_params(layer))[name]
                assert torch.equal(w, want_shard(name, full, index)), name
    with pytest.raises(ScenarioError, match="model.shared_ffn_hidden_size"):
        SharedExperts(scenario(tmp_path, model={"shared_ffn_hidden_size": 41}), 2, torch.float32,
                      torch.device("cpu"), tp=TensorGroup(2, 0, (0, 1), group=None, comm=None))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared_tp")
    whole = scenario(tmp)
    split = whole.replace(parallelism={"tp_size": 2})
    return tmp, whole, split, RealBackend().run(whole, debug={"capture": True}), \
        RealBackend().run(split, debug={"capture": True})


@pytest.mark.slow
def test_split_shared_experts_compute_what_whole_ones_do(runs, float_bound):
    """Every step's loss; the first step's gradient of every shared weight, each TP rank's
    half of the unsplit run's."""
    _, whole, _, a, b = runs
    n = float_bound.chain(whole)
    assert [rec.loss for rec in b.records] == [float_bound.approx(rec.loss, n) for rec in a.records]
    for rank, (cap_a, cap_b) in enumerate(zip(a.captured, b.captured, strict=True)):
        shared = [k for k in cap_a["named_grads"] if k.startswith("shared")]
        assert len(shared) == 2 * 2 * 2  # 2 layers x 2 experts x (w1, w2)
        for name in shared:
            got, full = cap_b["named_grads"][name], cap_a["named_grads"][name]
            assert got.numel() * 2 == full.numel(), name
            float_bound.assert_close(got, want_shard(name, full, rank % 2), n, msg=f"rank {rank} {name}")


@pytest.mark.slow
def test_split_shared_experts_and_their_replay_move_the_same_bytes(runs):
    """The simulator replays the split run's routing: the same bytes per stage and per link
    level, the shared experts' gathers and reduce-scatters in the dense stages."""
    tmp, whole, split, a, b = runs
    b.routing.save(tmp)
    real = summarize(b.records, split.run.warmup_steps)
    replay = run_scenario(split.replace(workload={"trace": str(tmp)}), "sim")
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    assert real["bytes_by_level"] == replay["bytes_by_level"]
    # the split FFNs' gradients sum over the peers of one TP index, with the dense shards'
    assert real["bytes_by_stage"]["dense"] > summarize(a.records, 0)["bytes_by_stage"].get("dense", 0.0)


@pytest.mark.slow
def test_recomputed_split_shared_experts_compute_and_move_the_same(runs, float_bound):
    """``recompute_modules = "shared_experts"``: the FFNs on the gathered rows run again in
    the backward, the collectives once: the same losses and the same bytes as without."""
    tmp, whole, split, _, b = runs
    again = RealBackend().run(split.replace(transformer={"recompute_modules": "shared_experts"},
                                            overlap={"shared_experts": False}))  # Megatron-Core: not with both
    n = float_bound.chain(whole)
    assert [rec.loss for rec in again.records] == [float_bound.approx(rec.loss, n) for rec in b.records]
    assert (summarize(again.records, 0)["bytes_by_stage"] == summarize(b.records, 0)["bytes_by_stage"])


@pytest.mark.parametrize("over, field", [
    ({"parallelism": {"tp_size": 2, "sequence_parallel": False}}, "model.shared_experts"),
    ({"parallelism": {"tp_size": 2}, "model": {"shared_expert_gate": True}}, "model.shared_expert_gate"),
])
def test_what_the_split_does_not_run_is_refused(tmp_path, over, field):
    """Without sequence parallelism (the plan all-reduces their output on replicated rows the
    MoE layer does not get) and with the gate (whose gradient the plan does not sum over the
    group) the backend refuses, naming the field."""
    with pytest.raises(ScenarioError) as err:
        RealBackend().check(scenario(tmp_path, **over))
    assert field in str(err.value)


def test_split_shared_experts_pass_the_check(tmp_path):
    RealBackend().check(scenario(tmp_path, parallelism={"tp_size": 2}))
