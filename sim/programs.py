"""Each GPU's work in one step, as a program of segments the engine runs in order.

The controller (shared with the real backend) decides the step; this module turns its
decisions into one program per rank, in the order the real backend works:

forward, per layer:   route (router GEMM, counts all-gather) -> paging (replica refreshes
                      and page loads) -> dispatch -> experts -> combine
backward, per layer:  combine_backward -> paging (reloads) -> experts_backward ->
                      dispatch_backward -> route_backward
then:                 expert_sync (group creations on cache misses, then the op batches)
                      -> dense_sync -> optimizer -> heat -> paging

A segment is ``(stage, kind, payload)`` with kind ``compute`` (seconds), ``ops`` (a list
of CollectiveOps run concurrently; the segment ends when all are done), ``copy``
(host<->device bytes and page count of this rank) or ``wait`` (seconds, e.g. creating
communicators).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import groupby

import numpy as np

from sim.compute import ComputeModel
from testbed.collectives import CollectiveOp
from testbed.controller import LayerBackward, LayerForward, StepEnd, SyncPlan
from testbed.page_moves import GPU, HOST, PageMoves
from testbed.scenario import Scenario
from testbed.topology import Layout


@dataclass
class Copy:
    """Host<->device page traffic of one rank: bytes each way and pages moved."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    pages: int = 0

    @classmethod
    def of(cls, moves: PageMoves | None) -> "Copy":
        if moves is None or len(moves) == 0:
            return cls()
        h2d = (moves.src == HOST) & (moves.dst == GPU)
        d2h = (moves.src == GPU) & (moves.dst == HOST) & (moves.nbytes > 0)
        return cls(int(moves.nbytes[h2d].sum()), int(moves.nbytes[d2h].sum()), int(h2d.sum() + d2h.sum()))

    def __bool__(self) -> bool:
        return self.pages > 0


@dataclass
class StepDecisions:
    """Everything the controller decided for one step."""

    forward: list[LayerForward]
    backward: dict[int, LayerBackward]
    sync: SyncPlan
    end: StepEnd
    activation_bytes: np.ndarray = field(default=None)  # per rank, saved for the backward


def index_ops(ops: list[CollectiveOp]) -> dict[int, list[CollectiveOp]]:
    """rank -> the ops it takes part in, in list order."""
    by_rank: dict[int, list[CollectiveOp]] = defaultdict(list)
    for op in ops:
        for r in op.members:
            by_rank[r].append(op)
    return by_rank


def batches(ops: list[CollectiveOp]):
    """Consecutive ops of one (layer, batch) run together."""
    return [list(g) for _, g in groupby(ops, key=lambda o: (o.layer, o.batch))]


class ProgramBuilder:
    """Builds every rank's program of one step from the controller's decisions."""

    def __init__(self, scenario: Scenario, layout: Layout, compute: ComputeModel, group_create_s: float):
        self.s, self.layout, self.compute = scenario, layout, compute
        self.group_create_s = group_create_s
        m = scenario.model
        self.router_s = compute.router_time(scenario.workload.tokens_per_rank, m.hidden_size, m.num_experts)
        router_bytes = (m.hidden_size * m.num_experts + m.num_experts) * 4
        self.router_bytes = router_bytes * m.num_layers

    def expert_rows(self, fwd: LayerForward, rank: int) -> np.ndarray:
        """Rows each local expert of ``rank`` computes: kept slots of its EP group."""
        lay = self.layout
        group = lay.rank_of[lay.group_of[rank]]
        return fwd.kept[group][:, list(lay.local_experts(rank))].sum(axis=0)

    def build(self, d: StepDecisions) -> list[list[tuple]]:
        s, lay, cm = self.s, self.layout, self.compute
        m = s.model
        world = lay.world
        progs: list[list[tuple]] = [[] for _ in range(world)]
        for f in d.forward:
            route, refresh = index_ops(f.route_ops), index_ops(f.refresh_ops)
            disp, comb = index_ops(f.dispatch_ops), index_ops(f.combine_ops)
            for r in range(world):
                p = progs[r]
                p.append(("route", "compute", self.router_s))
                p.append(("route", "ops", route.get(r, [])))
                p.append(("paging", "ops", refresh.get(r, [])))
                p.append(("paging", "copy", Copy.of(f.page_moves.get(r))))
                p += [("dispatch", "ops", b) for b in batches(disp.get(r, []))]
                rows = self.expert_rows(f, r)
                p.append(("experts", "compute", cm.expert_time(rows, m.hidden_size, m.ffn_hidden_size)))
                p += [("combine", "ops", b) for b in batches(comb.get(r, []))]
        for layer in reversed(range(m.num_layers)):
            b = d.backward[layer]
            f = d.forward[layer]
            cb, db = index_ops(b.combine_backward_ops), index_ops(b.dispatch_backward_ops)
            for r in range(world):
                p = progs[r]
                p += [("combine_backward", "ops", x) for x in batches(cb.get(r, []))]
                p.append(("paging", "copy", Copy.of(b.page_moves.get(r))))
                rows = self.expert_rows(f, r)
                p.append(("experts_backward", "compute",
                          cm.expert_time(rows, m.hidden_size, m.ffn_hidden_size, backward=True)))
                p += [("dispatch_backward", "ops", x) for x in batches(db.get(r, []))]
                p.append(("route_backward", "compute", 2 * self.router_s))
        sync = d.sync
        es, ds = index_ops(sync.expert_sync_ops), index_ops(sync.dense_sync_ops)
        creations = len(sync.cache.created) if sync.cache else 0
        for r in range(world):
            p = progs[r]
            if creations:  # every rank takes part in creating a communicator (torch new_group)
                p.append(("expert_sync", "wait", creations * self.group_create_s))
            p += [("expert_sync", "ops", x) for x in batches(es.get(r, []))]
            p += [("dense_sync", "ops", x) for x in batches(ds.get(r, []))]
            updated = len(sync.updated.get(r, ())) * m.expert_bytes
            p.append(("optimizer", "compute", cm.optimizer_time(updated + self.router_bytes)))
            if d.end.heat is not None:
                p.append(("heat", "compute", cm.heat_update_time(m.num_layers * m.num_experts)))
            p.append(("paging", "copy", Copy.of(PageMoves.concat(
                [x for x in (sync.page_moves.get(r), d.end.page_moves.get(r)) if x is not None]))))
        return progs
