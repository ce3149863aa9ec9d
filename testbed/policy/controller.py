"""The controller: every policy decision of a step, in the order a step makes them.

Both backends drive the same controller: for each MoE layer, forward, it is given the
routed counts it knows (``forward_layer``: every rank's on the simulator, the EP
group's on a real rank, see below) and answers with the kept counts (M2),
the collective ops of the route / replica-refresh / dispatch / combine stages (M5, M7,
M9), and the page moves of the ranks it pages (M12-M16); for each layer, backward, the
mirrored ops; after the backward, the expert-sync and dense-sync ops with the group-cache
lookups (M8-M10) and the page moves of the weight update; at the end of the step, the
heat map update (M18-M20) and the cold / wake / hot page moves it triggers, and the
auxiliary-loss-free balancing bias's update from the whole batch's routed counts
(``router.bias_update_rate``, ``testbed.policy.bias_balance``: the routers read it from
``balance`` at the next step).
The answers are the records of ``testbed.policy.step_decisions`` (``LayerForward``,
``LayerBackward``, ``SyncPlan``, ``StepEnd``).

Micro-batches (``transformer.micro_batches`` m on a real pipeline rank, ``real.rank.worker``):
each layer's forward and backward are decided once per micro-batch (``micro_batch``), from that
micro-batch's routed counts - its kept counts (capacity per micro-batch, as Megatron's
dispatcher applies it), token exchange, replica refreshes and page accesses - while the step's
routing is their combination: the routed and kept counts summed over the micro-batches and the
EP groups' use of each expert OR-ed, which is what the expert sync, the group cache, the bias
balancing, the heat map (M18) and the routing trace see, as a one-stage run of the same tokens
in one micro-batch does. The simulator decides one micro-batch (micro-batch 0).

It is deterministic given the scenario and the routed counts, so the simulator keeps
one for the whole cluster and every real rank keeps one of its own (paging only its own
GPU): they all take the same decisions.

A real rank's controller is told only what the planner's ops bring that rank (the
simulator's is told everything and plans, and costs, the same ops):

- per layer, forward: the routed counts of its own EP group (the route all_gather; the
  rows of other groups are zero), and, while a replica of its shard's experts is stale,
  which EP groups use each of those experts (``refresh_request_ops``, passed as
  ``shard_active``). That is all the decisions that involve the rank need: its kept
  counts and its group's token exchange, its pages, and the refreshes it sends or
  receives. Refreshes between other ranks it does not see; they only set replica
  freshness, which the sync sets again for every expert used this step;
- once per step, after the forward: which EP groups used every expert of every layer
  (the M10 discovery all_gather, passed to ``sync`` as ``active``): the group cache, the
  replicas that go stale and the weight updates are decided from it on every rank alike;
- at each heat update (every ``heat.update_interval`` steps): the compute heat of every
  expert instance in the steps since the last one, summed over all ranks (the heat
  all_reduce, run by the backend's ``sum_over_ranks``, ``set_heat_io``), so that every
  heat map agrees;
- once per step with bias balancing and several replicas, beside the discovery: the
  whole batch's routed counts of every layer (``balance_counts`` summed over each
  replica group, ``Planner.balance_ops``, passed to ``tell_balance_load``), so that every
  rank moves the one bias alike.

With one replica the EP group is the world and the route all_gather tells every rank
everything.

Expert *instances* are (layer, expert) pairs numbered ``layer * E + expert``. Replica
``g`` of an instance is the copy in EP group ``g``. Under two-stage sync (M9) only the
replicas whose group routed tokens to the expert receive the summed gradient; the others
become stale and are refreshed from the nearest up-to-date replica (a p2p op in the
``paging`` stage) before they are next used. The optimizer is plain SGD, so an expert
nobody routed to has a zero gradient and does not change.
"""

from __future__ import annotations

import numpy as np

