"""The controller with several micro-batches a step (``transformer.micro_batches`` on a real
pipeline rank): each micro-batch's layers are decided from its own counts, and the step's
routing is their combination - a controller told m micro-batches takes the same step
decisions (expert sync and replica freshness, bias, heat) as one told their summed counts
in one micro-batch, and its token exchanges add up to that one's."""

import numpy as np

from testbed.policy.collectives import ByteLedger
from testbed.policy.controller import Controller
from testbed.policy.page_moves import page_move_count
from testbed.scenario.scenario import Scenario

M = 4  # micro-batches a step


def scenario() -> Scenario:
    """8 GPUs, EP 4 x 2 replicas, 8 experts, 2 layers; dropless (capacity is per micro-batch,
    so with drops the two would keep different slots); two-stage sync, bias balancing, a heat
    update every step; no paging (refused with pipelines: testbed.scenario), so memory heat is
    the step's use of each expert, read twice (what every rank knows alike)."""
    return Scenario.from_dict({"router": {"capacity_factor": 0.0, "bias_update_rate": 0.01},
                               "comm": {"expert_sync": "two_stage"},
                               "heat": {"update_interval": 1, "window_steps": 2},
                               "pager": {"enabled": False}})


def micro_routing(s: Scenario, step: int) -> np.ndarray:
    """[M, L, W, E] routed counts: each micro-batch's tokens of a rank (256 / M, top-2) over
    a random half of experts 1..7, so that micro-batches use different experts; expert 0 only
    by EP group 0 (ranks 0-3), in micro-batch 1 only."""
    rng = np.random.default_rng([step, 25])
    m = s.model
    out = np.zeros((M, m.num_layers, s.world_size, m.num_experts), dtype=np.int64)
    for i in range(M):
        for layer in range(m.num_layers):
            for w in range(s.world_size):
                used = rng.choice(np.arange(1, m.num_experts), m.num_experts // 2, replace=False)
                if i == 1 and w < 4:
                    used = np.append(used, 0)
                out[i, layer, w, used] = rng.multinomial(s.workload.tokens_per_rank // M * m.top_k,
                                                         np.full(len(used), 1 / len(used)))
    return out


def step_of(c: Controller, step: int, routed_MLWE: np.ndarray) -> dict:
    """One step told micro-batch by micro-batch (every forward, then every backward, as a
    1F1B stage's order keeps each micro-batch's forward before its backward)."""
    c.begin_step(step)
    n = len(routed_MLWE)
    fwd = [[c.forward_layer(layer, routed_MLWE[i, layer], micro_batch=i) for layer in range(c.L)] for i in range(n)]
    bwd = [[c.backward_layer(layer, i) for layer in reversed(range(c.L))] for i in range(n)]
    sync = c.sync()
    end = c.end_step()
    moves = [f.page_moves for row in fwd for f in row] + [b.page_moves for row in bwd for b in row] + \
        [sync.page_moves, end.page_moves]
    ledger = ByteLedger(c.layout)
    for row in fwd:
        for f in row:
            for op in f.dispatch_ops + f.combine_ops:
                ledger.add_op(op)
    for row in bwd:
        for b in row:
            for op in b.dispatch_backward_ops + b.combine_backward_ops:
                ledger.add_op(op)
    return {"sync": sync, "end": end, "tokens": dict(ledger.by_stage),
            "moves": sum(len(r) * page_move_count(m) for mv in moves for r, m in mv.groups())}


def sync_ops(plan) -> list[tuple]:
    return [(op.kind, op.members, op.size, op.label) for op in plan.expert_sync_ops]


def test_micro_batches_combine_into_the_step_of_their_summed_counts():
    s = scenario()
    micro, whole = Controller(s), Controller(s)
    for step in range(3):
        routed = micro_routing(s, step)
        a = step_of(micro, step, routed)
        b = step_of(whole, step, routed.sum(axis=0, keepdims=True))
        assert a["tokens"] == b["tokens"] and b["tokens"]["dispatch"] > 0  # dropless: rows add up
        assert sync_ops(a["sync"]) == sync_ops(b["sync"])
        assert {r: u.tolist() for r, u in a["sync"].updated.items()} == \
            {r: u.tolist() for r, u in b["sync"].updated.items()}
        assert np.array_equal(micro.fresh, whole.fresh)
        assert np.array_equal(micro.balance.bias, whole.balance.bias)
        assert np.array_equal(a["end"].heat.scores, b["end"].heat.scores)
        assert np.array_equal(a["end"].heat.states, b["end"].heat.states)
        assert a["moves"] == b["moves"] == 0
    # two-stage sync (M9): expert 0's gradient went to the replica of group 0 (it routed there in
    # micro-batch 1), not group 1's, which no micro-batch of its used
    assert micro.fresh[[0, s.model.num_experts]].tolist() == [[True, False]] * 2


def test_each_micro_batch_is_decided_from_its_own_counts():
    """Its kept counts and token exchange are the micro-batch's; its backward the same."""
    s = scenario()
    c = Controller(s)
    routed = micro_routing(s, 0)
    c.begin_step(0)
    for i in range(M):
        f = c.forward_layer(0, routed[i, 0], micro_batch=i)
        assert np.array_equal(f.kept, routed[i, 0])
        alone = Controller(s)
        alone.begin_step(0)
        expected = alone.forward_layer(0, routed[i, 0])
        assert [op.size for op in f.dispatch_ops] == [op.size for op in expected.dispatch_ops]
    for i in range(M):
        b = c.backward_layer(0, i)
        assert [op.matrix.tolist() for op in b.dispatch_backward_ops] == \
            [op.matrix.tolist() for op in Controller(s).planner.token_ops("dispatch_backward", 0, routed[i, 0])]
