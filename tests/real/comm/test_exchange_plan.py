"""Row layouts of the all-to-all exchange: every slot reaches its expert, in the expert
layout, whatever the stages (flat or hierarchical, any placement)."""

import numpy as np
import pytest

from real.comm.exchange_plan import flat_stages, hierarchical_stages, plan_exchange, plan_flat


def simulate(kept, members, owner, stages):
    """Move labelled rows (src, expert, i) through every rank's plan, as the collectives would."""
    p, num_experts = kept.shape
    plans = {m: plan_exchange(kept, members, owner, stages, m) for m in members}
    bufs = {m: [(i, e, t) for e in range(num_experts) for t in range(kept[i, e])] for i, m in enumerate(members)}
    for st in range(len(plans[members[0]].stages)):
        sent = {}
        for m in members:
            sp = plans[m].stages[st]
            rows = [bufs[m][r] for r in sp.send_rows]
            start, sent[m] = 0, {}
            for g, n in zip(sp.group, sp.send_splits):
                sent[m][g], start = rows[start:start + n], start + n
        for m in members:
            sp = plans[m].stages[st]
            assert list(sp.group) == sorted(sp.group)
            got = []
            for g, n in zip(sp.group, sp.recv_splits):
                assert len(sent[g][m]) == n
                got += sent[g][m]
            bufs[m] = got
    for i, m in enumerate(members):
        final = [bufs[m][r] for r in plans[m].expert_rows]
        expected = [(s, e, t) for e in range(num_experts) if owner(e) == i for s in range(p) for t in range(kept[s, e])]
        assert final == expected
        assert plans[m].expert_counts.tolist() == [kept[:, e].sum() for e in range(num_experts) if owner(e) == i]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("grid", [None, [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[3, 0], [2, 1]]])
def test_every_slot_reaches_its_expert(seed, grid):
    rng = np.random.default_rng(seed)
    kept = rng.integers(0, 4, size=(4, 8))
    kept[rng.random(kept.shape) < 0.3] = 0
    members = [int(x) for x in rng.permutation([10, 11, 12, 13])]
    owner = lambda e: e // 2  # noqa: E731
    stages = flat_stages(4, owner) if grid is None else hierarchical_stages(np.array(grid), owner)
    simulate(kept, members, owner, stages)


@pytest.mark.parametrize("seed", range(20))
def test_the_numpy_flat_plan_is_the_general_plan(seed):
    """``plan_flat`` (the hot path's) gives every rank the plan ``plan_exchange`` gives
    it for the flat stages: members in any rank order, experts owned anywhere, empty
    blocks and empty members included."""
    rng = np.random.default_rng(seed)
    p = int(rng.integers(1, 7))
    per = int(rng.integers(1, 4))
    kept = rng.integers(0, 4, size=(p, p * per)) * (rng.random((p, p * per)) < 0.7)
    members = [int(m) for m in rng.permutation(np.arange(10, 10 + 3 * p, 3))]
    owners = rng.permutation(np.repeat(np.arange(p), per))
    owner = lambda e: int(owners[e])  # noqa: E731
    for me in members:
        general = plan_exchange(kept, members, owner, flat_stages(p, owner), me)
        fast = plan_flat(kept, members, owner, me)
        (g,), (f,) = general.stages, fast.stages
        assert f.group == g.group
        assert f.send_rows.tolist() == g.send_rows.tolist()
        assert f.send_splits == g.send_splits and f.recv_splits == g.recv_splits
        assert fast.expert_rows.tolist() == general.expert_rows.tolist()
        assert fast.expert_counts.tolist() == general.expert_counts.tolist()
