"""The ledger counts an op's bytes per stage and level from its member set's cached hop
levels: the same totals as the op's transfers, for every kind and corner."""

import numpy as np
import pytest

from testbed.policy.collectives import ByteLedger, CollectiveOp, reduce_scatter_runs_as_all_reduce, transfers
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout

KINDS = ["all_to_all_v", "all_gather", "reduce_scatter", "all_reduce", "p2p"]


def random_op(rng, world, stage):
    kind = KINDS[rng.integers(len(KINDS))]
    if kind == "p2p":
        members = tuple(int(x) for x in rng.integers(0, world, 2))  # sometimes to itself
    else:
        members = tuple(sorted(int(x) for x in rng.choice(world, rng.integers(1, world + 1), replace=False)))
    p = len(members)
    if kind == "all_to_all_v":
        matrix = rng.integers(0, 2**40, (p, p)) * (rng.random((p, p)) < 0.6)
        return CollectiveOp(kind, members, stage, matrix=matrix)
    size = int(rng.integers(1, 2**36)) if rng.random() < 0.8 else 0
    return CollectiveOp(kind, members, stage, size=size)


@pytest.mark.parametrize("seed", range(5))
def test_add_op_equals_adding_its_transfers(seed):
    rng = np.random.default_rng(seed)
    layout = Layout(Scenario.from_dict({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2,
                                                    "microclusters": 3}}))
    hops: dict = {}
    fast, slow = ByteLedger(layout, hops), ByteLedger(layout)
    for i in range(300):
        op = random_op(rng, layout.world, ["dispatch", "expert_sync", "route"][i % 3])
        fast.add_op(op)
        slow.add_transfers(op.stage, *op.transfers())
        total, per_level = fast.op_bytes(op)
        assert total == int(op.transfers()[2].sum()) and per_level.sum() == total  # ring shares round down
    assert fast.by_stage == slow.by_stage and fast.level_dict() == slow.level_dict()
    # a second ledger sharing the hop levels counts alike
    again = ByteLedger(layout, hops)
    rng = np.random.default_rng(seed)
    for i in range(300):
        again.add_op(random_op(rng, layout.world, ["dispatch", "expert_sync", "route"][i % 3]))
    assert again.by_stage == slow.by_stage and again.level_dict() == slow.level_dict()


def test_ops_that_move_nothing_still_name_their_stage():
    layout = Layout(Scenario.from_dict({}))
    ledger = ByteLedger(layout)
    ledger.add_op(CollectiveOp("all_reduce", (3,), "dense_sync", size=100))
    ledger.add_op(CollectiveOp("p2p", (2, 2), "paging", size=100))
    ledger.add_op(CollectiveOp("all_gather", (0, 1), "route", size=0))
    assert ledger.by_stage == {"dense_sync": 0, "paging": 0, "route": 0}
    assert ledger.level_dict() == {"nvlink": 0, "leaf": 0, "spine": 0, "pcie": 0}


@pytest.mark.parametrize("seed", range(3))
def test_a_library_that_all_reduces_its_reduce_scatters_is_counted_as_it_runs(seed):
    """gloo (``reduce_scatter_as_all_reduce``): every reduce-scatter counts as the ring
    all-reduce of its input, 2 (p - 1) size, link by link as the ledger's own transfers
    with the flag; every other kind as before."""
    rng = np.random.default_rng(seed)
    layout = Layout(Scenario.from_dict({"cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2,
                                                    "microclusters": 3}}))
    gloo = ByteLedger(layout, reduce_scatter_as_all_reduce=True)
    plain, slow = ByteLedger(layout), ByteLedger(layout)
    for i in range(300):
        op = random_op(rng, layout.world, ["dispatch", "expert_sync"][i % 2])
        gloo.add_op(op)
        plain.add_op(op)
        slow.add_transfers(op.stage, *transfers(op.kind, op.members, op.size, op.matrix,
                                                reduce_scatter_as_all_reduce=True))
        counted = CollectiveOp("all_reduce", op.members, op.stage, size=op.size) if op.kind == "reduce_scatter" else op
        assert gloo.op_bytes(op)[0] == int(counted.transfers()[2].sum())  # ring shares round down
        p = len(op.members)
        if op.kind == "reduce_scatter" and p > 1:
            assert gloo.op_bytes(op)[0] == p * (2 * (p - 1) * op.size // p)
            assert plain.op_bytes(op)[0] == p * ((p - 1) * op.size // p)
        else:
            assert gloo.op_bytes(op)[0] == plain.op_bytes(op)[0]
    assert gloo.by_stage == slow.by_stage and gloo.level_dict() == slow.level_dict()


def test_the_profile_says_which_library_all_reduces_its_reduce_scatters():
    assert reduce_scatter_runs_as_all_reduce(load_profile("local-cpu"))  # gloo
    assert reduce_scatter_runs_as_all_reduce(load_profile("emulated"))
    assert not reduce_scatter_runs_as_all_reduce(load_profile("h200"))  # NCCL's ring
