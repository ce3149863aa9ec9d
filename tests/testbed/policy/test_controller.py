"""The controller: replica freshness under two-stage sync (M9), refreshes, the group
cache, page moves per rank, and determinism."""

import numpy as np

from testbed.policy.capacity import kept_counts
from testbed.policy.controller import Controller
from testbed.policy.page_moves import REASONS, page_move_count
from testbed.policy.workload import SyntheticWorkload
from testbed.scenario.scenario import Scenario


def scen(**comm):
    # 8 GPUs, EP 4, 2 replicas (groups {0..3} and {4..7}), 8 experts, 2 layers
    return Scenario.from_dict({"comm": comm, "pager": {"page_size_bytes": 16384, "gpu_budget_bytes": 131072},
                               "heat": {"update_interval": 2, "window_steps": 4}})


def routed_only_group0_uses_expert0(s):
    routed = np.full((s.world_size, s.model.num_experts), 10)
    routed[4:, 0] = 0  # EP group 1 never routes to expert 0
    return routed


def run_step(c, step, routed):
    """One step's decisions; ``routed`` is [W, E] (every layer) or [L, W, E]."""
    c.begin_step(step)
    per_layer = routed if routed.ndim == 3 else [routed] * c.L
    fwd = [c.forward_layer(l, per_layer[l]) for l in range(c.L)]
    bwd = [c.backward_layer(l) for l in reversed(range(c.L))]
    sync = c.sync()
    end = c.end_step()
    return fwd, bwd, sync, end


def test_two_stage_leaves_unused_replicas_stale_and_refreshes_them_when_needed():
    s = scen(expert_sync="two_stage")
    c = Controller(s)
    fwd, _, sync, _ = run_step(c, 0, routed_only_group0_uses_expert0(s))
    assert fwd[0].refresh_ops == []
    # expert 0 of layer 0: A_0 = {rank 0} only -> no collective, replica in group 1 (rank 4) stale
    assert not any(op.label == "expert 0" and op.layer == 0 for op in sync.expert_sync_ops)
    assert c.fresh[0].tolist() == [True, False]
    assert 0 in sync.updated[0] and 0 not in sync.updated[4]
    moves = sync.page_moves[4]
    stale = moves.expert[moves.reason == REASONS.index("stale")]
    assert set(stale.tolist()) == {0, 8}  # both layers' expert 0 on rank 4
    # next step group 1 routes to expert 0: rank 4 gets it from rank 0 first
    fwd, _, sync, _ = run_step(c, 1, np.full((8, 8), 10))
    refresh = fwd[0].refresh_ops
    # shard 0's replicas (ranks 0 and 4) first tell each other who needs its experts (M9)
    assert [(op.kind, op.members, op.size, op.batch) for op in refresh] == [
        ("all_gather", (0, 4), 1, 0), ("p2p", (0, 4), s.model.expert_bytes, 1)]
    assert (fwd[0].page_moves[4].reason == REASONS.index("refresh")).sum() == c.pages_per_expert
    assert c.fresh.all()


def test_allreduce_keeps_every_replica_fresh():
    s = scen(expert_sync="allreduce")
    c = Controller(s)
    _, _, sync, _ = run_step(c, 0, routed_only_group0_uses_expert0(s))
    assert c.fresh.all() and sync.cache is None
    assert 0 in sync.updated[4]  # the global gradient is non-zero: every replica updates
    fwd, _, _, _ = run_step(c, 1, np.full((8, 8), 10))
    assert fwd[0].refresh_ops == []


def test_group_cache_hits_after_the_first_step():
    s = scen(expert_sync="two_stage")
    c = Controller(s)
    routed = np.full((8, 8), 10)
    _, _, first, _ = run_step(c, 0, routed)
    _, _, second, _ = run_step(c, 1, routed)
    assert first.cache.misses == 4 and first.cache.hits == 2 * 8 - 4  # 4 distinct groups (j, 4+j)
    assert second.cache.misses == 0 and second.cache.hits == 16


