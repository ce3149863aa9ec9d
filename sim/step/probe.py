"""M20's probe activation, modelled: how long a probed expert takes to answer.

A probe brings the expert's weights to its GPU - every page not resident crosses PCIe
(``copy.table`` and ``copy.latency_us`` of the profile, a page at a time) - and runs the
expert on ``heat.probe_tokens`` tokens (the compute model's forward of one expert). An
expert with replicas on several GPUs answers when its slowest replica has. The time each
GPU spent probing is kept for the step's heat phase (``rank_seconds``).
"""

from __future__ import annotations

import numpy as np

from sim.hardware.compute import ComputeModel
from testbed.policy.controller import Controller
from testbed.policy.page_moves import GPU
from testbed.scenario.scenario import Scenario


class ModelledProbe:
    """``probe(instances) -> seconds`` for ``HeatMap.update``, on the simulated cluster."""

    def __init__(self, scenario: Scenario, controller: Controller, compute: ComputeModel, kernel: str):
        self.s, self.controller = scenario, controller
        self.compute = compute
        self.rank_seconds = np.zeros(controller.layout.world)  # probing seconds of each GPU since ``take``
        m = scenario.model
        #: seconds of one probe's forward (its weights on the GPU)
        self.forward_s = compute.expert_time([scenario.heat.probe_tokens], m.hidden_size, m.ffn_hidden_size, kernel,
                                             matrices=m.ffn_matrices)

    def answer_s(self, rank: int, instance: int) -> float:
        """Seconds ``rank``'s replica of ``instance`` takes to answer a probe."""
        compute = self.forward_s
        if self.controller.pool is None:  # unpaged: the weights are on the GPU
            return compute
        pager, pages = self.controller.pool.pages_of(rank, instance)
        away = pager.page_nbytes[pages][pager.location[pages] != GPU]
        return float(np.sum(self.compute.copy_time(away))) + compute

    def __call__(self, instances: np.ndarray) -> np.ndarray:
        lay = self.controller.layout
        out = np.zeros(len(instances))
        for k, inst in enumerate(np.asarray(instances).tolist()):
            for group in range(lay.replicas):  # every up-to-date replica (one per EP group), as real.rank.probe
                if not self.controller.fresh[inst, group]:
                    continue
                r = lay.expert_rank(group, inst % self.s.model.num_experts)
                seconds = self.answer_s(r, inst)
                self.rank_seconds[r] += seconds
                out[k] = max(out[k], seconds)
        return out

    def take(self) -> np.ndarray:
        """[W] probing seconds of each GPU since the last ``take``."""
        out, self.rank_seconds = self.rank_seconds, np.zeros_like(self.rank_seconds)
        return out
