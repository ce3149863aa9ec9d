"""The models people train (issue 24) on both backends: the small CPU configs
(configs/deepseek-like-cpu.toml: SwiGLU, a shared expert, a dense-first layer, MLA, MTP and
DeepSeek-V3's router; configs/qwen-like-cpu.toml: head_dim, Q/K/V biases, SwiGLU, a gated
shared expert) learn on the real backend, and each feature family's real run and its
simulator replay count the same bytes per stage and per link level (the central invariant,
tests/test_cross_backend.py)."""

import pytest

from testbed.run.features import check_features, used_features
from testbed.run.routing_trace import RoutingTrace
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario


def replay_of(real: dict, s: Scenario) -> dict:
    """The simulator's replay of the real run's routing (every feature here is modelled by
    both backends: a refusal fails the test)."""
    check_features(s, "sim")
    return run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")


def assert_same_bytes(real: dict, replay: dict) -> None:
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    assert real["bytes_by_level"] == replay["bytes_by_level"]
    assert real["page_moves_per_step"] == replay["page_moves_per_step"]
    assert real["dropped_token_fraction"] == replay["dropped_token_fraction"]


def deepseek_like(repo_root, tmp_path, **over):
    return load_scenario(repo_root / "configs" / "deepseek-like-cpu.toml").replace(
        run={"output_dir": str(tmp_path)}, **over)


@pytest.mark.slow
def test_the_deepseek_like_config_learns_on_the_real_backend(tmp_path, repo_root):
    """Its MTP module's MoE layer is one more MoE layer of the real run's (``real.rank.mtp``):
    its routing is in the trace, its tokens exchanged, its experts paged and synced."""
    s = deepseek_like(repo_root, tmp_path)
    assert {"model.ffn_activation", "model.shared_experts", "transformer.first_dense_layers", "transformer.attention",
            "transformer.mtp_layers", "router.score", "router.expert_groups"} <= set(used_features(s))
    real = run_scenario(s, "real")
    assert real["loss_last"] < real["loss_first"]
    trace = RoutingTrace.load(real["run_dir"]).routed
    assert trace.shape[1] == s.model.num_layers + s.transformer.mtp_layers
    assert real["bytes_by_stage"]["dense_sync"] > 0 and real["page_moves_per_step"] > 0


@pytest.mark.slow
def test_the_deepseek_like_config_and_its_replay_move_the_same_bytes(tmp_path, repo_root):
    """Every feature with the MTP module: the simulator plans its MoE layer as the real
    ranks do (``testbed.model.mtp_layers``), so the replay routes, exchanges, pages and
    syncs it from the trace, and its projection's and attention's gradients are in the
    last bucket with the head's on both backends."""
    s = deepseek_like(repo_root, tmp_path)
    real = run_scenario(s, "real")
    assert_same_bytes(real, replay_of(real, s))


@pytest.mark.slow
def test_the_deepseek_like_config_without_mtp_and_its_replay_move_the_same_bytes(tmp_path, repo_root):
    """SwiGLU, the shared expert, the dense-first layer, MLA and V3's router, on both backends."""
    s = deepseek_like(repo_root, tmp_path, transformer={"mtp_layers": 0})
    real = run_scenario(s, "real")
    assert real["loss_last"] < real["loss_first"]
    assert_same_bytes(real, replay_of(real, s))


@pytest.mark.slow
def test_the_qwen_like_config_on_both_backends(tmp_path, repo_root):
    s = load_scenario(repo_root / "configs" / "qwen-like-cpu.toml").replace(run={"output_dir": str(tmp_path)})
    assert {"model.ffn_activation", "model.shared_experts", "transformer.head_dim",
            "transformer.attention_bias"} <= set(used_features(s))
    real = run_scenario(s, "real")
    assert real["loss_last"] < real["loss_first"]
    assert real["page_moves_per_step"] > 0 and real["bytes_by_stage"]["expert_sync"] > 0
    assert_same_bytes(real, replay_of(real, s))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["ffn", "attention"])
def test_each_feature_family_and_its_replay_move_the_same_bytes(tmp_path, family):
    """4 ranks (2 nodes of 2), EP 2 x 2: ``ffn`` the MoE stack with SwiGLU experts and two
    gated shared experts of their own width (their gradients in the routers' buckets);
    ``attention`` the whole transformer with head_dim, biases on Q, K, V and O, a
    dense-first layer and SwiGLU dense FFNs (moe_every 2)."""
    d = {
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2,
                  "ffn_activation": "swiglu", "shared_experts": 2, "shared_ffn_hidden_size": 40,
                  "shared_expert_gate": True},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": "4KiB", "gpu_budget_bytes": "40KiB"},
        "comm": {"expert_sync": "two_stage"},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 4, "warmup_steps": 1, "output_dir": str(tmp_path)},
    }
    if family == "attention":
        d["model"].update(shared_experts=1, shared_ffn_hidden_size=0)
        d["transformer"] = {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "head_dim": 12, "seq_len": 32,
                            "vocab_size": 256, "attention_bias": "all", "first_dense_layers": 1, "moe_every": 2,
                            "dense_ffn_hidden_size": 40}
    s = Scenario.from_dict(d)
    real = run_scenario(s, "real")
    assert real["page_moves_per_step"] > 0
    assert_same_bytes(real, replay_of(real, s))
