"""The expert heat map (M18), heat score and states (M19) and wake-up probes (M20).

M20: when the cold level rises, a random ``wake_fraction`` of the frozen experts get a
probe activation - the backend brings each one's weights from where they are (the host,
for a frozen expert) and runs it on ``probe_tokens`` tokens - and those that answer
within ``probe_timeout_ms`` are Warm again.

Per expert and step the caller records three metrics: compute heat (routed tokens or
kernel seconds), memory heat (page accesses) and communication heat (bytes in expert
sync). Every ``update_interval`` steps ``HeatMap.update`` sums each metric over the
sliding window, normalises it by its maximum over experts, weights the three into one
score and cuts the scores at two percentiles into Hot / Warm / Cold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from testbed.scenario.sections import HeatConfig

HOT, WARM, COLD = 0, 1, 2
STATE_NAMES = ("hot", "warm", "cold")

COMPUTE, MEMORY, COMM = 0, 1, 2  # rows of the ring buffer


def below(scores: np.ndarray, level: float) -> np.ndarray:
    """Bool mask: score < level, or score == 0 (an expert that got nothing is below any level)."""
    scores = np.asarray(scores)
    return (scores < level) | (scores == 0)


@dataclass
class HeatUpdate:
    """The outcome of one heat update; arrays are per expert ([N])."""

    step: int
    scores: np.ndarray       # float64 weighted normalised score (M19)
    states: np.ndarray       # int8 HOT/WARM/COLD after wake-up
    hot_level: float         # percentile(scores, hot_percentile)
    cold_level: float        # percentile(scores, cold_percentile)
    probed: np.ndarray       # bool: frozen experts probed this update (M20)
    woken: np.ndarray        # bool: probed experts that responded in time -> WARM
    response_s: np.ndarray   # float64 seconds each probed expert took to answer its probe (inf: not probed)
    zero_window: np.ndarray  # bool: zero compute heat over the whole window (claim C7)
    window_steps: int        # steps the window holds now (<= config.window_steps)

    def state_counts(self) -> dict[str, int]:
        """Experts per state: {"hot": n, "warm": n, "cold": n}."""
        return {name: int((self.states == code).sum()) for code, name in enumerate(STATE_NAMES)}


class HeatMap:
    """Sliding-window heat of ``num_experts`` experts and their current states.

    Randomness (which frozen experts are probed) comes only from ``rng``.
    """

    def __init__(self, num_experts: int, config: HeatConfig, rng: np.random.Generator):
        if num_experts <= 0:
            raise ValueError(f"num_experts = {num_experts}: must be > 0")
        self.num_experts = num_experts
        self.config = config
        self.rng = rng
        # The ring holds the window (M18), and at least the steps of one update interval
        self._depth = max(config.window_steps, config.update_interval)
        self._ring = np.zeros((3, self._depth, num_experts), dtype=np.float64)
        self._recorded = 0  # steps recorded so far
        self._states = np.full(num_experts, WARM, dtype=np.int8)
        self._prev_cold_level: float | None = None

    @property
    def states(self) -> np.ndarray:
        """Current HOT/WARM/COLD per expert (int8); all WARM before the first update."""
        return self._states.copy()

    @property
    def window_steps(self) -> int:
        """Steps the window holds now (<= config.window_steps)."""
        return min(self._recorded, self.config.window_steps)

    def record(self, compute: np.ndarray, memory: np.ndarray, comm: np.ndarray) -> None:
        """One step's metrics per expert ([N] each): compute heat (tokens or seconds),
        memory heat (page accesses), comm heat (bytes in expert sync). Kept in a ring
        buffer of window_steps steps (M18)."""
        row = self._recorded % self._depth
        for metric, values in ((COMPUTE, compute), (MEMORY, memory), (COMM, comm)):
            values = np.asarray(values, dtype=np.float64)
            if values.shape != (self.num_experts,):
                raise ValueError(f"heat metric has shape {values.shape}, expected ({self.num_experts},)")
            self._ring[metric, row] = values
        self._recorded += 1

    def is_due(self, step: int) -> bool:
        """Whether a heat update runs after step ``step`` (every update_interval steps, M18)."""
        return (step + 1) % self.config.update_interval == 0

    def _last(self, steps: int) -> np.ndarray:
        """[3, N] sums of the metrics over the last ``steps`` recorded steps."""
        steps = min(steps, self._recorded)
        if steps == self._depth:
            return self._ring.sum(axis=1)
        rows = (self._recorded - 1 - np.arange(steps)) % self._depth
        return self._ring[:, rows].sum(axis=1)

    def update(self, step: int, probe=None) -> HeatUpdate:
        """Score, classify and probe (M19-M20); the states become the new current states.

        ``probe(experts) -> seconds``: activates the probed experts (indices) for real and
        says how long each took to answer (the backend's: measured on real ranks, modelled
        by the simulator); None answers at once (every probe responds)."""
        cfg = self.config
        sums = self._last(cfg.window_steps)
        peak = sums.max(axis=1, keepdims=True)
        # Normalise before weighting (M19); a metric nobody has contributes 0.
        norm = np.divide(sums, peak, out=np.zeros_like(sums), where=peak > 0)
        scores = cfg.alpha * norm[COMPUTE] + cfg.beta * norm[MEMORY] + cfg.gamma * norm[COMM]
        hot_level = float(np.percentile(scores, cfg.hot_percentile))
        cold_level = float(np.percentile(scores, cfg.cold_percentile))

        states = np.full(self.num_experts, WARM, dtype=np.int8)
        states[scores > hot_level] = HOT
        states[below(scores, cold_level)] = COLD

        # M20: frozen = Cold at the previous update and Cold again now; probe a share of
        # them when the cold level rises (the crowd warmed up, maybe they did too).
        frozen = (self._states == COLD) & (states == COLD)
        probed = np.zeros(self.num_experts, dtype=bool)
        rising = self._prev_cold_level is not None and cold_level > self._prev_cold_level
        candidates = np.flatnonzero(frozen)
        if rising and candidates.size and cfg.wake_fraction > 0:
            count = min(candidates.size, max(1, math.floor(cfg.wake_fraction * candidates.size + 0.5)))
            probed[self.rng.choice(candidates, size=count, replace=False)] = True
        # A probed expert responds when its probe activation answered within the timeout.
        response = np.full(self.num_experts, np.inf)
        if probed.any():
            idx = np.flatnonzero(probed)
            response[idx] = np.asarray(probe(idx), dtype=np.float64) if probe is not None else 0.0
        woken = probed & (response <= cfg.probe_timeout_ms * 1e-3)
        states[woken] = WARM

        self._states = states
        self._prev_cold_level = cold_level
        return HeatUpdate(step=step, scores=scores, states=states.copy(), hot_level=hot_level,
                          cold_level=cold_level, probed=probed, woken=woken, response_s=response,
                          zero_window=sums[COMPUTE] == 0, window_steps=self.window_steps)
