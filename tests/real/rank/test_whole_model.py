"""The real backend's whole transformer (issue 13, ``transformer.enabled``): attention and
dense layers around the MoE layers, embeddings and a cross-entropy loss, trained with
mixed-precision Adam on data x expert parallel CPU ranks; against the simulator's replay
of the same routing (bytes and memory), Adam against torch's, and a killed run resumed."""

import pytest
import torch

from real.backend import RealBackend
from real.kernels.adam import MixedAdam
from testbed.core.errors import RunError, ScenarioError
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario


def scenario(tmp_path, **sections):
    """4 CPU ranks (2 nodes of 2), EP 2 x 2 replicas; two MoE layers, each after a dense
    layer (moe_every 2), grouped-query attention over sequences of 32 tokens; paged experts."""
    d = {
        "model": {"hidden_size": 32, "ffn_hidden_size": 64, "num_layers": 2, "num_experts": 4},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": 32, "vocab_size": 256,
                        "moe_every": 2, "adam_learning_rate": 3e-3},
        "pager": {"page_size_bytes": "4KiB", "gpu_budget_bytes": "48KiB"},
        "comm": {"expert_sync": "two_stage", "grad_bucket_bytes": 100_000},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 6, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")},
        "real": {"check_weights": True},  # the pages checked against an unpaged copy every step
    }
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return Scenario.from_dict(d)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    s = scenario(tmp)
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    return s, real, replay


@pytest.mark.slow
def test_real_whole_model_and_its_replay_move_the_same_bytes(runs):
    """The dense gradients (attention, dense FFN, embedding and head, in the routers'
    buckets) are summed over all ranks as the planner costs them; everything else too."""
    s, real, replay = runs
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    assert real["bytes_by_level"] == replay["bytes_by_level"]
    assert real["page_moves_per_step"] == replay["page_moves_per_step"] > 0
    ring = 2 * (s.world_size - 1)  # a ring all-reduce: each rank sends 2 (n-1)/n of the buffer
    block = (2 * 3072 + 2 * 32 * 128) * 4  # 2 attentions (Q, O 32 x 32; K, V 32 x 16) + 1 dense FFN, fp32
    assert real["bytes_by_stage"]["dense_sync"] >= ring * 2 * block  # 2 layers' blocks, embeddings on top


def test_memory_breakdown_measured_against_simulated(runs):
    """Weights, gradients, Adam state (12 bytes per parameter), expert pages and the
    largest collective buffers are the same bytes on both; activations: what autograd
    saved against Korthikanti et al.'s per-layer formula (34 s b H, flash attention),
    within 25%."""
    _, real, replay = runs
    got, model = real["memory_breakdown_bytes"], replay["memory_breakdown_bytes"]
    for part in ("expert_pages", "parameters", "gradients", "optimizer_state", "comm_buffers"):
        assert got[part] == model[part] > 0, part
    assert got["optimizer_state"] == 3 * got["parameters"] + 12 * (2 * 2 * 2 * 32 * 64)  # + 4 local experts, fp32
    assert got["activations"] == pytest.approx(model["activations"], rel=0.25)


def test_dense_stages_are_timed_and_the_model_learns(runs):
    _, real, _ = runs
    for stage in ("dense", "dense_backward", "dense_sync", "optimizer"):
        assert real["stage_time_s"][stage] > 0, stage
    assert real["loss_last"] < real["loss_first"]  # Adam on the next-token map
    assert real["mfu"] > 0 and real["tokens_per_s_per_gpu"] > 0


@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_adam_matches_torch(tmp_path, decay):
    """MixedAdam's master weights follow torch.optim.AdamW (Adam without decay) step by step."""
    s = scenario(tmp_path).replace(transformer={"adam_learning_rate": 0.01, "adam_beta2": 0.95,
                                                "adam_weight_decay": decay})
    g = torch.Generator().manual_seed(3)
    w = torch.randn(50, generator=g)
    ours = MixedAdam(s)
    ours.add("w", w)
    ref = w.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=decay)
    for _ in range(5):
        grad = torch.randn(50, generator=g)
        new = ours.step("w", grad)
        ref.grad = grad.clone()
        opt.step()
        assert torch.allclose(new, ref.detach(), rtol=1e-6, atol=1e-7)
    assert ours.nbytes == 12 * 50


