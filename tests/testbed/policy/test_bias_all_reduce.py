"""Bias balancing with several replicas (DeepSeek-V3 §2.1.2's whole-batch load): the
planner's once-per-step all-reduce of the routed counts over each replica group, its
bytes by hand, and every rank's controller, told only its EP group's counts and then the
all-reduce's sum, moving the one bias the simulator's controller moves from every count."""

import numpy as np
import pytest

from testbed.policy.collectives import ByteLedger
from testbed.policy.controller import Controller
from testbed.policy.planner import Planner
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


def scenario(ep=2, rate=0.001, layers=2, experts=8) -> Scenario:
    """4 ranks on 2 nodes of 2; EP 2 x 2 replicas: EP groups (0, 1) and (2, 3), replica
    groups (0, 2) and (1, 3), each across the two nodes (a leaf link)."""
    return Scenario.from_dict({
        "model": {"num_experts": experts, "num_layers": layers, "top_k": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": ep},
        "router": {"bias_update_rate": rate, "capacity_factor": 0.0},
        "workload": {"tokens_per_rank": 4},
    })


def test_the_counts_all_reduce_by_hand():
    """L x E int32 = 2 x 8 x 4 = 64 bytes, all-reduced in each replica group of 2: a ring
    of 2 sends 2 (2-1) 64 = 128 bytes, 256 in the step, all across the nodes (leaf); the
    world ring would send 2 (4-1) 64 = 384."""
    s = scenario()
    ops = Planner(s).balance_ops()
    assert [(op.kind, op.members, op.stage, op.layer, op.batch, op.size) for op in ops] == [
        ("all_reduce", (0, 2), "expert_sync", -1, 0, 64), ("all_reduce", (1, 3), "expert_sync", -1, 0, 64)]
    assert [op.wire_bytes for op in ops] == [128, 128]
    ledger = ByteLedger(Layout(s))
    for op in ops:
        ledger.add_op(op)
    assert ledger.by_stage["expert_sync"] == 256
    assert ledger.level_dict() == {"nvlink": 0, "leaf": 256, "spine": 0, "pcie": 0}
    # planned beside the discovery, once per step, in the sync plan the backends execute
    c = Controller(s)
    c.begin_step(0)
    for layer in range(2):
        c.forward_layer(layer, np.full((4, 8), 1))
    for layer in reversed(range(2)):
        c.backward_layer(layer)
    once = [op for op in c.sync().expert_sync_ops if op.layer == -1]
    assert [op.kind for op in once] == ["all_gather", "all_reduce", "all_reduce"]  # M10 discovery first
    assert [(o.members, o.stage, o.size) for o in once[1:]] == [(o.members, o.stage, o.size) for o in ops]


def test_no_counts_all_reduce_with_one_replica_or_without_the_bias():
    assert Planner(scenario(ep=4)).balance_ops() == []  # the route all_gather told every rank
    assert Planner(scenario(rate=0.0)).balance_ops() == []


# routed counts of one layer, 4 experts, per rank: EP group 0 (ranks 0, 1) loads 4, 2, 4, 6
# (mean 4), group 1 (ranks 2, 3) 0, 6, 6, 4 (mean 4), the whole batch 4, 8, 10, 10 (mean 8)
ROUTED = np.array([[3, 1, 2, 2], [1, 1, 2, 4], [0, 3, 3, 2], [0, 3, 3, 2]])
WHOLE_BATCH_BIAS = [[0.001, 0.0, -0.001, -0.001]]  # sign(mean - load) of the whole batch, x 0.001


def told(controller: Controller, rank: int) -> np.ndarray:
    """The rows a real rank's route all_gather gives it: its EP group's, the others zero."""
    rows = np.zeros_like(ROUTED)
    members = list(controller.layout.ep_group(int(controller.layout.group_of[rank])))
    rows[members] = ROUTED[members]
    return rows


def run_step(controller: Controller, routed: np.ndarray, load=None) -> None:
    controller.begin_step(0)
    controller.forward_layer(0, routed)
    controller.backward_layer(0)
    controller.sync()
    if load is not None:
        controller.tell_balance_load(load)
    controller.end_step()


def test_every_rank_moves_the_one_bias_of_the_whole_batch():
    """Each rank's controller contributes its EP group's load; summed over its replica group
    (what the all-reduce returns) that is the whole batch's, and every rank's bias is the
    simulator's, told every count. Expert 0 sits at its group's mean but below the batch's
    and goes up; expert 1, underloaded in group 0 and overloaded in group 1, stays (each
    group's own rule would have moved it both ways)."""
    s = scenario(layers=1, experts=4)
    lay = Layout(s)
    whole = Controller(s)
    run_step(whole, ROUTED)
    assert whole.balance.bias.tolist() == WHOLE_BATCH_BIAS
    ranks = [Controller(s, paged_ranks=[r], layout=lay) for r in range(4)]
    contributions = {}
    for r, c in enumerate(ranks):
        c.begin_step(0)
        c.forward_layer(0, told(c, r))
        contributions[r] = c.balance_counts(r)
    assert contributions[0].tolist() == contributions[1].tolist() == [[4, 2, 4, 6]]
    assert contributions[2].dtype == np.int32 and contributions[2].tolist() == [[0, 6, 6, 4]]
    for r, c in enumerate(ranks):
        c.backward_layer(0)
        c.sync()
        c.tell_balance_load(sum(contributions[m] for m in lay.replica_group(int(lay.index_of[r]))))
        c.end_step()
        assert np.array_equal(c.balance.bias, whole.balance.bias), r


def test_a_ranks_controller_not_told_the_whole_batch_refuses_to_move_the_bias():
    s = scenario(layers=1, experts=4)
    c = Controller(s, paged_ranks=[0])
    with pytest.raises(RuntimeError, match="whole batch's load was not told"):
        run_step(c, told(c, 0))
