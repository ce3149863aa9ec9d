"""fp8 weight copies on a pipeline stage (issue 25, item 8's memory bug: ``sim.pipeline.stage_work``,
``sim.pipeline.stage_memory``): a layer's fp8 copies are made once per step and reused by every
micro-batch (Transformer Engine caches a weight's fp8 copy for the step), so a stage holds them once,
however many micro-batches its schedule keeps in flight; its activations are the bf16-GEMM run's less
the linears' inputs kept quantized, per micro-batch in flight.

H 64, F 128, 8 experts top-2 (T K = 512 rows at skew 0: every expert computes), attention of 4
heads (2 KV heads), blockwise scaling: every weight here is one 128 x 128 block, one fp32 scale."""

from __future__ import annotations

import pytest

from testbed.model.fp8_casts import linears_copy_bytes
from testbed.model.whole_model import shape_of
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile, profile_from_dict, save_profile
from testbed.scenario.scenario import Scenario

H, F, E, K, T, S, V = 64, 128, 8, 2, 256, 128, 1000


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """h200 with a free network (the memory figures do not depend on it; the runs are quick)."""
    d = load_profile("h200").to_dict()
    for link in d["links"].values():
        link.update(bandwidth_GBps=1e12, latency_us=0.0)
    return str(save_profile(profile_from_dict(d, "free-net"), tmp_path_factory.mktemp("profile") / "free-net.toml"))


def scenario(profile, tmp_path, micro: int, gemm_dtype: str) -> Scenario:
    """3 stages of one GPU, one MoE layer each (``Et|t|tL``), ``micro`` micro-batches of T tokens."""
    return Scenario.from_dict({
        "model": {"hidden_size": H, "ffn_hidden_size": F, "num_experts": E, "top_k": K, "num_layers": 3,
                  "dtype": "bf16", "gemm_dtype": gemm_dtype, "fp8_scaling": "blockwise"},
        "cluster": {"gpus_per_node": 1, "nodes_per_microcluster": 3, "microclusters": 1, "profile": profile},
        "parallelism": {"ep_size": 1, "pp_size": 3}, "pager": {"enabled": False},
        "router": {"capacity_factor": 0.0}, "workload": {"tokens_per_rank": T * micro, "skew": 0.0},
        "sim": {"network_model": "analytic"},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": S, "vocab_size": V,
                        "moe_every": 1, "optimizer": "sgd", "micro_batches": micro},
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)}})


@pytest.mark.parametrize("micro", [3, 6])
def test_a_stage_holds_its_layers_fp8_copies_once_whatever_is_in_flight(profile, tmp_path, micro):
    """1F1B keeps 3, 2 and 1 micro-batches in flight on stages 0, 1 and 2; each stage's peak is the
    bf16-GEMM run's plus its one layer's fp8 copies (attention's projections and the 8 experts'
    two GEMMs' weights) once, in ``parameters``, less what keeping the linears' inputs in fp8 saves
    of each micro-batch in flight: per token the input norm's and attention's outputs (H, n d = 64)
    and each of its K rows' input and gelu output (H + F), 1 + 4 / 128 bytes an element instead of 2."""
    bf16 = run_scenario(scenario(profile, tmp_path / "bf16", micro, "model"), "sim")
    fp8 = run_scenario(scenario(profile, tmp_path / "fp8", micro, "fp8"), "sim")
    shape = shape_of(scenario(profile, tmp_path, micro, "fp8"))
    copies = (linears_copy_bytes(shape.attention_linears, "blockwise")
              + E * linears_copy_bytes([(H, F), (F, H)], "blockwise"))
    assert copies == (H * 2 * H + 4) + (H * H + 4) + E * 2 * (H * F + 4)
    pipe_bf16, pipe_fp8 = bf16["pipeline"], fp8["pipeline"]
    assert pipe_fp8["in_flight"] == pipe_bf16["in_flight"] == [3, 2, 1]
    per_micro_batch = T * (2 * H + K * (H + F)) * (2 - (1 + 4 / 128))
    saved = [n * per_micro_batch for n in pipe_fp8["in_flight"]]
    for a, b, less in zip(pipe_bf16["stage_peak_memory_bytes"], pipe_fp8["stage_peak_memory_bytes"], saved):
        assert b - a == copies - less
    for a, b, less in zip(pipe_bf16["stage_memory_breakdown_bytes"], pipe_fp8["stage_memory_breakdown_bytes"],
                          saved):
        assert b["parameters"] - a["parameters"] == copies
        assert a["activations"] - b["activations"] == less
    assert fp8["peak_memory_bytes"] - bf16["peak_memory_bytes"] == copies - saved[0]
