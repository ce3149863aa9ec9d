"""CUDA paths of the real backend (marked ``cuda``, skipped without a GPU):

- the grouped expert GEMM (``torch._grouped_mm``, bf16) computes what the per-expert loop
  computes, forward and backward, within bf16 tolerance;
- pages copied on the side stream, read and updated behind per-expert events, keep the
  expert weights bit-identical to an unpaged copy under a random pager schedule;
- one real rank on one GPU (NCCL) trains with paging, FP8 payload codec, CUDA-event stage
  times and a torch.profiler trace with CUDA kernels.

``benchmarks/gpu_check.sh`` runs this file with pytest, or directly (``python
tests/real/test_cuda.py``) on a machine without pytest. Only torch, numpy and the
project are needed (no simpy, no hypothesis). A test that cannot run on this machine
(the multi-rank one on one GPU) is skipped with its reason: pytest reports it as
skipped, a direct run prints ``SKIP``; it never passes without running.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

try:
    import pytest
except ImportError:  # run directly by benchmarks/gpu_check.sh
    pytest = None

from real.backend import RealBackend
from real.comm.collectives import PayloadCodec
from real.kernels.experts import FlatWeights, PagedExpertFFN, grouped_supported
from real.paging.paged_store import PagedExpertStore
from testbed.policy.heat import COLD, WARM
from testbed.policy.pager import RankPager
from testbed.scenario.scenario import Scenario
from testbed.scenario.sections import PagerConfig

CUDA = torch.cuda.is_available()
if pytest is not None:
    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


class Skipped(Exception):
    """A test that cannot run on this machine, in a direct run (no pytest)."""


def skip(reason: str) -> None:
    """Skip the calling test with ``reason``: pytest's skip, or ``Skipped`` in a direct run."""
    if pytest is not None:
        pytest.skip(reason)
    raise Skipped(reason)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_grouped_gemm_matches_the_loop_in_bf16():
    dev, h, f = torch.device("cuda"), 256, 512
    assert grouped_supported(dev, torch.bfloat16, h, f)
    counts = [37, 0, 128, 5, 64]  # ragged groups: the grouped kernel pads them to 16 rows
    g = torch.Generator(device="cpu").manual_seed(0)
    weights = {i: (torch.randn(2 * h * f, generator=g) / 16).to(dev, torch.bfloat16) for i in range(len(counts))}
    x0 = torch.randn(sum(counts), h, generator=g).to(dev, torch.bfloat16)
    dy = torch.randn(sum(counts), h, generator=g).to(dev, torch.bfloat16)

    outs = []
    for grouped in (False, True):
        x = x0.clone().requires_grad_()
        grads = {}
        y = PagedExpertFFN.apply(x, FlatWeights(weights), list(weights), counts, h, f, grads, None, grouped)
        y.backward(dy)
        outs.append((y.detach(), x.grad, grads))
    (y0, dx0, g0), (y1, dx1, g1) = outs
    assert rel(y1, y0) < 1e-2 and rel(dx1, dx0) < 1e-2
    assert g0.keys() == g1.keys() == {i for i, n in enumerate(counts) if n}
    for inst in g0:
        assert rel(g1[inst], g0[inst]) < 1e-2, inst


def test_paged_store_on_cuda_keeps_weights_bit_identical():
    """A random pager schedule; reads and updates right after the (asynchronous) copies."""
    dev, elems = torch.device("cuda"), 3000  # 3 pages of 4 KiB (fp32), the last one shorter
    experts = [3, 5, 8, 13, 21, 34]
    cfg = PagerConfig(page_size_bytes=4096, gpu_budget_bytes=4096 * 8, prefetch_pages=1, cold_consecutive_updates=1)
    pager = RankPager(0, experts, elems * 4, cfg)

    def init(i):
        return torch.arange(elems, dtype=torch.float32) + 1000 * i

    store = PagedExpertStore(pager, elems, torch.float32, dev, init)
    shadow = {i: init(i).to(dev) for i in experts}
    stale: set[int] = set()
    rng = np.random.default_rng(0)
    g = torch.Generator(device="cpu").manual_seed(0)
    for step in range(300):
        kind = rng.choice(["access", "update", "stale", "cold"])
        if kind == "access":
            some = [int(i) for i in rng.choice(experts, size=rng.integers(1, 4), replace=False)]
            for i in set(some) & stale:
                store.execute(pager.refresh([i], step), {i: shadow[i].clone()})
                stale.discard(i)
            store.execute(pager.access(some, step))
            pager.end_step()
            for i in some:
                assert torch.equal(store.read(i), shadow[i]), (step, i)
        elif kind == "update":
            live = [i for i in experts if i not in stale and rng.random() < 0.5]
            moves = pager.apply_update(live)
            for i in live:
                grad = torch.randn(elems, generator=g).to(dev)
                store.update(i, grad, 0.1)
                shadow[i] = shadow[i] - 0.1 * grad
            store.execute(moves)
        elif kind == "stale":
            i = int(rng.choice(experts))
            if i not in stale:
                store.execute(pager.invalidate([i]))
                stale.add(i)
        else:
            below = rng.random(len(experts)) < 0.4
            store.execute(pager.heat_update(below, np.where(below, COLD, WARM), np.zeros(len(experts), bool), step))
        if step % 10 == 0:
            store.settle()
    store.settle()
    for i in experts:
        if i not in stale:
            assert torch.equal(store.read(i), shadow[i]), i