@pytest.mark.slow
def test_killed_whole_model_run_resumes_bit_identically(tmp_path):
    """Dense weights and the Adam state are in the optimizer checkpoints: a run killed
    after 5 steps and resumed from the checkpoint at 4 continues as the run never stopped."""
    s = scenario(tmp_path, checkpoint={"enabled": True, "optimizer_interval": 2, "expert_interval": 4},
                 run={"steps": 6}, real={"check_weights": False})
    straight = RealBackend().run(s, run_dir=tmp_path / "straight", debug={"capture": True})
    with pytest.raises(RunError, match="rank 2 died"):
        RealBackend().run(s, run_dir=tmp_path / "killed", debug={"fail_at": {"rank": 2, "after_steps": 5}})
    resumed = RealBackend().run(s, run_dir=tmp_path / "killed", resume=True, debug={"capture": True})
    first = resumed.extra["resumed_from"]
    assert first in (2, 4)
    for a, b in zip(straight.records[first:], resumed.records, strict=True):
        assert (a.step, a.loss, a.bytes_by_stage) == (b.step, b.loss, b.bytes_by_stage)
    for ca, cb in zip(straight.captured, resumed.captured, strict=True):
        for inst, w in ca["final_experts"].items():
            assert torch.equal(w, cb["final_experts"][inst]), inst


@pytest.mark.parametrize("over, field", [
    ({"parallelism": {"pp_size": 2}, "pager": {"enabled": False}}, "comm.expert_sync"),  # two-stage's cached groups
    ({"parallelism": {"pp_size": 2}, "pager": {"enabled": False}, "comm": {"expert_sync": "allreduce"},
      "transformer": {"tied_embeddings": True}}, "transformer.tied_embeddings"),
    ({"parallelism": {"pp_size": 2, "pp_chunks": 2}, "pager": {"enabled": False}, "transformer": {"micro_batches": 2},
      "model": {"num_layers": 4}}, "parallelism.pp_chunks"),
    ({"transformer": {"micro_batches": 2}, "pager": {"enabled": False}}, "transformer.micro_batches"),
    ({"transformer": {"zero_stage": 1}}, "transformer.zero_stage"),
    ({"transformer": {"recompute": "full"}}, "transformer.recompute"),
    ({"transformer": {"optimizer_state_bytes": 16}}, "transformer.optimizer_state_bytes"),
])
def test_what_only_the_simulator_models_is_refused(tmp_path, over, field):
    s = scenario(tmp_path, **over)  # a valid scenario: the simulator runs it
    with pytest.raises(ScenarioError) as err:
        RealBackend().check(s)
    assert field in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_tensor_parallel_ranks_compute_what_whole_ones_do(tmp_path, sequence_parallel, float_bound):
    """TP = 2 (groups {0, 1} and {2, 3}, each a node) with or without sequence parallelism,
    and a split vocabulary: the same losses as TP = 1 (to float rounding), and its replay moves
    the same bytes per stage and level - the tensor-parallel all-gathers and
    reduce-scatters of every sublayer, the embedding and the head, and the dense
    gradients summed per shard over its peers - and holds the same memory."""
    base = scenario(tmp_path, run={"steps": 3}, real={"check_weights": False}, pager={"enabled": False})
    whole = run_scenario(base, "real")
    # with the gradient sync issued from the backward (M22): the shards' buckets as they fill
    tp = base.replace(parallelism={"tp_size": 2, "sequence_parallel": sequence_parallel},
                      overlap={"sync_with_backward": True})
    split = run_scenario(tp, "real")
    n = float_bound.chain(tp)  # the shards sum their parts in another order
    assert split["loss_first"] == float_bound.approx(whole["loss_first"], n)
    assert split["loss_last"] == float_bound.approx(whole["loss_last"], n)
    replay = run_scenario(tp.replace(workload={"trace": split["run_dir"]}), "sim")
    assert split["bytes_by_stage"] == replay["bytes_by_stage"]
    assert split["bytes_by_level"] == replay["bytes_by_level"]
    assert split["bytes_by_stage"]["dense"] > 0 and whole["bytes_by_stage"]["dense"] == 0
    assert split["bytes_by_stage"]["dense_sync"] < whole["bytes_by_stage"]["dense_sync"]  # shards over 2 peers
    got, model = split["memory_breakdown_bytes"], replay["memory_breakdown_bytes"]
    for part in ("expert_pages", "parameters", "gradients", "optimizer_state"):
        assert got[part] == model[part] > 0, part
    assert got["parameters"] < whole["memory_breakdown_bytes"]["parameters"]


