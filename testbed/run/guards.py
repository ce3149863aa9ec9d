"""Guards before work starts: what a run would allocate and how long it would take,
against what this machine holds.

``estimate(scenario, backend)`` gives, from the scenario's sizes alone:

- the largest single allocation (bytes): one expert's weights, a rank's tokens, the
  routing trace of the run, the simulator's rank-by-rank level matrix, ...;
- the memory the run needs (bytes): the simulator's per-rank arrays and routing trace, or
  every real rank's expert weights (paged copy on the host included), activations,
  gradients and training task (``task_bytes``: the synthetic task's teacher matrices);
- the simulator's wall time (seconds): events per step (about 270 per layer and GPU: phases
  on each GPU and collective ops) at the event rates ``benchmarks/sim_speed.py`` measured
  (analytic about 3e6 events/s, flow about 5e4).

``check_size`` refuses, with one line naming the size and the limit (``ScenarioError``),
a run whose memory exceeds ``MEMORY_SHARE`` of this machine's available memory, whose
largest allocation exceeds the same, or whose simulated wall time exceeds
``TIME_LIMIT_S``; ``force`` lets it run anyway. The estimates are deliberately rough
(within a few times): they catch runs that could never finish here, not ones that might.
"""

from __future__ import annotations

from pathlib import Path

from testbed.core.errors import ScenarioError
from testbed.core.units import format_bytes
from testbed.scenario.scenario import Scenario

MEMORY_SHARE = 0.8  # of MemAvailable a run may take
TIME_LIMIT_S = 3600.0  # simulated runs longer than this (wall time) need --force
EVENTS_PER_S = {"analytic": 3e6, "flow": 5e4}
EVENTS_PER_LAYER_GPU = 270  # benchmarks/sim_speed.py: 557,376 events a step on 64 GPUs of 32 layers
PHASES_PER_LAYER = 24  # forward and backward phases of one layer on one rank (order of magnitude)
BYTES_PER_RANK_PHASE = 64  # start, end, fitted, memory per phase and rank (float64)


def available_memory() -> int:
    """Bytes this machine can still give (``MemAvailable``; 8 GiB when unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def network_mode(scenario: Scenario) -> str:
    """The simulator's network model for this scenario (``sim.network_model``, auto by size)."""
    mode = scenario.sim.network_model
    if mode == "auto":
        return "flow" if scenario.world_size <= scenario.sim.flow_max_gpus else "analytic"
    return mode


def task_bytes(scenario: Scenario) -> int:
    """Bytes one real rank's training task holds (host memory, ``real.kernels.task``): the
    synthetic task's cluster centers [E, H] and teacher matrices [E, H, H] and a batch's
    x and y [T, H], fp32; the whole transformer's token task its target permutation [V]
    and a batch's token and target ids [T], int64."""
    m, t = scenario.model, scenario.workload.tokens_per_rank
    if scenario.transformer.enabled:
        return 8 * (scenario.transformer.vocab_size + 2 * t)
    return 4 * (m.num_experts * m.hidden_size * (m.hidden_size + 1) + 2 * t * m.hidden_size)


def estimate(scenario: Scenario, backend: str) -> dict:
    """Rough sizes of a run: ``largest_allocation`` and ``memory`` (bytes), ``wall_s``
    (simulator only; None for the real backend), and ``largest`` (what it is)."""
    m, w, run = scenario.model, scenario.world_size, scenario.run
    E, L, T, H = m.num_experts, m.num_layers, scenario.workload.tokens_per_rank, m.hidden_size
    routing = run.steps * L * w * E * 12  # the routing of every step, as counts and as the stored trace
    c = scenario.cluster
    gpus = f"{w:,} GPUs ({c.gpus_per_node} x {c.nodes_per_microcluster} x {c.microclusters})"
    allocations = [  # (fields, their values, what is allocated, bytes)
        ("model.hidden_size x model.ffn_hidden_size", f"{H} x {m.ffn_hidden_size}", "one expert's weights",
         m.expert_bytes),
        ("run.steps x model.num_layers x cluster x model.num_experts", f"{run.steps} x {L} x {w:,} x {E}",
         "the routing trace", routing),
    ]
    if backend != "sim":  # the simulator routes counts, never the tokens' hidden states
        allocations.append(("workload.tokens_per_rank x model.hidden_size", f"{T} x {H}", "a rank's routed tokens",
                            T * H * max(m.dtype_bytes, 4) * m.top_k))
    if backend == "sim":
        allocations.append(("cluster", gpus, "the simulator's rank-by-rank level matrix", w * w))
        phases = PHASES_PER_LAYER * L + 16
        memory = routing + w * w + phases * w * BYTES_PER_RANK_PHASE + w * E * L * 64
        wall_s = run.steps * EVENTS_PER_LAYER_GPU * L * w / EVENTS_PER_S[network_mode(scenario)]
    else:
        if not scenario.transformer.enabled:
            allocations.append(("model.num_experts x model.hidden_size x model.hidden_size", f"{E} x {H} x {H}",
                                "the task's teacher matrices (fp32, on every rank)", 4 * E * H * H))
        # an expert's slice under expert tensor parallelism
        local = m.num_experts // scenario.parallelism.ep_size * L * m.expert_bytes // scenario.parallelism.etp_size
        per_rank = 3 * local + 6 * T * m.top_k * H * max(m.dtype_bytes, 4)  # weights, host pages, grads; activations
        memory = w * (per_rank + task_bytes(scenario)) + routing
        wall_s = None
    fields, values, what, size = max(allocations, key=lambda a: a[3])
    return {"largest": (fields, values, what), "largest_allocation": size, "memory": memory, "wall_s": wall_s,
            "gpus": gpus}


def check_size(scenario: Scenario, backend: str, force: bool = False) -> dict:
    """Raise ``ScenarioError`` when the run cannot fit this machine (module doc), unless
    ``force``; returns the estimate."""
    est = estimate(scenario, backend)
    if force:
        return est
    limit = int(MEMORY_SHARE * available_memory())
    gpus = est["gpus"]
    if est["largest_allocation"] > limit:
        fields, values, what = est["largest"]
        raise ScenarioError(fields, values, f"{what} would take {format_bytes(est['largest_allocation'])} in one "
                            f"piece, more than the {format_bytes(limit)} this machine can give (--force to try anyway)")
    if est["memory"] > limit:
        raise ScenarioError("cluster", gpus, f"the {backend} backend would need about {format_bytes(est['memory'])}, "
                            f"more than the {format_bytes(limit)} this machine can give (--force to try anyway)")
    if est["wall_s"] is not None and est["wall_s"] > TIME_LIMIT_S:
        raise ScenarioError("cluster", gpus, f"the simulator would take about {est['wall_s'] / 3600:,.1f} h "
                            f"({network_mode(scenario)} network model, {scenario.run.steps} steps), more than the "
                            f"{TIME_LIMIT_S / 3600:.0f} h limit (sim.network_model = analytic is faster; --force "
                            "to run anyway)")
    return est
