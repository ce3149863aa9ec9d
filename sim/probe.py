"""M20's probe activation, modelled: how long a probed expert takes to answer.

A probe brings the expert's weights to its GPU - every page not resident crosses PCIe
(``copy.table`` and ``copy.latency_us`` of the profile, a page at a time) - and runs the
expert on ``heat.probe_tokens`` tokens (the compute model's forward of one expert). An
expert with replicas on several GPUs answers when its slowest replica has. The time each
GPU spent probing is kept for the step's heat phase (``rank_seconds``).
"""

from __future__ import annotations

import numpy as np

from sim.compute import ComputeModel
from testbed.controller import Controller
from testbed.page_moves import GPU
from testbed.scenario import Scenario


class ModelledProbe:
    """``probe(instances) -> seconds`` for ``HeatMap.update``, on the simulated cluster."""

    def __init__(self, scenario: Scenario, controller: Controller, compute: ComputeModel, kernel: str):
        self.s, self.controller, self.compute, self.kernel = scenario, controller, compute, kernel
        world = controller.layout.world
        self.rank_seconds = np.zeros(world)  # probing seconds of each GPU since ``take``
        self._local = [set(controller.local_instances(r).tolist()) for r in range(world)]

    def _holders(self, instance: int) -> list[int]:
        return [r for r, held in enumerate(self._local) if instance in held]

    def answer_s(self, rank: int, instance: int) -> float:
        """Seconds ``rank``'s replica of ``instance`` takes to answer a probe."""
        m, pager_cfg = self.s.model, self.s.pager
        compute = self.compute.expert_time([self.s.heat.probe_tokens], m.hidden_size, m.ffn_hidden_size, self.kernel)
        pager = self.controller.pager_of(rank)
        if pager is None:  # unpaged: the weights are on the GPU
            return compute
        pages = pager.pages_of(self._pager_id(rank, instance))
        away = pager.location[pages] != GPU
        nbytes = pager.page_nbytes[pages][away]
        copies = float(np.sum(self.compute.copy_time(np.minimum(nbytes, pager_cfg.page_size_bytes)))) if away.any() else 0.0
        return copies + compute

    def _pager_id(self, rank: int, instance: int) -> int:
        """``instance`` in the ids of the pager ``rank`` shares (its class's id row)."""
        pool = self.controller.pool
        row = pool.row_of[rank]
        id_row = pool.id_row[pool.class_of[row]]
        k = int(np.searchsorted(pool.local[row], instance))
        return int(pool.local[id_row][k])

    def __call__(self, instances: np.ndarray) -> np.ndarray:
        out = np.zeros(len(instances))
        for k, inst in enumerate(np.asarray(instances).tolist()):
            for r in self._holders(int(inst)):
                seconds = self.answer_s(r, int(inst))
                self.rank_seconds[r] += seconds
                out[k] = max(out[k], seconds)
        return out

    def take(self) -> np.ndarray:
        """[W] probing seconds of each GPU since the last ``take``."""
        out, self.rank_seconds = self.rank_seconds, np.zeros_like(self.rank_seconds)
        return out
