"""The fast evaluation of a layout (issue 27, item 2; ``sim.representative_slice``): where every
block of EP groups, TP groups and their DP replicas sees the same routing law, simulate two
blocks of GPUs and scale, instead of every GPU of the simulated scenario (the whole scenario,
or with a pipeline or micro-batches each simulated stage's, ``sim.pipeline.run``).

A block (``block_gpus``): the fewest whole nodes that hold whole TP x CP groups and whole
ETP x EP groups (Megatron-Core's order puts those inner axes on consecutive ranks, so ranks
0 .. B-1 are such a block and the W GPUs are W / B copies of it). The slice (``slice_gpus``) is
two blocks, so that every DP and expert-DP group has two members in it and the slice plans
the gradient sync the whole scenario plans; its scenario (``slice_scenario``) has the same
tokens per GPU and micro-batches and the same layout inside a block, its ranks the first GPUs
of the *whole* scenario's fabric. What crosses slices is kept at the whole size
(``SliceTimer``):

- the collectives of the gradient sync (stages ``expert_sync`` and ``dense_sync``: the dense
  gradients over DP x CP, the experts' over expert DP, the distributed optimizer's
  reduce-scatter and all-gather, M10's world all-gather) are timed over their whole groups on
  the whole fabric: a slice op over members M stands for the op over M + k S for every slice
  k (S its GPUs: that is its whole DP group), so the slice's sync ops are all of the whole
  cluster's, with their contention; they are timed on the slice's own links and the spine's
  (``SliceTimer.kept``: every other slice's links carry the same, and nothing else of the slice);
- every other op's bytes on the spine level (the leaves' uplinks, shared by every slice under
  one leaf) count as many times as slices share the leaf (``spine_share``): the other slices
  send the same by symmetry; NVLink, NIC and PCIe links are a slice's own;
- the ZeRO shards of memory are the whole scenario's (``whole_zero_shards``).

A step's record is the slice's with its totals over the GPUs scaled by W / S
(``scale_record``), the sync stages' bytes those of the whole groups (``SyncBytes``); times and
memory are per GPU, as simulated. The run's ``extra`` (and summary) has
``representative_slice``: whether the slice was used, why not, and its size.

The conditions (``slice_refusal``), which make every slice's routing law and state alike: the
synthetic workload (no ``workload.trace``), ``workload.locality`` = 0 and no
``router.local_bias`` (skew and drift act on every rank alike, so they are allowed), no paging,
no heat map, no faults, contiguous EP groups (``parallelism.placement`` = topology), the
analytic network model for the simulated scenario (the flow model is kept exact: it runs on
at most ``sim.flow_max_gpus`` GPUs anyway), a slice of whole micro-clusters or whole nodes of
one, at least two slices, the slice's TP, CP, EP, ETP and TP x EP groups the whole scenario's,
and no oversubscribed spine where the slice's own traffic crosses it (rail-optimised leaves
or a slice over several micro-clusters: the share counted for the other slices, which is
enough under a non-blocking spine, left a 9% gap there). Where one does not hold, the full
simulation runs and ``representative_slice`` says which.

Left out: the other slices' own traffic on their NICs where the sync's rings cross them (the
sync meets the same traffic on slice 0's links, by symmetry); the spread of W / S slices'
routing draws (the slice draws S GPUs'); the communication buffers of the sync collectives,
sized by the slice's groups (the fullest GPU's memory within 1.2% on the configs measured); a
pipeline's sync bytes corrected from the run's own stage's. Measured agreement and speed:
benchmarks/plan_speed.py, tests/sim/test_representative_slice.py.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sim.network.analytic_timer import AnalyticTimer, StageLoad
from testbed.layout.process_groups import build_process_groups
from testbed.model.whole_model import zero_shards
from testbed.policy.collectives import ByteLedger, CollectiveOp
from testbed.policy.distributed_optimizer import PARAM_GATHER_LABEL
from testbed.policy.expert_tensor_parallel import expert_zero_shards
from testbed.run.guards import network_mode
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import SPINE

#: the stages whose collectives span the blocks: timed over their whole groups
SYNC_STAGES = ("expert_sync", "dense_sync")
#: the fabric's blocks of links with one link per GPU (``sim.hardware.fabric``), in rank order
GPU_BLOCKS = ("nvlink_up", "nvlink_down", "nic_up", "nic_down", "h2d", "d2h")
#: the group kinds a block holds whole (checked against the whole scenario's groups)
INNER_KINDS = ("tp", "cp", "ep", "etp", "tp_ep")


def block_gpus(s: Scenario) -> int:
    """GPUs of a block (module doc): whole nodes holding whole TP x CP and ETP x EP groups."""
    p = s.parallelism
    return math.lcm(p.tp_size * p.cp_size, p.ep_size * p.etp_size, s.cluster.gpus_per_node)


def slice_gpus(s: Scenario) -> int:
    """GPUs of the slice: two blocks (``block_gpus``), so that every DP and expert-DP group
    has two members in it and the slice plans the gradient sync the whole scenario does."""
    return 2 * block_gpus(s)


def slice_refusal(s: Scenario) -> str | None:
    """Why the representative slice cannot stand for ``s`` (one line), or None where it can
    (module doc). ``s``: a scenario simulated on its own (a pipeline stage's, or the whole
    non-pipelined scenario)."""
    w, r, p = s.workload, s.router, s.parallelism
    reasons = [
        (bool(w.trace), "a replayed trace routes each rank its own way"),
        (w.locality != 0, "workload.locality gives each rank its own popularity"),
        (r.local_bias != 0, "router.local_bias favours each rank's local experts"),
        (s.pager.enabled, "paging keeps per-rank page state"),
        (s.heat.enabled, "the heat map keeps per-rank state"),
        (bool(s.faults), "faults hit single links"),
        (p.placement != "topology", "parallelism.placement is not topology"),
        (network_mode(s) != "analytic", "the flow network model (sim.network_model) runs on every GPU"),
    ]
    for bad, why in reasons:
        if bad:
            return why
    b = slice_gpus(s)
    if s.world_size % b or s.world_size // b < 2:
        return f"{s.world_size} GPUs are not two or more slices of {b}"
    c = s.cluster
    nodes, per_mc = b // c.gpus_per_node, c.nodes_per_microcluster
    if per_mc % nodes and nodes % per_mc:
        return f"a slice of {nodes} nodes is neither whole micro-clusters nor whole nodes of one"
    crosses = (c.rail_optimized and nodes > 1) or nodes > per_mc  # the slice's own traffic on the spine
    if c.leaf_spine_oversubscription > 1 and crosses:
        return ("an oversubscribed spine (cluster.leaf_spine_oversubscription) carries the slice's own traffic: "
                "the other slices' share of it is not exact (9% on tests/sim/test_representative_slice.py's)")
    return _groups_refusal(s, b)


def _groups_refusal(s: Scenario, b: int) -> str | None:
    """Where the slice's inner groups are not the whole scenario's first ones (module doc)."""
    p = s.parallelism
    args = (p.tp_size, p.cp_size, 1, p.ep_size, p.etp_size, p.moe_layout)
    whole, part = build_process_groups(s.world_size, *args), build_process_groups(b, *args)
    for r in range(b):
        g, h = whole.of(r), part.of(r)
        for kind in INNER_KINDS:
            if getattr(g, kind) != getattr(h, kind):
                return f"rank {r}'s {kind} group leaves the slice of {b} GPUs"
    return None


def slice_scenario(s: Scenario) -> Scenario:
    """``s`` on its first slice of GPUs (``slice_gpus``): the same tokens per GPU and
    micro-batches (no longer derived from the global batch), the analytic network model."""
    b, c = slice_gpus(s), s.cluster
    nodes = b // c.gpus_per_node
    if nodes % c.nodes_per_microcluster == 0:
        cluster = {"microclusters": nodes // c.nodes_per_microcluster}
    else:
        cluster = {"microclusters": 1, "nodes_per_microcluster": nodes}
    data = s.to_dict()
    data["cluster"].update(cluster)
    data["workload"].update(global_batch=0, micro_batch_size=1, tokens_per_rank=s.workload.tokens_per_rank)
    data["transformer"].update(micro_batches=s.transformer.micro_batches)
    data["sim"].update(network_model="analytic")
    return Scenario.from_dict(data)


def spine_share(s: Scenario) -> int:
    """Slices whose GPUs hang off the same leaves (each sends the slice's bytes up them)."""
    return max(1, s.cluster.gpus_per_microcluster // slice_gpus(s))


def whole_zero_shards(s: Scenario) -> tuple[int, int, int, int]:
    """ZeRO's (dense state, expert state, dense gradient, expert gradient) shards of the
    whole scenario ``s``, as ``PhaseBuilder.zero`` counts them."""
    zero = zero_shards(s)
    if s.parallelism.etp_size > 1:
        state, grad = expert_zero_shards(s, s.world_size)
        zero = (zero[0], state, zero[2], grad)
    return zero


class SliceTimer(AnalyticTimer):
    """The analytic timer of the first of ``slices`` slices of ``gpus`` GPUs, on the whole
    scenario's fabric (module doc): sync ops over their whole groups, other ops' spine bytes
    ``share`` times."""

    def __init__(self, model, gpus: int, slices: int, share: int):
        super().__init__(model)
        self.gpus, self.slices, self.share = gpus, slices, share
        self.spine = self.fabric.level == SPINE  # [E] the leaves' uplinks and downlinks
        #: [E] the links a whole sync op is timed on: the slice's GPUs' own and the spine's (by
        #: symmetry every other slice's links carry what the slice's do, and nothing of the slice)
        self.kept = self.spine.copy()
        for b in GPU_BLOCKS:
            self.kept[self.fabric.offset[b]:self.fabric.offset[b] + gpus] = True
        self._whole: dict[tuple, tuple] = {}

    def whole_members(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """The whole scenario's group a slice's sync group M stands for: M + k S, every slice k."""
        got = self._whole.get(members)
        if got is None:
            copies = np.asarray(members)[None, :] + self.gpus * np.arange(self.slices)[:, None]
            got = self._whole[members] = tuple(sorted(int(x) for x in copies.ravel()))
        return got

    def whole_op(self, op: CollectiveOp) -> CollectiveOp:
        """The whole cluster's op a slice's sync op stands for (module doc); others as they are."""
        if op.stage not in SYNC_STAGES or op.kind == "p2p":
            return op
        size = op.size
        if op.kind == "all_gather" and op.label.startswith(PARAM_GATHER_LABEL):
            size = -(-size // self.slices)  # a member's shard of the whole DP group's
        return dataclasses.replace(op, members=self.whole_members(op.members), size=size)

    def _shared(self, load: StageLoad) -> StageLoad:
        if self.share == 1 or not len(load.edges):
            return load
        up = self.spine[load.edges]
        if not up.any():
            return load
        return load._replace(nbytes=np.where(up, load.nbytes * self.share, load.nbytes))

    def _kept(self, load: StageLoad) -> StageLoad:
        keep = self.kept[load.edges]
        return load._replace(edges=load.edges[keep], nbytes=load.nbytes[keep], messages=load.messages[keep])

    def stage_loads(self, op: CollectiveOp) -> list[StageLoad]:
        if op.stage in SYNC_STAGES and op.kind != "p2p":
            return [self._kept(load) for load in super().stage_loads(self.whole_op(op))]
        return [self._shared(load) for load in super().stage_loads(op)]

    def all_to_all_loads(self, members, ops):
        loads, big = super().all_to_all_loads(members, ops)
        return [self._shared(load) for load in loads], big


class SyncBytes:
    """What the slice's sync ops miss of the whole groups' bytes: per sync stage the ratio of
    the whole ops' bytes to ``slices`` times the slice's, per link level the difference."""

    def __init__(self, ops: list[CollectiveOp], timer: SliceTimer, part_layout, whole_layout, rs_as_ar: bool):
        part, whole = ByteLedger(part_layout, None, rs_as_ar), ByteLedger(whole_layout, None, rs_as_ar)
        for op in ops:
            part.add_op(op)
            whole.add_op(timer.whole_op(op))
        b = timer.slices
        self.stage_ratio = {k: whole.by_stage.get(k, 0) / (b * v) for k, v in part.by_stage.items() if v}
        got, want = part.level_dict(), whole.level_dict()
        self.level_delta = {k: want.get(k, 0) - b * got.get(k, 0) for k in set(got) | set(want)}


def scale_record(record, factor: int, sync: SyncBytes | None = None, sync_counted: int = 1) -> None:
    """A slice's step record made the whole scenario's: totals over the GPUs (bytes, slots,
    page moves) times ``factor`` = W / S, the sync stages' bytes those of the whole groups
    (``sync``, counted ``sync_counted`` times: once per pipeline rank); per-GPU figures as they
    are; no wire bytes (the slice's links carried one slice's traffic and the whole sync's)."""
    ratio = sync.stage_ratio if sync is not None else {}
    record.bytes_by_stage = {k: int(round(int(v) * factor * ratio.get(k, 1.0)))
                             for k, v in record.bytes_by_stage.items()}
    delta = sync.level_delta if sync is not None else {}
    record.bytes_by_level = {k: int(v) * factor + int(delta.get(k, 0)) * sync_counted
                             for k, v in record.bytes_by_level.items()}
    record.wire_bytes_by_level = None
    record.routed_slots *= factor
    record.dropped_slots *= factor
    record.page_moves *= factor
    record.page_bytes *= factor


def use_whole_shards(builder, whole: Scenario) -> None:
    """The slice's phase builder given the whole scenario's ZeRO shards (``whole_zero_shards``)
    and the gradient bytes a GPU keeps under them."""
    old, new = builder.zero, whole_zero_shards(whole)
    builder.zero = new
    builder.block_grads = [g * old[2] / new[2] for g in builder.block_grads]
    builder.shared_grads = builder.shared_grads * old[2] / new[2]
    builder.dense_block_grads = [g - builder.shared_grads for g in builder.block_grads]