@pytest.mark.slow
def test_the_shipped_whole_model_config_runs_on_both_backends(tmp_path, repo_root):
    """configs/whole-cpu.toml (TP 2 x EP 2, paged experts, Adam) for 4 steps: the real run
    learns and its replay moves the same bytes."""
    from testbed.scenario.file import load_scenario

    s = load_scenario(repo_root / "configs" / "whole-cpu.toml").replace(
        run={"steps": 4, "warmup_steps": 1, "output_dir": str(tmp_path)})
    real = run_scenario(s, "real")
    assert real["loss_last"] < real["loss_first"]
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    assert real["bytes_by_stage"] == replay["bytes_by_stage"] and real["bytes_by_stage"]["dense"] > 0


@pytest.mark.slow
def test_pipeline_stages_compute_what_one_stage_does(tmp_path, float_bound):
    """PP = 2 on 4 ranks (stage 0: ranks 0-1 with layers 0-1 and the embedding; stage 1:
    ranks 2-3 with layers 2-3 and the head), one micro-batch a step: the same losses and
    bytes per stage as the whole model on 2 ranks, its activations and their gradients
    sent between the stages (T x H fp32 each way per rank pair). The simulator's pipeline
    of the same scenario: one stage simulated, the other taken to be like it - its token
    traffic within 20% of the real stages', the same sends, and the 1F1B bubble of one
    micro-batch (at least half the step on the stage without the head)."""
    common = dict(run={"steps": 3}, real={"check_weights": False}, pager={"enabled": False},
                  comm={"expert_sync": "allreduce"}, model={"num_layers": 4})
    whole = RealBackend().run(scenario(tmp_path, cluster={"nodes_per_microcluster": 1}, **common))
    s = scenario(tmp_path, parallelism={"pp_size": 2}, **common)
    staged = RealBackend().run(s)
    for a, b in zip(whole.records, staged.records, strict=True):
        assert a.loss == float_bound.approx(b.loss, float_bound.chain(s)) and a.bytes_by_stage == b.bytes_by_stage
        assert b.extra["pipeline_sent_bytes"] == 4 * 64 * 32 * 4
    sim = run_scenario(s, "sim")
    real_dispatch = staged.records[-1].bytes_by_stage["dispatch"]
    assert sim["bytes_by_stage"]["dispatch"] == pytest.approx(real_dispatch, rel=0.2)
    assert sim["pipeline"]["send_bytes_per_gpu"] == 64 * 32 * 4
    assert sim["pipeline"]["bubble_fraction"] >= 0.5


@pytest.mark.slow
def test_killed_pipeline_run_resumes_bit_identically(tmp_path):
    """PP = 2: each rank of each stage checkpoints into its own folder (its global rank);
    a run killed after 3 steps continues from the checkpoint at 2 as the run never stopped."""
    s = scenario(tmp_path, parallelism={"pp_size": 2}, pager={"enabled": False}, comm={"expert_sync": "allreduce"},
                 model={"num_layers": 4}, run={"steps": 4}, real={"check_weights": False},
                 checkpoint={"enabled": True, "optimizer_interval": 2, "expert_interval": 2})
    straight = RealBackend().run(s, run_dir=tmp_path / "straight", debug={"capture": True})
    with pytest.raises(RunError, match="rank 3 died"):
        RealBackend().run(s, run_dir=tmp_path / "killed", debug={"fail_at": {"rank": 3, "after_steps": 3}})
    resumed = RealBackend().run(s, run_dir=tmp_path / "killed", resume=True, debug={"capture": True})
    first = resumed.extra["resumed_from"]
    assert first == 2
    for a, b in zip(straight.records[first:], resumed.records, strict=True):
        assert (a.step, a.loss, a.bytes_by_stage) == (b.step, b.loss, b.bytes_by_stage)
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == [f"rank{r}" for r in range(4)]