def test_capacity_and_drops():
    s = scen().replace(router={"capacity_factor": 1.0}, workload={"tokens_per_rank": 40})
    c = Controller(s)
    c.begin_step(0)
    routed = np.zeros((8, 8), dtype=int)
    routed[:, 0] = 30  # capacity = ceil(40*2/8) = 10
    routed[:, 1] = 50
    out = c.forward_layer(0, routed)
    assert (out.kept[:, 0] == 10).all() and out.dropped_slots == 8 * (20 + 40)


def test_a_rank_local_controller_takes_the_same_decisions_as_the_global_one():
    s = scen(expert_sync="two_stage")
    wl = SyntheticWorkload(s)
    full, mine = Controller(s), Controller(s, paged_ranks=[5])
    for step in range(5):
        routed = wl.routed_counts(step)
        a, b = run_step(full, step, routed), run_step(mine, step, routed)
        for fa, fb in zip(a[0], b[0]):
            assert [o.members for o in fa.refresh_ops] == [o.members for o in fb.refresh_ops]
            for name in ("page", "expert", "slot", "src", "dst", "nbytes", "reason"):
                assert np.array_equal(getattr(fa.page_moves[5], name), getattr(fb.page_moves[5], name))
        assert np.array_equal(a[2].updated[5], b[2].updated[5])
        assert a[2].cache.hits == b[2].cache.hits


def told_step(c, step, routed, rank, heat_history):
    """One step of the controller of real rank ``rank``, told only what the planner's ops
    bring it: its EP group's counts (route), its shard's refresh requests, the discovery
    (sync) and, at heat updates, the compute and memory heat summed over ranks (end_step;
    ``heat_history``: every step's world totals so far, which that all-reduce returns)."""
    lay, s = c.layout, c.s
    g, j, n = lay.group_of[rank], lay.index_of[rank], lay.experts_per_rank
    members = list(lay.ep_group(g))
    c.begin_step(step)
    kept_world = np.stack([kept_counts(routed[l], c.capacity) for l in range(c.L)])  # [L, W, E]
    active_world = kept_world[:, lay.rank_of].sum(axis=2) > 0  # [L, R, E]
    fwd = []
    for l in range(c.L):
        mine = np.zeros_like(routed[l])
        mine[members] = routed[l][members]
        requests = [op for op in c.refresh_request_ops(l) if rank in op.members]
        told = {j: active_world[l][:, j * n:(j + 1) * n]} if requests else None
        fwd.append(c.forward_layer(l, mine, told))
    bwd = [c.backward_layer(l) for l in reversed(range(c.L))]
    sync = c.sync(active_world)
    # the world's compute heat, and its memory heat: every page of each used replica
    # accessed forward and backward, which is what all the pagers together count (M18)
    memory_world = (2 * active_world.sum(axis=1) * c.pages_per_expert).reshape(-1).astype(float)
    heat_history.append(np.stack([kept_world.sum(axis=1).reshape(-1).astype(float), memory_world]))
    summed = []

    def sum_over_ranks(own):  # the all-reduce: this rank's rows in, the world's out
        assert own.shape[1] == 2  # compute and memory heat of this rank
        assert np.array_equal(own[-1][0], kept_world[:, rank].reshape(-1))
        assert own[-1][1].sum() <= memory_world.sum() and own[-1][1].sum() > 0
        summed.append(len(own))
        return np.stack(heat_history[-len(own):])

    c.set_heat_io(sum_over_ranks)
    end = c.end_step(kept_world[:, rank].reshape(-1))
    assert summed == ([s.heat.update_interval] if c.heat.is_due(step) else [])
    return fwd, bwd, sync, end


