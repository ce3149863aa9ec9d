"""A step as phases: the controller's decisions as timed work on each GPU's streams (the
data types, and the rule by which a copy overlaps the in-order work).

A ``Phase`` is one piece of work every rank does at the same point of the step, with
per-rank sizes: a compute kernel (``seconds[r]``), a batch of concurrent collectives
(``ops``; a rank takes part in those it is a member of), page copies over its PCIe link
(``h2d[r]``, ``d2h[r]`` bytes, ``pages[r]``), or a wait (creating communicators). It runs
on one stream of the GPU (``compute``, ``comm``, ``copy``, ``sync``) after the phases
it depends on (``deps``, indices of earlier phases, per rank) and after the previous
phase of its stream. ``StepDecisions``: everything the controller decided for one step,
which ``PhaseBuilder`` (``sim.step.phase_builder``) turns into phases; times in seconds,
sizes in bytes.

Copy overlap (``copy.overlap`` f, measured on the H200 as the share of a copy's time a
concurrent matmul hides: 1 - (both - matmul alone) / copy alone): a copy of c seconds
issued beside the rank's in-order work runs its c seconds on the copy stream, and the
in-order work first waits ``(1 - f) c`` (``unhidden_seconds``), the share of the copy
nothing hides, as a ``paging`` wait on the compute stream (``Phase.hold``). Compute of
t seconds issued with the copy and the copy are then both done after
``max(c, (1 - f) c + t)``: ``t + (1 - f) c`` when t >= f c, what the measurement (a
matmul of t beside a copy of c < t) took; ``t + c``, the serial sum, at f = 0;
``max(t, c)``, the copy wholly hidden, at f = 1 (no wait phase: the phases of a
perfect overlap). The copy itself is not slowed (the measured one ended inside the
matmul). The in-order work pays the wait when the copy is issued, whatever that work is
(compute, or collectives, whose slowdown by a copy was not measured: assumed the
same); where it is shorter than f c the wait delays it more than a slowdown while both
run would, though what comes next is then mostly the experts, waiting for the copy
anyway. With f = 0 copies
run in the chain, before what needs them, as a CPU rank's synchronous copies do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from testbed.policy.collectives import CollectiveOp
from testbed.policy.pager_pool import MovesByRank
from testbed.policy.step_decisions import LayerBackward, LayerForward, StepEnd, SyncPlan


@dataclass(eq=False)
class Phase:
    stage: str
    layer: int  # -1: not a layer's
    kind: str  # compute | ops | copy | wait
    stream: str  # compute | comm | copy | sync
    deps: tuple[int, ...]
    seconds: np.ndarray | None = None  # [W] compute / wait
    ops: list[CollectiveOp] | None = None  # run concurrently
    h2d: np.ndarray | None = None  # [W] bytes host -> device
    d2h: np.ndarray | None = None  # [W] bytes device -> host
    pages: np.ndarray | None = None  # [W] pages copied
    waits_for_pages: int = -1  # index of the copy phase this one waits for (stall accounting)
    in_line: bool = False  # a copy the rank waits for in its chain (copies do not overlap compute)
    hold: int = -1  # a copy: the wait phase in which the in-order work pays its unhidden share (-1: none)
    mem_delta: np.ndarray | None = None  # [W] bytes allocated (+) or freed (-) when it ends
    mem_transient: np.ndarray | None = None  # [W] bytes held only while it runs (comm buffers)
    fitted: bool = False  # its seconds come from fitted constants (the host cost of a stage)
    fitted_s: np.ndarray | None = None  # [W] seconds of ``seconds`` from fitted constants (else none of them)


@dataclass
class StepDecisions:
    """Everything the controller decided for one step."""

    forward: list[LayerForward]
    backward: dict[int, LayerBackward]
    sync: SyncPlan
    end: StepEnd
    probe_s: np.ndarray | None = None  # [W] seconds each GPU spent on M20 probe activations

    @property
    def heat_moves(self) -> MovesByRank:
        """Page moves of a heat update applied at the first layer (heat.deferred, M18)."""
        return self.forward[0].heat_moves if self.forward else MovesByRank()

    @property
    def heat(self):
        """The heat update applied during this step: at its end or, deferred, at layer 0."""
        return self.end.heat if self.end.heat is not None else (self.forward[0].heat if self.forward else None)

    @property
    def frozen(self):
        return self.end.frozen if self.end.frozen is not None else (self.forward[0].frozen if self.forward else None)

    @property
    def heat_ops(self) -> list[CollectiveOp]:
        return self.end.heat_ops + (self.forward[0].heat_ops if self.forward else [])


def unhidden_seconds(copy_s: np.ndarray, overlap: float) -> np.ndarray:
    """[W] seconds of a copy of ``copy_s`` [W] seconds that no concurrent work hides, so
    that the rank's in-order work waits for them: ``(1 - overlap) copy_s``, ``overlap``
    the profile's ``copy.overlap`` (module doc)."""
    return (1.0 - overlap) * np.asarray(copy_s, dtype=np.float64)
