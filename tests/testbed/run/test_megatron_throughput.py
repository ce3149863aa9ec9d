"""Every run with the whole transformer reports its TFLOP/s per GPU in Megatron-LM's count
(testbed.run.results.throughput, issue 26 item 3): the step's tokens through
testbed.model.megatron_flops, over step time x 1e12 x GPUs as Megatron's training_log
divides; the printed summary shows it; the MoE stack alone has none."""

from pathlib import Path

import pytest

from testbed.cli.main import format_summary
from testbed.model.megatron_flops import megatron_flops, padded_vocab_size
from testbed.model.whole_model import shape_of
from testbed.run.results import StepRecord, throughput
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario

CONFIGS = Path(__file__).parents[3] / "configs"
H, E, F, T, S = 64, 8, 128, 256, 128


def whole(vocab: int = 1024, **over) -> Scenario:
    return Scenario.from_dict({
        "model": {"hidden_size": H, "ffn_hidden_size": F, "num_experts": E, "num_layers": 2, "dtype": "bf16"},
        "workload": {"tokens_per_rank": T},
        "pager": {"page_size_bytes": "16KiB"},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": S, "vocab_size": vocab,
                        "moe_every": 2},
        "run": {"steps": 2, "warmup_steps": 1},
        **over,
    })


def record(step: int = 0) -> StepRecord:
    return StepRecord(step=step, step_time_s=0.01, stage_time_s={}, bytes_by_stage={}, bytes_by_level={},
                      peak_memory_bytes=0, routed_slots=100, dropped_slots=0, page_moves=0, page_bytes=0,
                      page_stall_s=0.0, cache_hits=0, cache_lookups=0)


def test_a_simulated_runs_megatron_tflops_are_megatrons_flops_of_its_tokens_over_its_step(tmp_path):
    s = whole().replace(run={"output_dir": str(tmp_path)})
    out = run_scenario(s, "sim")
    tokens = s.world_size * T  # no pipeline: every GPU's own tokens
    flops = megatron_flops(shape_of(s), tokens / S, S, padded_vocab_size(1024))
    assert out["megatron_flops_per_step"] == flops
    assert out["megatron_tflops_per_gpu"] == flops / (out["step_time_s"] * 10**12 * s.world_size)
    # the two counts differ here by the routers' GEMMs only (2 H E a token and MoE layer, x 3): no
    # window, no MTP, no shared gate, a vocabulary Megatron does not pad; integers below 2^53, exact
    assert out["model_flops_per_step"] - flops == 3 * 2 * H * E * tokens * shape_of(s).moe_layers
    line = next(x for x in format_summary(out).splitlines() if x.startswith("throughput "))
    assert line.endswith(f", {out['megatron_tflops_per_gpu']:.4g} TFLOP/s per GPU in Megatron-LM's count")


@pytest.mark.parametrize("tp, padded", [(1, 1152), (2, 1280)])
def test_the_vocabulary_is_padded_to_128_x_tp_as_megatron_pads_it(tp, padded):
    s = whole(vocab=1100, parallelism={"tp_size": tp})
    out = throughput(s, [record()], 0.01, None)
    assert out["megatron_flops_per_step"] == megatron_flops(shape_of(s), s.world_size * T / S, S, padded)
    assert out["megatron_tflops_per_gpu"] == out["megatron_flops_per_step"] / (0.01 * 1e12 * s.world_size)


def test_the_moe_stack_alone_has_no_megatron_count():
    s = Scenario.from_dict({"model": {"num_layers": 2, "num_experts": 8}, "run": {"steps": 1, "warmup_steps": 0}})
    out = throughput(s, [record()], 0.01, 1e12)
    assert out["flops_of"] == "MoE stack" and out["mfu"] is not None
    assert out["megatron_flops_per_step"] is None and out["megatron_tflops_per_gpu"] is None
    line = next(x for x in format_summary({**out, **_printable()}).splitlines() if x.startswith("throughput "))
    assert "Megatron" not in line


def _printable() -> dict:
    """The fields format_summary reads besides the throughput."""
    return {"run_dir": "r", "backend": "sim", "steps": 1, "measured_steps": 1, "step_time_s": 0.01,
            "stage_time_s": {}, "bytes_by_stage": {}, "bytes_by_level": {}, "peak_memory_bytes": 0,
            "dropped_token_fraction": 0.0, "page_moves_per_step": 0.0, "group_cache_hit_rate": None}


def test_the_deepseek_like_cpu_config_prints_its_megatron_tflops(tmp_path):
    s = load_scenario(CONFIGS / "deepseek-like-cpu.toml").replace(run={"output_dir": str(tmp_path)})
    out = run_scenario(s, "sim")
    shape = shape_of(s)
    assert shape.attention == "mla" and shape.mtp_layers == 1  # Megatron's MLA and MTP terms are in the count
    tokens = s.world_size * s.workload.tokens_per_rank
    flops = megatron_flops(shape, tokens / s.transformer.seq_len, s.transformer.seq_len, padded_vocab_size(512))
    assert out["megatron_tflops_per_gpu"] == flops / (out["step_time_s"] * 1e12 * s.world_size)
    assert f"{out['megatron_tflops_per_gpu']:.4g} TFLOP/s per GPU in Megatron-LM's count" in format_summary(out)
