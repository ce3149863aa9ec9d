"""Model presets (configs/models/NAME.toml) and config.json import (testbed/scenario/presets.py,
hf_config.py): a preset's or config's fields fill [model], [transformer] and [router] where the
scenario leaves them out, every family's config.json gives the model of its preset, and a key
the importer does not know, or a feature the testbed does not model, is refused by name."""

import copy
import json
from pathlib import Path

import pytest

from testbed.core.errors import ScenarioError
from testbed.scenario import hf_config, presets
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario

CONFIGS = Path(__file__).parent / "hf_configs"

#: each preset that follows a config.json, and the file
PRESET_CONFIGS = {
    "deepseek-v3": "deepseek-v3.json",
    "deepseek-v2": "deepseek-v2.json",
    "qwen3-235b-a22b": "qwen3-235b-a22b.json",
    "qwen3-30b-a3b": "qwen3-30b-a3b.json",
    "mixtral-8x7b": "mixtral-8x7b-v0.1.json",
    "mixtral-8x22b": "mixtral-8x22b-v0.1.json",
    "qwen2-57b-a14b": "qwen2-57b-a14b.json",
    "gpt-oss-120b": "gpt-oss-120b.json",
    "olmoe-1b-7b": "olmoe-1b-7b-0924.json",
}


def resolved(model: dict, **tables) -> dict:
    """The resolved scenario of a [model] table (and others), its preset / config named out."""
    out = Scenario.from_dict({"model": model, **tables}).to_dict()
    out["model"].pop("preset")
    out["model"].pop("config")
    return out


