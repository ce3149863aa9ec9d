"""The real backend's hot path reads the device back once per layer: the routed counts
the plan needs (issue: a host-light hot path on GPUs). Checked on CPU by counting the
calls that wait for a device's data on CUDA (``.cpu()``, ``.item()``, ``.tolist()``,
``nonzero``, ``bincount``, boolean-mask indexing) during a rank's forward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from real.rank.layer import LayerRunner
from real.rank.rank_state import RankState
from testbed.scenario.scenario import Scenario


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Reads:
    """Counts device read-backs while ``on``."""

    def __init__(self, monkeypatch):
        self.n, self.on, self.where = 0, False, []
        for name in ("cpu", "item", "tolist", "nonzero"):
            self._wrap(monkeypatch, torch.Tensor, name)
        for name in ("nonzero", "bincount"):
            self._wrap(monkeypatch, torch, name)
        getitem = torch.Tensor.__getitem__

        def masked(t, index):
            if self.on and isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                self._seen("bool mask")
            return getitem(t, index)
        monkeypatch.setattr(torch.Tensor, "__getitem__", masked)

    def _seen(self, what):
        self.n += 1
        self.where.append(what)

    def _wrap(self, monkeypatch, owner, name):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            if self.on:
                self._seen(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("token", ["alltoall", "allgather"])
def test_a_layer_forward_reads_the_device_once(token, one_rank, monkeypatch, tmp_path):
    s = Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 3},
        "cluster": {"gpus_per_node": 1, "nodes_per_microcluster": 1, "microclusters": 1},
        "parallelism": {"ep_size": 1},
        "pager": {"page_size_bytes": 4096, "gpu_budget_bytes": 16384},
        "comm": {"token_strategy": token},
        "router": {"capacity_factor": 1.0},
        "workload": {"tokens_per_rank": 64},
        "run": {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)},
    })
    st = RankState(s, 0, torch.device("cpu"))
    st.self_check = False  # as on CUDA
    layers = LayerRunner(st)
    st.begin_step(0)
    reads = Reads(monkeypatch)
    h = torch.randn(64, 32, requires_grad=True)
    reads.on = True
    for layer in range(s.model.num_layers):
        h, _, _ = layers.forward(layer, h, 0)
    reads.on = False
    assert reads.n <= s.model.num_layers, reads.where
    assert reads.n == s.model.num_layers  # the counts, once per layer