def test_a_rank_told_only_what_its_ops_bring_decides_what_involves_it_as_the_simulator_does():
    s = scen(expert_sync="two_stage").replace(pager={"gpu_budget_bytes": 65536})
    wl = SyntheticWorkload(s)
    full = Controller(s)
    ranks = (0, 5)
    mine = {r: Controller(s, paged_ranks=[r]) for r in ranks}
    history = {r: [] for r in ranks}
    saw_refresh = False
    for step in range(6):
        routed = wl.routed_counts(step)
        if step % 2 == 0:  # group 1 leaves some experts alone: stale replicas, refreshed later
            routed[:, 4:, :3] = 0
        a = run_step(full, step, routed)
        for r, c in mine.items():
            b = told_step(c, step, routed, r, history[r])
            for fa, fb in zip(a[0], b[0]):
                involving = lambda ops: [(o.kind, o.members, o.size) for o in ops if r in o.members]  # noqa: E731
                assert involving(fa.refresh_ops) == involving(fb.refresh_ops)
                assert involving(fa.route_ops + fa.dispatch_ops) == involving(fb.route_ops + fb.dispatch_ops)
                saw_refresh |= any(o.kind == "p2p" and r in o.members for o in fb.refresh_ops)
                for name in ("page", "expert", "slot", "src", "dst", "nbytes", "reason"):
                    assert np.array_equal(getattr(fa.page_moves[r], name), getattr(fb.page_moves[r], name))
            assert [(o.kind, o.members, o.size) for o in a[2].expert_sync_ops] == \
                [(o.kind, o.members, o.size) for o in b[2].expert_sync_ops]
            assert np.array_equal(a[2].updated[r], b[2].updated[r])
            assert (a[2].cache.hits, a[2].cache.created) == (b[2].cache.hits, b[2].cache.created)
            assert np.array_equal(full.fresh, c.fresh)
            assert (a[3].heat is None) == (b[3].heat is None)
            if a[3].heat is not None:
                assert np.array_equal(a[3].heat.states, b[3].heat.states)
            for name in ("page", "expert", "src", "dst", "reason"):
                assert np.array_equal(getattr(a[3].page_moves.get(r), name, None), getattr(b[3].page_moves.get(r), name, None))
    assert saw_refresh


def test_the_world_view_is_costed_once_per_step_and_heat_once_per_heat_update():
    """Per layer only EP-group ops; the step's discovery is one op, and the heat of the
    steps since the last heat update one all-reduce at the update."""
    s = scen(expert_sync="two_stage")  # heat update every 2 steps
    c = Controller(s)
    world = tuple(range(s.world_size))
    wl = SyntheticWorkload(s)
    for step in range(4):
        fwd, bwd, sync, end = run_step(c, step, wl.routed_counts(step))
        per_layer = [op for f in fwd for op in f.route_ops + f.refresh_ops + f.dispatch_ops + f.combine_ops]
        per_layer += [op for b in bwd for op in b.combine_backward_ops + b.dispatch_backward_ops]
        assert per_layer and all(op.members != world for op in per_layer)
        assert [op.label for op in sync.expert_sync_ops if op.members == world] == [
            "active experts, all layers (M10 discovery)"]
        assert sync.expert_sync_ops[0].layer == -1
        if step % 2 == 0:
            assert end.heat is None and end.heat_ops == []
        else:
            op, *probes = end.heat_ops  # and, when frozen experts were probed, their answers (M20)
            assert [p.label for p in probes] == ([f"probe answers of {end.heat.probed.sum()} experts"]
                                                 if end.heat.probed.any() else [])
            assert (op.kind, op.stage, op.members) == ("all_reduce", "heat", world)
            assert op.size == 2 * 2 * s.model.num_layers * s.model.num_experts * 8  # compute and memory


def test_heat_updates_when_due_and_moves_are_counted():
    s = scen(expert_sync="two_stage")
    c = Controller(s)
    routed = routed_only_group0_uses_expert0(s)
    _, _, _, end0 = run_step(c, 0, routed)
    _, _, _, end1 = run_step(c, 1, routed)
    assert end0.heat is None and end1.heat is not None
    assert end1.heat.scores.shape == (2 * 8,)
    fwd, bwd, sync, _ = run_step(c, 2, routed)
    total = sum(page_move_count(m) for f in fwd for m in f.page_moves.values())
    assert total > 0  # budget of 8 pages < 16 pages of a rank's experts: loads every layer