from testbed.policy.bias_balance import BiasBalance
from testbed.policy.capacity import expert_capacity, kept_counts
from testbed.policy.collectives import CollectiveOp
from testbed.policy.group_cache import CacheEvents, GroupCache
from testbed.policy.heat import HeatMap, below
from testbed.policy.pager import RankPager
from testbed.policy.pager_pool import MovesByRank, PagerPool
from testbed.policy.planner import Planner
from testbed.policy.step_decisions import LayerBackward, LayerForward, StepEnd, SyncPlan
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


class Controller:
    """The replicated policy state machine of one run (see the module doc)."""

    def __init__(self, scenario: Scenario, paged_ranks=None, layout: Layout | None = None):
        self.s = scenario
        self.layout = layout or Layout(scenario)
        self.planner = Planner(scenario, self.layout)
        m, lay = scenario.model, self.layout
        self.E, self.L = m.num_experts, m.num_layers
        self.capacity = expert_capacity(scenario.workload.tokens_per_rank, m.top_k, m.num_experts,
                                        scenario.router.capacity_factor, lay.ep_size,
                                        scenario.router.pad_capacity_to_ep)
        self.paged_ranks = list(range(lay.world) if paged_ranks is None else paged_ranks)
        # [W, L * E/P]: the rank's EP index j holds experts j*E/P.. of every layer
        local = lay.index_of[:, None] * lay.experts_per_rank + np.arange(lay.experts_per_rank)
        self._local = (np.arange(self.L)[None, :, None] * self.E + local[:, None, :]).reshape(lay.world, -1)
        self._local_experts = local  # [W, E/P] expert ids of each rank's replicas
        self.pool: PagerPool | None = None
        if scenario.pager.enabled:
            local = np.stack([self.local_instances(r) for r in self.paged_ranks])
            self.pool = PagerPool(self.paged_ranks, local, m.expert_bytes, scenario.pager)
        self.pages_per_expert = -(-m.expert_bytes // scenario.pager.page_size_bytes)
        #: fresh[i, g]: replica g of instance i holds the latest weights
        self.fresh = np.ones((self.L * self.E, lay.replicas), dtype=bool)
        self.cache = GroupCache(scenario.comm.group_cache_size)
        self.heat = HeatMap(self.L * self.E, scenario.heat, np.random.default_rng([scenario.run.seed, 0x4EA7]))
        self.step = -1
        #: the routing bias [L, E], one for every rank (auxiliary-loss-free balancing), None when off
        self.balance = (BiasBalance(scenario.router.bias_update_rate, self.L, self.E)
                        if scenario.router.bias_update_rate > 0 else None)
        #: [L, E] the whole batch's routed counts of the step, as the backend's all-reduce told them
        self._balance_load: np.ndarray | None = None
        #: per layer, the step's routed and kept counts [W, E] and use [R, E] (summed, OR-ed over micro-batches)
        self._routed: dict[int, np.ndarray] = {}
        self._kept: dict[int, np.ndarray] = {}
        self._active: dict[int, np.ndarray] = {}
        #: per (layer, micro-batch), that micro-batch's kept counts and use, for its backward
        self._micro: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._active_before: dict[int, np.ndarray] = {}
        #: (compute, memory, comm) heat of each step since the last heat update (M18)
        self._heat_pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        #: cumulative page accesses counted by the pagers, [paged ranks, local instances] (M18)
        self._accesses_seen = np.zeros((len(self.paged_ranks), self._local.shape[1]))
        #: heat.deferred: the pending steps of a due heat update not yet applied
        self._deferred = None
        #: the backend's (sum_over_ranks, probe) for heat updates (``set_heat_io``; not pickled)
        self._heat_io = (None, None)

    def set_heat_io(self, sum_over_ranks=None, probe=None) -> None:
        """The backend's heat functions, for every heat update (at a step's end, or
        deferred at the next layer 0). ``sum_over_ranks``: its heat all-reduce, [steps,
        L*E] -> the same summed over all ranks (None: what the controller holds is
        already the total). ``probe``: its M20 probe activation, expert instances ->
        seconds each took to answer (``HeatMap.update``)."""
        self._heat_io = (sum_over_ranks, probe)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_heat_io"] = (None, None)  # the backend's functions belong to the live run
        return state

    # ---- placement helpers ----------------------------------------------------------------
    def local_instances(self, rank: int) -> np.ndarray:
        """Instance ids of the expert replicas ``rank`` holds, layer-major (sorted)."""
        return self._local[rank]

    def _replica_rank(self, group: int, expert: int) -> int:
        return self.layout.expert_rank(group, expert)

    def pager_of(self, rank: int) -> RankPager | None:
        """The page table of ``rank`` (shared with the ranks in the same state)."""
        return self.pool.pager_of(rank) if self.pool is not None else None

    # ---- the step ---------------------------------------------------------------------------
    def begin_step(self, step: int, free_memory: dict[int, tuple[float, float]] | None = None) -> None:
        """A step begins. ``free_memory`` (``pager.free_memory = device``, M15): per paged
        rank, (bytes free on its device outside the page pool, device bytes), from the
        allocator on a GPU or the backend's model; it sets each pager's reserve."""
        self.step = step
        self._active_before = dict(self._active)  # the last step's users per layer: M14's prediction
        self._routed.clear()
        self._kept.clear()
        self._active.clear()
        self._micro = {}  # (a controller restored from an older checkpoint has none yet)
        self._balance_load = None
        if free_memory and self.pool is not None and self.s.pager.free_memory == "device":
            self.pool.call("set_free_memory", {int(r): tuple(map(float, v)) for r, v in free_memory.items()
                                               if int(r) in self.pool.row_of})

    def forward_layer(self, layer: int, routed: np.ndarray,
                      shard_active: dict[int, np.ndarray] | None = None, micro_batch: int = 0) -> LayerForward:
        """Decide everything of one layer's forward from ``routed`` [W, E] slot counts.

        A real rank passes its EP group's rows (the others zero) and what its refresh
        requests (``refresh_request_ops``) told it: ``shard_active`` = {EP index j:
        [R, E/P] whether each EP group kept tokens for shard j's experts} (module doc).
        ``micro_batch``: which of the step's micro-batches this is (0 first; module doc):
        the answer is that micro-batch's, its counts are added to the step's."""
        routed = np.asarray(routed)
        kept = kept_counts(routed, self.capacity)
        lay = self.layout
        active = kept[lay.rank_of].sum(axis=1) > 0  # [R, P, E] -> [R, E]
        n = lay.experts_per_rank
        for j, told in (shard_active or {}).items():
            active[:, j * n:(j + 1) * n] = told
        self._micro[layer, micro_batch] = kept, active
        if micro_batch == 0 or layer not in self._routed:
            self._routed[layer], self._kept[layer], self._active[layer] = routed, kept, active
        else:  # the step's routing: the micro-batches' combined
            self._routed[layer] = self._routed[layer] + routed
            self._kept[layer] = self._kept[layer] + kept
            self._active[layer] = self._active[layer] | active
        requests = self.refresh_request_ops(layer)
        refresh_ops, refreshed = self._refresh_stale(layer, active)
        p = self.planner
        fwd = LayerForward(
            layer, routed, kept, active,
            route_ops=p.route_ops(layer),
            refresh_ops=requests + refresh_ops,
            dispatch_ops=p.token_ops("dispatch", layer, kept),
            combine_ops=p.token_ops("combine", layer, kept),
            page_moves=MovesByRank(),
            dense_ops=p.dense_tp_ops(layer, backward=False),
        )
        deferred = self._apply_deferred(fwd) if layer == 0 and self._deferred is not None else None

        def while_pinned():
            if deferred is not None:
                deferred()
            fwd.prefetch_moves = self._prefetch(layer + 1)

        fwd.page_moves = MovesByRank.concat([refreshed, self._access(layer, while_pinned, active)])
        return fwd

    def _prefetch(self, layer: int) -> MovesByRank:
        """M14 (``pager.prefetch_ahead``): the predicted-first pages of ``layer``'s experts
        that each GPU's EP group used there in the last step, ahead of the layer."""
        if self.pool is None or not self.s.pager.prefetch_ahead or layer >= self.L or layer not in self._active_before:
            return MovesByRank()
        ranks = np.asarray(self.paged_ranks)
        experts = self._local_experts[ranks]  # [n, E/P]
        used = self._active_before[layer][self.layout.group_of[ranks][:, None], experts]
        inst = layer * self.E + experts
        wanted = {int(r): (inst[i][used[i]],) for i, r in enumerate(ranks) if used[i].any()}
        return self.pool.call("prefetch", wanted, self.step) if wanted else MovesByRank()

    def stale_shards(self, layer: int) -> list[int]:
        """EP indices j whose experts of ``layer`` have a stale replica (M9), the same on
        every rank (freshness changes only from what every rank is told)."""
        lay = self.layout
        base = layer * self.E
        stale = ~self.fresh[base:base + self.E].all(axis=1)  # [E]
        return np.flatnonzero(stale.reshape(lay.ep_size, lay.experts_per_rank).any(axis=1)).tolist()

    def refresh_request_ops(self, layer: int) -> list[CollectiveOp]:
        """The all_gathers that tell each replica of a shard with stale replicas which EP
        groups need the shard's experts of ``layer`` now (before ``forward_layer``)."""
        shards = self.stale_shards(layer)
        return self.planner.refresh_request_ops(layer, shards) if shards else []

    def _access(self, layer: int, while_pinned=None, active: np.ndarray | None = None) -> MovesByRank:
        """Pages of the layer's needed experts onto each GPU, pinned only while the layer
        computes: the next layer may evict them (and the backward loads them again).
        ``while_pinned()`` runs after the pins are taken, before they are released.
        ``active`` [R, E]: the EP groups' use of the experts now (a micro-batch's; default
        the step's)."""
        if self.pool is None:
            if while_pinned is not None:
                while_pinned()
            return MovesByRank()
        ranks = np.asarray(self.paged_ranks)
        experts = self._local_experts[ranks]  # [n, E/P]
        active = self._active[layer] if active is None else active
        used = active[self.layout.group_of[ranks][:, None], experts]
        inst = layer * self.E + experts
        moves = self.pool.call("access", {int(r): (inst[i][used[i]],) for i, r in enumerate(ranks)}, self.step)
        if while_pinned is not None:
            while_pinned()
        self.pool.call_all("end_step")  # unpin
        return moves

    def _refresh_stale(self, layer: int, active: np.ndarray):
        """p2p ops that bring stale replicas that are needed now up to date (M9, M16)."""
        ops: list[CollectiveOp] = []
        arriving: dict[int, list[int]] = {}
        lay = self.layout
        base = layer * self.E
        fresh_before = self.fresh[base:base + self.E].copy()  # a replica refreshed now cannot send yet
        need = active & ~fresh_before.T  # [R, E]
        for g, e in zip(*np.nonzero(need)):
            i = base + e
            sources = np.flatnonzero(fresh_before[e])
            src_ranks = lay.rank_of[sources, lay.shard_of_expert(e)]
            dst = self._replica_rank(g, e)
            # nearest up-to-date replica: lowest link level, then lowest rank
            src = int(src_ranks[np.lexsort((src_ranks, lay.level_matrix[src_ranks, dst]))[0]])
            ops.append(CollectiveOp("p2p", (src, dst), "paging", layer, size=self.s.model.expert_bytes,
                                    batch=1, label=f"refresh expert {e}"))
            self.fresh[i, g] = True
            arriving.setdefault(dst, []).append(i)
        if self.pool is None:
            return ops, MovesByRank()
        mine = {r: (np.array(sorted(v)),) for r, v in arriving.items() if r in self.pool.row_of}
        return ops, self.pool.call("refresh", mine, self.step)

    def backward_layer(self, layer: int, micro_batch: int = 0) -> LayerBackward:
        """Ops of one layer's backward (of micro-batch ``micro_batch``, module doc), and the
        page moves that bring its experts back."""
        kept, active = self._micro.get((layer, micro_batch), (self._kept[layer], self._active[layer]))
        return LayerBackward(layer,
                             self.planner.token_ops("combine_backward", layer, kept),
                             self.planner.token_ops("dispatch_backward", layer, kept),
                             self._access(layer, active=active),
                             dense_ops=self.planner.dense_tp_ops(layer, backward=True))

    def active_groups(self, layer: int) -> list[tuple[int, ...]]:
        """A_e for every expert of ``layer``: sorted ranks of replicas that hold a gradient."""
        lay = self.layout
        ranks = lay.rank_of[:, np.arange(self.E) // lay.experts_per_rank]  # [R, E]: the replica of e in group g
        active = self._active[layer]
        return [tuple(sorted(ranks[active[:, e], e].tolist())) for e in range(self.E)]

    def sync(self, active: np.ndarray | None = None) -> SyncPlan:
        """Expert and dense gradient sync after the backward, and the weight update.

        ``active`` [L, R, E]: which EP groups kept tokens for each expert (a real rank
        passes what the discovery all_gather told it; None = what the forward was told,
        the whole cluster on the simulator)."""
        if active is not None:
            for layer in range(self.L):
                self._active[layer] = np.asarray(active[layer], dtype=bool)
        two_stage = self.s.comm.expert_sync == "two_stage"
        # the discovery (M10) and the bias counts' all-reduce: once per step, side by side
        expert_ops: list[CollectiveOp] = self.planner.discovery_ops() + self.planner.balance_ops()
        cache = CacheEvents() if two_stage and self.layout.replicas > 1 else None
        comm_heat = np.zeros(self.L * self.E)
        fresh_before = self.fresh.copy()
        for layer in reversed(range(self.L)):  # gradients are ready last layer first
            groups = self.active_groups(layer)
            ops = self.planner.expert_sync_ops(layer, groups)
            expert_ops += ops
            if cache is not None:
                self.cache.lookup([op.members for op in ops if op.kind == "reduce_scatter"], cache)
            self._comm_heat(layer, groups, ops, comm_heat)
            if two_stage:
                self._mark_stale(layer, groups)
        # buckets in backward order; with overlap.sync_with_backward each runs once its layer's backward is done
        dense_ops = self.planner.dense_sync_ops()
        self._comm_heat_step = comm_heat
        active = np.stack([self._active[l] for l in range(self.L)])  # [L, R, E]
        any_tokens = active.any(axis=1).reshape(-1)  # [L*E]: the summed gradient is non-zero
        updated, stale = {}, {}
        for r in self.paged_ranks:
            local = self.local_instances(r)
            g = self.layout.group_of[r]
            if two_stage:  # only A_e's members receive the gradient (M9)
                changed = active[:, g, :].reshape(-1)[local]
            else:
                changed = any_tokens[local]
            updated[r] = local[changed]
            stale[r] = local[fresh_before[local, g] & ~self.fresh[local, g]]
        moves = MovesByRank()
        if self.pool is not None:
            moves = MovesByRank.concat([self.pool.call("apply_update", {r: (u,) for r, u in updated.items()}),
                                        self.pool.call("invalidate", {r: (x,) for r, x in stale.items() if len(x)})])
        return SyncPlan(expert_ops, dense_ops, cache, updated, moves)

    # ---- bias balancing (testbed.policy.bias_balance) ------------------------------------------
    def balance_counts(self, rank: int) -> np.ndarray:
        """[L, E] int32: what ``rank`` adds to the step's bias all-reduce
        (``Planner.balance_ops``, over its replica group): the slots its EP group routed
        to each expert, which its route all_gathers told it."""
        members = list(self.layout.ep_group(int(self.layout.group_of[rank])))
        return np.stack([self._routed[l][members].sum(axis=0) for l in range(self.L)]).astype(np.int32)

    def tell_balance_load(self, load_LE: np.ndarray) -> None:
        """The bias all-reduce's answer: [L, E] slots the whole batch routed to each expert
        this step (a real rank's controller, told only its EP group's counts)."""
        self._balance_load = np.asarray(load_LE, dtype=np.int64)

    def _whole_batch_load(self) -> np.ndarray:
        """[L, E] the step's load for the bias: as told, else the sum of every rank's counts
        this controller was told (the simulator's whole cluster; with one replica every
        rank's, from the route all_gathers). A rank's controller (paging only its own rank)
        with several replicas must have been told: its counts are only its EP group's."""
        if self._balance_load is not None:
            return self._balance_load
        if self.planner.balance_ops() and len(self.paged_ranks) < self.layout.world:
            raise RuntimeError("bias balancing: the whole batch's load was not told "
                               "(tell_balance_load, after the Planner.balance_ops all-reduce)")  # a testbed bug
        return np.stack([self._routed[l].sum(axis=0) for l in range(self.L)])

    def _mark_stale(self, layer: int, groups: list[tuple[int, ...]]) -> None:
        base = layer * self.E
        active = self._active[layer]
        for e in range(self.E):
            if active[:, e].any():  # a non-empty A_e changes the weights: others fall behind
                self.fresh[base + e] = active[:, e]

    def _comm_heat(self, layer, groups, ops, out) -> None:
        """Bytes of expert sync attributed to each expert of ``layer`` (M18's comm heat)."""
        base = layer * self.E
        if self.s.comm.expert_sync == "two_stage":
            for op in ops:
                out[base + int(op.label.split()[-1])] += op.wire_bytes
        else:  # one all-reduce per shard, shared equally by its experts
            per_rank = self.layout.experts_per_rank
            for op in ops:
                j = int(op.label.split()[-1])
                out[base + j * per_rank: base + (j + 1) * per_rank] += op.wire_bytes / per_rank

    def end_step(self, compute_heat: np.ndarray | None = None) -> StepEnd:
        """Note the step's heat (M18) and, when due, record it, update the heat map and
        move pages (M13, M19, M20).

        The heat map is read only at its updates, so the steps since the last update are
        kept aside and recorded when one is due; the compute heat of those steps is then
        summed over all ranks in one all-reduce (``heat_ops``). ``compute_heat`` [L*E]:
        what this controller's ranks contributed this step, measured expert seconds
        (heat.compute_source = measured) or kept slots (a real rank, told only its group's
        counts, passes its own); None = the kept slots the forward was told (the whole
        cluster on the simulator, or every rank with one replica). The heat all-reduce
        and probe are the backend's (``set_heat_io``). First, with bias balancing, the
        routing bias moves by the whole batch's routed counts (``BiasBalance.update``,
        ``tell_balance_load``).
        """
        if self.balance is not None:  # the bias the next step routes with
            self.balance.update(self._whole_batch_load())
        sum_over_ranks, probe = self._heat_io
        kept = np.stack([self._kept[l] for l in range(self.L)])  # [L, W, E]
        active = np.stack([self._active[l] for l in range(self.L)])  # [L, R, E]
        tokens = kept.sum(axis=1).reshape(-1).astype(np.float64)
        compute = tokens if compute_heat is None else np.asarray(compute_heat, dtype=np.float64)
        if not self.s.heat.enabled:  # no heat map at all (a baseline without M18-M20)
            return StepEnd(None, self._defragment())
        self._heat_pending.append((compute, self._memory_heat(active), self._comm_heat_step))
        if not self.heat.is_due(self.step):
            return StepEnd(None, self._defragment())
        pending, self._heat_pending = self._heat_pending, []
        if self.s.heat.deferred:  # M18 off the critical path: applied at the next step's layer 0
            self._deferred = pending
            return StepEnd(None, self._defragment())
        update, heat_ops, moves, frozen = self._heat_update(pending, sum_over_ranks, probe)
        if self.pool is None:
            return StepEnd(update, moves, heat_ops)
        return StepEnd(update, MovesByRank.concat([moves, self._defragment()]), heat_ops, frozen)

    def _memory_heat(self, active: np.ndarray) -> np.ndarray:
        """[L*E] this step's page accesses on this controller's GPUs (M18): what their
        pagers counted (``RankPager.accesses``: every page of an expert each time it is
        accessed, forward and backward); without paging, every page of each used
        replica read twice (forward, backward) - the same count, from the routing."""
        if self.pool is None:
            return (2 * active.sum(axis=1) * self.pages_per_expert).reshape(-1).astype(np.float64)
        pool = self.pool
        counts = np.stack([p.accesses for p in pool.pagers])[pool.class_of].astype(np.float64)
        delta, self._accesses_seen = counts - self._accesses_seen, counts
        out = np.zeros(self.L * self.E)
        np.add.at(out, self._local[self.paged_ranks].ravel(), delta.ravel())
        return out

    def _heat_update(self, pending, sum_over_ranks, probe):
        """Record the pending steps' heat, update the heat map (M18-M20) and move pages
        (M13, M19, M20): (update, heat ops, page moves, frozen per paged rank or None)."""
        counted_here = self.pool is not None and sum_over_ranks is not None  # pagers of this rank only
        if counted_here:  # compute and memory heat of this rank, summed over all ranks at once
            both = sum_over_ranks(np.stack([np.stack([c, mem]) for c, mem, _ in pending]))  # [steps, 2, L*E]
            computes, memories = both[:, 0], both[:, 1]
        else:
            computes = np.stack([c for c, _, _ in pending])  # [steps, L*E]
            if sum_over_ranks is not None:
                computes = sum_over_ranks(computes)
            memories = [mem for _, mem, _ in pending]
        for c, mem, (_, _, comm) in zip(computes, memories, pending):
            self.heat.record(c, mem, comm)
        update = self.heat.update(self.step, probe)
        heat_ops = self.planner.heat_ops(len(pending)) + self.planner.probe_ops(int(update.probed.sum()))
        if self.pool is None:
            return update, heat_ops, MovesByRank(), None
        level = np.percentile(update.scores, self.s.pager.cold_percentile)
        below_cold = below(update.scores, level)
        per_rank = {}
        for r in self.paged_ranks:
            local = self.local_instances(r)
            per_rank[r] = (below_cold[local], update.states[local], update.woken[local])
        moves = self.pool.call("heat_update", per_rank, self.step)
        frozen = {r: len(self.pool.pager_of(r).frozen_experts()) for r in self.paged_ranks}
        return update, heat_ops, moves, frozen

    def _apply_deferred(self, fwd: LayerForward):
        """heat.deferred (M18): the last step's due heat update, to run while layer 0's
        experts are pinned (M13: they have pending work, so they are not migrated now);
        its results go into ``fwd``."""
        pending, self._deferred = self._deferred, None
        sum_over_ranks, probe = self._heat_io

        def run():
            fwd.heat, fwd.heat_ops, fwd.heat_moves, fwd.frozen = self._heat_update(pending, sum_over_ranks, probe)
        return run

    def _defragment(self) -> MovesByRank:
        """M17: at the step's end, compact the device pool of every paged GPU whose pool
        is more fragmented than ``pager.defrag_threshold``, or of every one each
        ``pager.defrag_interval`` steps (``RankPager.defragment``)."""
        cfg = self.s.pager
        if self.pool is None or not (cfg.defrag_threshold or cfg.defrag_interval):
            return MovesByRank()
        periodic = bool(cfg.defrag_interval) and (self.step + 1) % cfg.defrag_interval == 0
        due = self.paged_ranks if periodic else self.pool.ranks_where(
            lambda pager: pager.fragmentation > cfg.defrag_threshold, self.paged_ranks)
        return self.pool.call("defragment", {int(r): () for r in due}) if len(due) else MovesByRank()
