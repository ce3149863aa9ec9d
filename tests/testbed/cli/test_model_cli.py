"""``testbed model SPEC`` as a user meets it: a preset's card as JSON, the presets listed, a
config.json read, a bad SPEC one line with exit code 2."""

import json
import subprocess
import sys


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "testbed.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_model_deepseek_v3_json(tmp_path):
    out = run_cli("model", "deepseek-v3", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    card = json.loads(out.stdout)
    assert (card["spec"], card["kind"], card["seq_len"], card["layers"], card["moe_layers"]) == (
        "deepseek-v3", "preset", 4096, 61, 58)
    p = card["params"]
    assert abs(p["total_without_mtp"] / 671e9 - 1) < 0.01  # "671B total parameters"
    assert 36.5e9 <= p["active"] < 37.5e9  # "37B activated for each token"
    assert p["total"] - p["total_without_mtp"] == p["by_component"]["mtp"] > 0
    assert card["megatron_flops_per_token"] == 259992950784.0  # Megatron-LM's count (test_model_card.py)
    assert card["dispatch_bytes_per_token_per_moe_layer"] == 8 * 7168 * 2
    assert card["expert_weight_bytes"] == 3 * 7168 * 2048 * 2
    assert card["forward_flops_per_token"] > card["forward_flops_per_token_without_mtp"]


def test_model_list_text_and_a_config_json(tmp_path, repo_root):
    listed = run_cli("model", "--list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()][:3] == ["deepseek-v2", "deepseek-v3",
                                                                            "gpt-oss-120b"]
    config = repo_root / "tests/testbed/scenario/hf_configs/gpt-oss-120b.json"
    text = run_cli("model", str(config), "--seq-len", "8192", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "total 116.83B" in text.stdout and "active 5.13B" in text.stdout and "seq_len 8192" in text.stdout


def test_a_bad_spec_is_one_line_and_exit_code_2(tmp_path):
    for args in (("model", "gpt-5"), ("model",), ("model", "mixtral-8x7b", "--seq-len", "0"),
                 ("model", "mixtral-8x7b", "--set", "model.top_k=9")):
        out = run_cli(*args, cwd=tmp_path)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("testbed: error:"), out.stderr