def config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def write(tmp_path, cfg: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_every_preset_ships_with_a_header_citing_its_source():
    assert presets.preset_names() == sorted([*PRESET_CONFIGS, "megascale-352b"])
    for name in presets.preset_names():
        text = presets.preset_path(name).read_text()
        assert text.startswith("# ") and "Readings:" in text, name
        assert "config.json" in text or "arXiv" in text, name


@pytest.mark.parametrize("preset, file", sorted(PRESET_CONFIGS.items()))
def test_each_familys_config_json_imports_to_the_model_of_its_preset(preset, file):
    from_preset = resolved({"preset": preset})
    from_config = resolved({"config": str(CONFIGS / file)})
    assert from_config == from_preset
    assert from_preset != resolved({})  # the preset changed the model


def test_what_the_scenario_states_wins():
    s = Scenario.from_dict({"model": {"preset": "deepseek-v3", "num_layers": 4, "dtype": "fp32"},
                            "transformer": {"mtp_layers": 0, "enabled": True, "seq_len": 128},
                            "router": {"capacity_factor": 1.25},
                            "workload": {"tokens_per_rank": 256}})
    assert (s.model.num_layers, s.model.dtype, s.transformer.mtp_layers, s.router.capacity_factor) == (
        4, "fp32", 0, 1.25)  # stated
    assert (s.model.hidden_size, s.model.num_experts, s.transformer.first_dense_layers, s.router.score) == (
        7168, 256, 3, "sigmoid")  # the preset's
    assert s.model.preset == "deepseek-v3"
    # --set on a scenario file: the same rule
    o = load_scenario(None, ["model.preset=mixtral-8x7b", "model.top_k=1"])
    assert (o.model.top_k, o.model.num_experts, o.transformer.num_kv_heads) == (1, 8, 8)


def test_a_resolved_scenario_reads_back_the_same():
    s = Scenario.from_dict({"model": {"preset": "gpt-oss-120b"}, "router": {"aux_loss_coef": 0.01}})
    again = Scenario.from_dict(s.to_dict())
    assert again == s
    assert again.router.aux_loss_coef == 0.01 and again.transformer.sliding_window == 128


def test_a_preset_or_config_that_cannot_be_used_is_named(tmp_path):
    with pytest.raises(ScenarioError, match=r"model.preset = 'nope': no such preset \(deepseek-v2, deepseek-v3"):
        Scenario.from_dict({"model": {"preset": "nope"}})
    with pytest.raises(ScenarioError, match="give model.preset or model.config, not both"):
        Scenario.from_dict({"model": {"preset": "mixtral-8x7b", "config": str(CONFIGS / "mixtral-8x7b-v0.1.json")}})
    with pytest.raises(ScenarioError, match="model.config = .*missing.json.*no such file"):
        Scenario.from_dict({"model": {"config": str(tmp_path / "missing.json")}})
    (tmp_path / "bad.toml").write_text('[model]\nhidden_size = 64\n[comm]\ntoken_strategy = "allgather"\n')
    with pytest.raises(ScenarioError, match=r"holds \[comm\]: a preset gives only the tables model, transformer"):
        presets.load_preset("bad", directory=tmp_path)


def test_an_unknown_key_is_refused_naming_it(tmp_path):
    cfg = config("mixtral-8x7b-v0.1.json")
    cfg["expert_dropout"] = 0.1
    with pytest.raises(ScenarioError, match=r"model.config = .*: mixtral config.json: unknown key 'expert_dropout'"):
        Scenario.from_dict({"model": {"config": write(tmp_path, cfg)}})


@pytest.mark.parametrize("file, change, refused", [
    ("qwen3-30b-a3b.json", {"use_sliding_window": True}, "use_sliding_window = True: Qwen's sliding window"),
    ("mixtral-8x7b-v0.1.json", {"sliding_window": 4096}, "sliding_window = 4096: Mistral's sliding window"),
    ("mixtral-8x7b-v0.1.json", {"hidden_act": "gelu"}, "hidden_act = 'gelu': an FFN activation other than SiLU"),
    ("deepseek-v3.json", {"moe_layer_freq": 2}, "moe_layer_freq = 2: an MoE layer other than every layer"),
    ("deepseek-v3.json", {"topk_method": "random"}, "topk_method = 'random'"),
    ("gpt-oss-120b.json", {"layer_types": ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"] * 32},
     "layer_types: only a whole-sequence layer every n"),
    ("qwen2-57b-a14b.json", {"mlp_only_layers": [3, 7]}, r"mlp_only_layers = \[3, 7\]: only leading dense"),
    ("olmoe-1b-7b-0924.json", {"model_type": "llama"}, "model_type = 'llama': a supported family is one of"),
    ("olmoe-1b-7b-0924.json", {"hidden_size": "2048"}, "hidden_size = '2048': expected int"),
])
def test_an_unsupported_feature_is_refused_naming_it(tmp_path, file, change, refused):
    cfg = {**config(file), **change}
    with pytest.raises(ScenarioError, match=refused) as e:
        Scenario.from_dict({"model": {"config": write(tmp_path, cfg)}})
    assert e.value.field == "model.config" and "\n" not in str(e.value)


def test_a_missing_key_is_named():
    cfg = config("qwen3-235b-a22b.json")
    del cfg["num_experts"]
    with pytest.raises(ScenarioError, match="qwen3_moe config.json: has no num_experts"):
        hf_config.config_sections(cfg)


def test_leading_dense_layers_and_a_sparse_step_are_read_as_the_testbed_counts_them():
    """Qwen-MoE: mlp_only_layers [0, 1] = two dense layers first; decoder_sparse_step 2 = layers
    1, 3, ... MoE (HF (i + 1) % step == 0), the testbed's moe_every."""
    dense_first = hf_config.config_sections({**config("qwen3-30b-a3b.json"), "mlp_only_layers": [0, 1]})
    assert (dense_first["model"]["num_layers"], dense_first["transformer"]["first_dense_layers"]) == (46, 2)
    every_other = hf_config.config_sections({**config("qwen3-30b-a3b.json"), "decoder_sparse_step": 2})
    assert (every_other["model"]["num_layers"], every_other["transformer"]["moe_every"]) == (24, 2)


def test_keys_that_change_neither_time_nor_memory_are_listed_with_a_reason():
    """Each key the shipped configs hold but the importer does not read is in IGNORED, with
    why; a new key is refused rather than dropped (the unknown-key test)."""
    assert all(reason.strip() for reason in hf_config.IGNORED.values())
    cfg = copy.deepcopy(config("deepseek-v3.json"))
    for key in ("rope_theta", "rope_scaling", "torch_dtype", "bos_token_id", "eos_token_id", "ep_size"):
        assert key in hf_config.IGNORED
        cfg.pop(key)
    assert hf_config.config_sections(cfg) == hf_config.config_sections(config("deepseek-v3.json"))
