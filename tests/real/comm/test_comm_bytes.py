"""The real backend counts the bytes of the algorithm its library runs (``docs/bytes.md``):
gloo's reduce-scatter as the all-reduce it is, NCCL's as a ring, the FP8 reduce-scatter as
the all-to-all of shards it sends. In one process: the library calls are replaced by
stand-ins that leave the counting to ``Comm``."""

import pytest
import torch

import real.comm.collectives as comm_mod
from real.comm.collectives import Comm, PayloadCodec
from testbed.policy.collectives import ByteLedger
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout

MEMBERS = (0, 1, 2, 3)  # 2 nodes of 2: 0-1 and 2-3 share a node


def comm(rank=0):
    layout = Layout(Scenario.from_dict({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2,
                                                    "microclusters": 1}}))
    return Comm(rank, ByteLedger(layout), lambda: "combine")


@pytest.mark.parametrize("gloo, per_member", [(True, 2 * 3), (False, 3)])
def test_a_reduce_scatter_is_counted_as_the_library_runs_it(monkeypatch, gloo, per_member):
    """gloo all-reduces the whole input and keeps the shard: this rank sends its ring
    successor 2 (p-1)/p of the input; NCCL's ring reduce-scatter (p-1)/p."""
    monkeypatch.setattr(comm_mod, "_is_gloo", lambda group: gloo, raising=False)
    monkeypatch.setattr(comm_mod, "_reduce_scatter_tensor", lambda out, x, group, async_op: None)
    c = comm(rank=1)
    x = torch.zeros(8, 16)  # 512 bytes
    c.reduce_scatter(x, MEMBERS, group=object())
    assert c.ledger.by_stage == {"combine": per_member * 512 // 4}
    assert c.ledger.level_dict()["leaf"] == per_member * 512 // 4  # rank 1 -> 2 crosses the nodes


def test_the_fp8_reduce_scatter_is_counted_as_its_all_to_all_of_shards(monkeypatch):
    """Rank 0 sends each of the 3 others its quarter of the coded input (1 byte per
    element): one over NVLink (rank 1), two across the nodes; a ring would send all
    three quarters to rank 1."""
    sent = []
    monkeypatch.setattr(comm_mod.dist, "all_to_all_single",
                        lambda out, x, out_splits, in_splits, group: sent.append(in_splits) or out.copy_(x))
    c = comm(rank=0)
    x = torch.randn(8, 16)
    c.reduce_scatter_coded(x, MEMBERS, group=object(), codec=PayloadCodec(1.0), scale=1.0)
    shard = 8 * 16 // 4
    assert sent == [[2, 2, 2, 2]]
    assert c.ledger.by_stage == {"combine": 3 * shard}
    assert c.ledger.level_dict() == {"nvlink": shard, "leaf": 2 * shard, "spine": 0, "pcie": 0}


def test_the_bytes_page_says_what_is_counted_and_what_is_measured(repo_root):
    """docs/bytes.md: counted bytes (both backends, one set of formulas, the algorithm the
    library runs) against the one measured quantity (an emulated cluster's counters)."""
    page = (repo_root / "docs" / "bytes.md").read_text()
    for needed in ("`bytes_by_stage`, `bytes_by_level`", "`wire_bytes_by_level`", "reduce_scatter_tensor_coalesced",
                   "all-reduce of the whole input", "all-to-all of 1-byte shards", "does not show that those bytes "
                   "crossed a wire", "measured on an emulated cluster only", "htb", "What nothing measures"):
        assert needed in page, needed
    assert "docs/bytes.md" in (repo_root / "testbed" / "policy" / "collectives.py").read_text()
    assert "docs/bytes.md" in (repo_root / "real" / "comm" / "collectives.py").read_text()
