"""``testbed plan`` end to end on a tiny model (``testbed.cli.plan``): the JSON result, the page,
CSV and JSON it writes, and one-line errors for bad input."""

from __future__ import annotations

import csv
import json

from testbed.cli.main import main

#: a Mixtral-family config.json of 4 layers of 4 experts (H 256, F 512), top-2 (as tests/testbed/study/test_plan.py)
TINY = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 4, "num_local_experts": 4, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 1000, "sliding_window": None, "router_jitter_noise": 0.0}


def _plan(tmp_path, *extra):
    config = tmp_path / "cfg" / "tiny.json"
    config.parent.mkdir(exist_ok=True)
    config.write_text(json.dumps(TINY))
    return main(["plan", str(config), "--gpus", "4", "--gpus-per-node", "2", "--profile", "h100",
                 "--global-batch", "8", "--seq", "256", "--output-dir", str(tmp_path / "runs"),
                 "--report", str(tmp_path / "rep" / "plan.html"), "--jobs", "1", "--no-progress",
                 "--knob", "parallelism.ep_size=2,4", "--fix", "parallelism.pp_size=1", *extra])


def test_a_small_plan_through_the_command_line(tmp_path, capsys):
    assert _plan(tmp_path, "--json") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["gpus"] == 4 and r["ranked"] > 0 and r["ranked"] == r["simulated"] - sum(r["not_fitting"].values())
    top = [e["tokens_per_s_per_gpu"] for e in r["top"]]
    assert top == sorted(top, reverse=True) and [e["rank"] for e in r["top"]] == list(range(1, len(top) + 1))
    assert {e["layout"]["parallelism.ep_size"] for e in r["top"]} <= {2, 4}
    assert {e["layout"]["parallelism.pp_size"] for e in r["top"]} == {1}
    page = (tmp_path / "rep" / "plan.html").read_text()
    assert "Pareto front" in page and "each knob" in page
    rows = list(csv.DictReader((tmp_path / "rep" / "plan.csv").open()))
    assert len(rows) == r["simulated"]
    assert json.loads((tmp_path / "rep" / "plan.json").read_text())["ranked"] == r["ranked"]


def test_the_text_output_names_the_counts_and_the_top(tmp_path, capsys):
    assert _plan(tmp_path, "--no-fp8") == 0
    out = capsys.readouterr().out
    assert "layouts considered" in out and "top " in out and "rank  tokens/s" in out


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["plan", "no-such-model", "--gpus", "8", "--profile", "h100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("testbed: error: MODEL = 'no-such-model': not a preset (")
    assert _plan(tmp_path, "--fix", "parallelism.nope=1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("testbed: error: --fix = 'parallelism.nope': not a knob")
    assert _plan(tmp_path, "--max-memory", "-1") == 2
    assert capsys.readouterr().err.strip() == "testbed: error: --max-memory = -1.0: must be > 0 (GB, 10^9 bytes)"
    assert _plan(tmp_path, "--fix", "badformat") == 2
    assert "--fix = 'badformat': expected section.key=value" in capsys.readouterr().err
