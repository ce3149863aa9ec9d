"""What the controller decides in each phase of a step, as the records it hands a backend.

``Controller`` (``testbed.policy.controller``) answers each call of a step with one of
these: ``LayerForward`` per layer, forward (``forward_layer``), ``LayerBackward`` per layer,
backward (``backward_layer``), ``SyncPlan`` after the backward (``sync``) and ``StepEnd`` at
the step's end (``end_step``). Each holds the collective ops a backend runs (their sizes
in bytes), the page moves of the ranks it pages (``MovesByRank``) and, where the step
records them, the heat update (M18-M20) and the group-cache lookups (M10). Counts are
slots (one per token routed to an expert), per rank or EP group and expert. Both backends read
the same records: the simulator costs them, a real rank runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from testbed.policy.collectives import CollectiveOp
from testbed.policy.group_cache import CacheEvents
from testbed.policy.heat import HeatUpdate
from testbed.policy.pager_pool import MovesByRank


@dataclass
class LayerForward:
    """Decisions for one layer's forward pass."""

    layer: int
    routed: np.ndarray  # [W, E] slots routed per rank and expert
    kept: np.ndarray  # [W, E] slots kept under capacity
    active: np.ndarray  # [R, E] EP group g kept at least one slot for expert e
    route_ops: list[CollectiveOp]
    refresh_ops: list[CollectiveOp]  # batch 0: refresh requests (all_gather), batch 1: the p2p copies
    dispatch_ops: list[CollectiveOp]
    combine_ops: list[CollectiveOp]
    page_moves: MovesByRank  # per paged rank: refresh rows then access rows
    # heat.deferred (M18), layer 0 only: the last step's heat update, applied after this
    # layer's access while its experts are pinned (M13's pending work); its page moves
    # run beside this layer, not before its experts
    heat: HeatUpdate | None = None
    heat_moves: MovesByRank = field(default_factory=MovesByRank)
    heat_ops: list[CollectiveOp] = field(default_factory=list)
    frozen: dict[int, int] | None = None
    # pager.prefetch_ahead (M14): the next layer's predicted-first pages, loaded while this
    # layer computes (its experts pinned); run after this layer's own copies, beside it
    prefetch_moves: MovesByRank = field(default_factory=MovesByRank)
    # the whole transformer's tensor parallelism in the layer's block (with layer 0 the
    # embedding's, with the last the output head's), in order (Planner.dense_tp_ops)
    dense_ops: list[list[CollectiveOp]] = field(default_factory=list)

    @property
    def dropped_slots(self) -> int:
        return int(self.routed.sum() - self.kept.sum())


@dataclass
class LayerBackward:
    layer: int
    combine_backward_ops: list[CollectiveOp]
    dispatch_backward_ops: list[CollectiveOp]
    page_moves: MovesByRank  # per paged rank: reloads before the experts' backward
    dense_ops: list[list[CollectiveOp]] = field(default_factory=list)  # Planner.dense_tp_ops, backward


@dataclass
class SyncPlan:
    """Gradient sync and weight update after the backward pass."""

    expert_sync_ops: list[CollectiveOp]  # the step's discovery (layer -1) first, then per layer
    dense_sync_ops: list[CollectiveOp]  # router-gradient buckets, in backward order
    cache: CacheEvents | None  # None under allreduce sync (no cached groups)
    updated: dict[int, np.ndarray]  # per rank of paged_ranks: local instances whose weights change
    page_moves: MovesByRank  # per paged rank: update rows then stale rows


@dataclass
class StepEnd:
    heat: HeatUpdate | None  # None when no heat update was due
    page_moves: MovesByRank = field(default_factory=MovesByRank)
    heat_ops: list[CollectiveOp] = field(default_factory=list)  # at a heat update: the compute heat all-reduce
    # after a heat update: per paged rank, its local expert instances cold-migrated (M13)
    # and not brought back since (frozen: pages off the GPU, still routable, M19)
    frozen: dict[int, int] | None = None