def test_fp8_codec_on_cuda():
    codec = PayloadCodec(grad_scale=2.0 ** 16)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    b = codec.encode(x)
    assert b.dtype == torch.uint8 and b.is_cuda
    assert rel(codec.decode(b, torch.bfloat16), x) < 0.05


def test_one_gpu_rank_trains_with_paging_and_profiles():
    # RealBackend directly, not testbed.run.runner (which needs tomli_w to write a run folder)
    with tempfile.TemporaryDirectory() as tmp:
        s = Scenario.from_dict({
            "model": {"hidden_size": 256, "ffn_hidden_size": 512, "num_experts": 8, "num_layers": 2, "dtype": "bf16"},
            "cluster": {"gpus_per_node": 1, "nodes_per_microcluster": 1, "microclusters": 1},
            "parallelism": {"ep_size": 1},
            "pager": {"page_size_bytes": "64KiB", "gpu_budget_bytes": "2MiB"},
            "heat": {"update_interval": 2, "window_steps": 4, "compute_source": "measured"},
            "workload": {"tokens_per_rank": 1024},
            "run": {"steps": 12, "warmup_steps": 2, "learning_rate": 0.2, "output_dir": tmp},
            "real": {"device": "cuda", "check_weights": True, "profile": True},
        })
        result = RealBackend().run(s, run_dir=tmp)
        assert result.extra["device"] == "cuda"
        losses = [r.loss for r in result.records]
        assert losses[-1] < losses[0]
        assert all(r.stage_time_s["experts"] > 0 for r in result.records)  # CUDA-event stage times
        assert sum(r.page_moves for r in result.records) > 0
        trace = json.loads((Path(tmp) / "torch_trace_rank0.json").read_text())
        assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])


def test_nccl_ranks_match_the_reference_with_overlap():
    """On 2 or more GPUs (up to 4): NCCL ranks with two-stage sync, micro-batches of the
    all-to-all and the sync during the backward (M22) compute the single-process
    reference's loss, outputs and gradients (fp32, the per-expert loop)."""
    count = torch.cuda.device_count()
    gpus = min(count, 4) // 2 * 2
    if gpus < 2:
        skip(f"needs 2 or more GPUs, this machine has {count}")
    from real.rank.reference import reference_step

    with tempfile.TemporaryDirectory() as tmp:
        s = Scenario.from_dict({
            "model": {"hidden_size": 64, "ffn_hidden_size": 96, "num_experts": 4, "num_layers": 2},
            "cluster": {"gpus_per_node": gpus, "nodes_per_microcluster": 1, "microclusters": 1},
            "parallelism": {"ep_size": gpus // 2 if gpus > 2 else 2},
            "router": {"capacity_factor": 1.0},
            "pager": {"page_size_bytes": "4KiB", "gpu_budget_bytes": "64KiB"},
            "comm": {"token_strategy": "alltoall", "expert_sync": "two_stage"},
            "overlap": {"micro_batches": 2, "sync_with_backward": True},
            "workload": {"tokens_per_rank": 64},
            "run": {"steps": 1, "warmup_steps": 0, "output_dir": tmp},
            "real": {"device": "cuda"},
        })
        result = RealBackend().run(s, debug={"capture": True})
        ref = reference_step(s, noise_device="cuda")
        assert result.extra["device"] == "cuda"
        assert abs(result.records[0].loss - ref["loss"]) <= 1e-4 * abs(ref["loss"])
        for rank, cap in enumerate(result.captured):
            torch.testing.assert_close(cap["output"].cpu(), ref["outputs"][rank], rtol=1e-3, atol=1e-4)
            for inst, grad in cap["expert_grads"].items():
                torch.testing.assert_close(grad.cpu(), ref["expert_grads"][inst], rtol=1e-3, atol=1e-5)


SKIPS = (Skipped,) + ((pytest.skip.Exception,) if pytest is not None else ())


def run_directly(tests) -> int:
    """Run ``tests`` (name -> function) without pytest, one line each: PASS, SKIP with the
    reason, or FAIL with the traceback; returns how many failed."""
    import traceback

    failed = 0
    for name, fn in tests.items():
        try:
            fn()
            print(f"PASS {name}")
        except SKIPS as e:
            print(f"SKIP {name}: {e}")
        except Exception:  # report every test, then fail
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}")
    return failed


if __name__ == "__main__":
    import sys

    if not CUDA:
        print("CUDA is absent: the CUDA tests are skipped")
        sys.exit(0)
    sys.exit(1 if run_directly({n: f for n, f in list(globals().items()) if n.startswith("test_") and callable(f)})
             else 0)
