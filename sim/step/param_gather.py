"""The distributed optimizer's all-gathers of updated parameters on a step's streams
(``testbed.policy.distributed_optimizer``: ZeRO >= 1 with adam; issue 25, item 5).

Without ``transformer.overlap_param_gather`` they run in the in-order chain after the
optimizer step, every dense bucket's then every layer's expert shards', in order, as
Megatron-Core's ``step_with_ready_grads`` issues them. With it the step's forward is taken
as the next step's (a steady state): the all-gathers a layer's forward is the first to need
(each dense bucket's at its lowest layer, the ``layer`` the planner gives it; each layer's
expert shards' at that layer) form that layer's unit; the first unit runs on the sync stream
from the step's start, each next one is issued once the forward reaches the layer of the one
before it (``finish_param_sync`` dispatches the next bucket's), and each layer's forward
waits for its own unit (the forward pre-hook), as a wait of no seconds in the chain. The
all-gathers share links with the forward's collectives as every concurrent op does.

A pipeline stage (``sim.pipeline.run``: pipeline parallelism, or micro-batches as gradient
accumulation) is simulated as one micro-batch whose forward spans stand for every micro-batch's
(``sim.pipeline.stage_work``), while Megatron-Core waits for a bucket's all-gather in the first
micro-batch's forward only (later ones find it done). There, with ``overlap_param_gather``, the
all-gathers are taken as hidden behind the step's forwards: their bytes are counted (the byte
ledger reads the planned ops), they get no phase. Left out: the first unit's wait and their
links' contention with the forward.
"""

from __future__ import annotations

import numpy as np

from sim.step.phase_sizes import batches
from testbed.policy.collectives import CollectiveOp


class ParamGathers:
    """The all-gathers of one step (module doc) for ``builder`` (a ``PhaseBuilder``
    building it): ``dense`` and ``expert`` (in the planner's order); ``ahead``: with
    ``transformer.overlap_param_gather``; ``pipeline_stage``: one micro-batch of a pipeline
    stage's (then ``ahead`` leaves them out). Built at the step's start, where the first unit
    is issued when ``ahead``."""

    def __init__(self, builder, dense: list[CollectiveOp], expert: list[CollectiveOp], ahead: bool,
                 pipeline_stage: bool = False):
        self.b, self.dense, self.expert = builder, dense, expert
        units: dict[int, dict[str, list[CollectiveOp]]] = {}
        for stage, ops in (("dense_sync", dense), ("expert_sync", expert)):
            for op in ops:
                units.setdefault(op.layer, {}).setdefault(stage, []).append(op)
        #: layer -> [(stage, ops)] of its unit, in forward order
        self.units = {layer: list(units[layer].items()) for layer in sorted(units)}
        self.hidden = ahead and pipeline_stage  # behind the step's forwards (module doc)
        self.ahead = ahead and not pipeline_stage and bool(self.units)
        self.order = list(self.units)
        self.issued: dict[int, int] = {}  # layer -> the last phase of its unit
        self.last = -1  # the last all-gather phase on the sync stream
        if self.ahead:
            self._issue(self.order[0], -1)

    def _issue(self, layer: int, after: int) -> None:
        """``layer``'s unit on the sync stream, after the unit before it and phase ``after``."""
        for stage, ops in self.units[layer]:
            for batch in batches(ops):
                self.last = self.b.add(stage, layer, "ops", "sync", (self.last, after), ops=batch)
        self.issued[layer] = self.last

    def before_forward(self, layer: int) -> None:
        """Before ``layer``'s forward: it waits for its unit, and the next unit is issued."""
        if not self.ahead or layer not in self.issued:
            return
        b = self.b
        b.main = b.add(self.units[layer][0][0], layer, "wait", "compute", (b.main, self.issued[layer]),
                       seconds=np.zeros(b.layout.world))
        following = [x for x in self.order if x not in self.issued]
        if following:
            self._issue(following[0], b.main)

    def after_optimizer(self) -> None:
        """After the optimizer step: without ``ahead`` every all-gather, in order, in the chain;
        with it, any unit no forward reached (none when every layer ran)."""
        b = self.b
        if self.hidden:
            return
        if not self.ahead:
            for stage, ops in (("dense_sync", self.dense), ("expert_sync", self.expert)):
                for batch in batches(ops):
                    b.chain(stage, batch[0].layer, "ops", "comm", ops=batch)
            return
        for layer in [x for x in self.order if x not in self.issued]:
            self._issue(layer, b.main)
