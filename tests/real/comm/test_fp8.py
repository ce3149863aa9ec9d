"""FP8 payloads (M22): token rows and their gradients travel as float8 e4m3 bytes, one
byte per element, and a run stays close to the uncompressed reference (within FP8
precision: a few percent), for the all-to-all and the all-gather strategies."""

import pytest
import torch

from real.backend import RealBackend
from real.comm.collectives import PayloadCodec
from real.rank.rank_state import fp8_grad_scale
from real.rank.reference import reference_step
from testbed.scenario.scenario import Scenario


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_codec_is_one_byte_per_element_and_saturates():
    codec = PayloadCodec(grad_scale=2.0 ** 13)
    x = torch.tensor([[0.5, -3.0, 1000.0, 1e-3]])
    b = codec.encode(x)
    assert b.dtype == torch.uint8 and b.shape == x.shape
    y = codec.decode(b, torch.float32)
    assert y[0, 2] == 448.0 and y[0, 0] == 0.5 and y[0, 1] == -3.0
    g = torch.full((1, 4), 3e-5)  # a typical payload gradient: 0 in fp8 without the scale
    assert codec.decode(codec.encode(g), torch.float32).abs().max() == 0
    scaled = codec.decode(codec.encode(g, codec.grad_scale), torch.float32, codec.grad_scale)
    assert torch.allclose(scaled, g, rtol=0.07)


def test_grad_scale_is_a_power_of_two():
    s = Scenario.from_dict({"workload": {"tokens_per_rank": 96}})
    k = torch.log2(torch.tensor(fp8_grad_scale(s))).item()
    assert k == int(k)


@pytest.mark.slow
@pytest.mark.parametrize("token", ["alltoall", "allgather"])
def test_fp8_payloads_stay_close_to_the_reference(token, tmp_path):
    s = Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": 4096, "gpu_budget_bytes": 16384},
        "comm": {"token_strategy": token, "expert_sync": "two_stage", "payload_dtype": "fp8"},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)},
    })
    result = RealBackend().run(s, debug={"capture": True})
    ref = reference_step(s)
    assert result.records[0].loss == pytest.approx(ref["loss"], rel=0.01)
    for rank, cap in enumerate(result.captured):
        assert rel(cap["output"], ref["outputs"][rank]) < 0.05
        for inst, grad in cap["expert_grads"].items():  # gradients came back through FP8 too
            assert rel(grad, ref["expert_grads"][inst]) < 0.05, inst
        for (w, _), (rw, _) in zip(cap["router_grads"], ref["router_grads"]):
            assert rel(w, rw) < 0.05
