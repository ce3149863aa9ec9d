"""Pipeline parallelism and micro-batches in the simulator (issues 13 and 25:
``parallelism.pp_size`` p, ``parallelism.pp_chunks`` v, ``transformer.micro_batches`` m, the
layers' split ``parallelism.pipeline_layout`` / ``decoder_first`` / ``decoder_last_pipeline_num_layers``,
``parallelism.pipeline_schedule``).

The cluster's nodes form p stages (``testbed.policy.pipeline_stages``: which GPUs and which
layers each pipeline rank holds, in which chunks; the embedding with the first chunk, the
output head and the loss with the last). A step runs m micro-batches of
``tokens_per_rank / m`` tokens through them:

1. Each distinct pipeline rank is simulated as a scenario of its own: its GPUs, all its
   chunks' layers, one micro-batch - the phases, network and compute of every other run.
   Ranks that hold the same layers share one simulation (``PipelineStages``: the run's own
   is rank 0's, the others come from ``runner``, one per layer mix). Its timeline is cut
   into its chunks' forward and backward seconds (``sim.pipeline.stage_work``: the head only
   where the loss is, the dense-first and MTP layers only where the layout puts them) and
   the tail after the backward (what the gradient sync leaves exposed, the optimizer).
2. A micro-batch's activations (and, backward, their gradients: tokens x hidden in
   ``model.dtype`` per GPU) cross each stage boundary as point-to-point sends from every
   GPU to its peer in the next stage, all at once, timed on the whole cluster's network
   model (``boundary_send_seconds``).
3. The step's schedule times those seconds by max-plus: 1F1B, or Megatron's interleaved
   1F1B with v > 1 chunks (``sim.pipeline.schedule``), or DualPipe (``sim.pipeline.dualpipe``:
   each rank's two chunks, the backward split into input and weight gradients and the
   overlapped forward-backward pairs from ``stage_work``). The bubble comes out of it, not
   from a closed form. The step ends when the last rank's tail does: each rank's end in the
   schedule plus its own tail.

What it changes in a step's record: the step time; stage times of the micro-batch stages
(route to dense_backward) times m, the most of any simulated stage (the gradient sync,
optimizer and heat run once per step); bytes of every rank's simulated stage, micro-batch
stages times m (a replayed trace's stages counted each of their micro-batches, each pipeline
rank simulated with its own routing), the dense sync of the embedding and head only where a
rank holds them (``sim.pipeline.stage_bytes``); the share of the step from fitted constants
(``whole_step_fitted_share``, the most of any stage); the memory of the fullest rank
(``sim.pipeline.stage_memory``: the embedding and head it holds, the activations its
schedule keeps in flight) and its breakdown. ``extra["pipeline"]`` has the schedule per
stage (docs/simulator.md, Pipelines).
Left out: stages' traffic sharing links with each other, the sends' own bytes in the byte
counts (they are in ``extra["pipeline"]``), the time of the gradient sync of an embedding
or head a rank does not hold (its simulated stage's; not its bytes), a replayed trace's
micro-batches after the first in the timing (micro-batch 0's routing times every one). The
network counters (wire bytes, link utilisation, hottest links) saw one stage's micro-batch,
so a pipelined run reports none.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sim.hardware.fabric import build_fabric
from sim.network.analytic_timer import AnalyticTimer
from sim.network.collective_model import CollectiveModel
from sim.network.network import Network
from sim.pipeline.dualpipe import PARAMETER_COPIES, run_dualpipe
from sim.pipeline.schedule import run_pipeline
from sim.pipeline.stage_bytes import rank_bytes
from sim.pipeline.stage_memory import embedding_head_delta, in_flight_bytes
from sim.pipeline.stage_work import MICRO_BATCH_STAGES, RankWork, SimulatedStage, StageCuts, pair_seconds
from sim.step.phases import Phase
from sim.step.schedule import run_analytic
from sim.step.step_report import fitted_by_rank
from testbed.model.mtp_layers import mtp_modules
from testbed.policy.collectives import CollectiveOp, reduce_scatter_runs_as_all_reduce
from testbed.policy.combined_1f1b import check_combined_1f1b, combined_1f1b
from testbed.policy.pipeline_stages import PipelineStages, dualpipe
from testbed.scenario.scenario import Scenario


def boundary_send_seconds(s: Scenario, profile) -> tuple[np.ndarray, float]:
    """([p] seconds, bytes per GPU) of one micro-batch's activations crossing each stage
    boundary k -> k+1 (the last: to stage 0, the interleaved schedule's next chunk):
    every GPU of stage k sends to the GPU at the same place in stage k+1, all at once,
    on the whole cluster's analytic network model."""
    p, world = s.parallelism.pp_size, s.world_size
    per_stage = world // p
    nbytes = s.workload.tokens_per_rank // s.transformer.micro_batches * s.model.hidden_size * s.model.dtype_bytes
    if p == 1:
        return np.zeros(1), float(nbytes)
    network = Network(None, build_fabric(s, profile), "analytic")
    timer = AnalyticTimer(CollectiveModel(network, profile, world))
    seconds = np.zeros(p)
    for k in range(p):
        ops = [CollectiveOp("p2p", (k * per_stage + r, (k + 1) % p * per_stage + r), "dense", -1, size=nbytes,
                            label=f"pipeline send {k}") for r in range(per_stage)]
        tl = run_analytic([Phase("dense", -1, "ops", "comm", (), ops=ops)], world, timer, 0.0, 0.0)
        seconds[k] = float(tl.end.max())
    return seconds, float(nbytes)


def whole_step_fitted_share(phases: list[Phase], tl, micro_batches: int, step_time_s: float) -> float:
    """Share of the pipelined step of ``step_time_s`` seconds that comes from fitted
    constants, on the GPU with the most: its fitted seconds in the micro-batch stages
    times ``micro_batches`` (each GPU runs every micro-batch of each of its chunks), plus
    those of the phases run once per step (``sim.step.step_report.fitted_by_rank`` of the
    simulated stage's micro-batch step). The boundary sends' library latency is left out:
    the sends are asynchronous, in no GPU's busy time."""
    if step_time_s <= 0 or not phases:
        return 0.0
    busy = tl.end - tl.start
    per_mb = np.array([ph.stage in MICRO_BATCH_STAGES for ph in phases])
    fitted = micro_batches * fitted_by_rank(tl, busy, per_mb) + fitted_by_rank(tl, busy, ~per_mb)
    return float(fitted.max() / step_time_s)


class PipelinedStep:
    """Turns the simulated stages' steps into the pipelined step of the whole scenario."""

    def __init__(self, scenario: Scenario, profile, stages: PipelineStages,
                 runner: Callable[[Scenario], Callable[[int], SimulatedStage]]):
        """``stages``: the scenario's (``PipelineStages.of``); the run simulates
        ``stages.scenarios[0]`` itself, ``runner(stage_scenario)`` gives the step function of
        each other one (``step -> SimulatedStage``, as the run's loop makes its own)."""
        check_combined_1f1b(scenario)  # before the first step: a refused run leaves no folder
        self.s, self.stages = scenario, stages
        self.send_s, self.send_bytes = boundary_send_seconds(scenario, profile)
        self.rs_as_ar = reduce_scatter_runs_as_all_reduce(profile)  # gloo: testbed.policy.collectives
        self.others = [runner(st) for st in stages.scenarios[1:]]
        self.dualpipe = dualpipe(scenario)
        self.combined = combined_1f1b(scenario)  # Megatron's combined 1F1B: steady-state pairs overlapped

    # ---- the schedule -----------------------------------------------------------------------
    def schedule(self, work: list[RankWork]):
        """The step's schedule from every rank's chunks (``RankWork``), and its pairs' seconds
        (``stage_work.pair_seconds``): DualPipe's [p, 2] by the forward's direction, combined
        1F1B's [p, v, v] by (forward's chunk, backward's chunk); None for plain 1F1B."""
        m = self.s.transformer.micro_batches
        fwd = np.array([[c.forward_s for c in w.chunks] for w in work])
        bwd = np.array([[c.backward_s for c in w.chunks] for w in work])
        if not self.dualpipe:
            pair = pair_seconds(work) if self.combined else None
            return run_pipeline(fwd, bwd, self.send_s, m, self.s.parallelism.pp_chunks, pair), pair
        weight = np.array([[c.weight_s for c in w.chunks] for w in work])
        pair = pair_seconds(work)[:, [0, 1], [1, 0]]  # direction d's forward with the other's backward
        return run_dualpipe(fwd, bwd, weight, pair, self.send_s[:-1], m), pair  # no wrap-around boundary

    # ---- the step ---------------------------------------------------------------------------
    def apply(self, step: int, own: SimulatedStage) -> tuple:
        """The pipelined step's record and memory breakdown (its fullest GPU) from the run's own
        simulated stage ``own`` (rank 0's) and this step of every other. What runs once per
        step, not per micro-batch, is every phase outside ``MICRO_BATCH_STAGES`` (gradient sync,
        optimizer, heat, paging), for the stage times and both byte counts alike."""
        s, st = self.s, self.stages
        p, v, m = s.parallelism.pp_size, s.parallelism.pp_chunks, s.transformer.micro_batches
        sims = [own] + [run(step) for run in self.others]
        cuts = [StageCuts(x) for x in sims]
        work = [cuts[k].rank_work(rank, mtp_modules(s)) for rank, k in zip(st.ranks, st.simulated)]
        sched, pair = self.schedule(work)
        ends = np.array([float(np.nanmax(sched.end[r])) for r in range(p)])
        tails = np.array([w.tail_s for w in work])
        record = own.record
        record.step_time_s = float(np.max(ends + tails))
        record.fitted_share = max(whole_step_fitted_share(x.phases, x.tl, m, record.step_time_s) for x in sims)
        record.stage_time_s = {k: max(x.record.stage_time_s.get(k, 0.0) for x in sims)
                               * (m if k in MICRO_BATCH_STAGES else 1) for k in record.stage_time_s}
        by_stage, by_level = {}, {}  # every pipeline rank's (sim.pipeline.stage_bytes)
        for rank, k in zip(st.ranks, st.simulated):
            stages, levels = rank_bytes(sims[k], rank, m, self.rs_as_ar)
            for total, part in ((by_stage, stages), (by_level, levels)):
                for key, value in part.items():
                    total[key] = total.get(key, 0) + int(value)
        record.bytes_by_stage, record.bytes_by_level = by_stage, by_level
        record.wire_bytes_by_level = None  # the stages' network counters saw one micro-batch
        peaks, breakdowns, held = [], [], []
        for r, (rank, k, w) in enumerate(zip(st.ranks, st.simulated, work)):
            x = sims[k]
            held.append(in_flight_bytes(sched.orders[r], [c.held_bytes for c in w.chunks]))
            extra = held[-1] - w.simulated_held_bytes
            delta = embedding_head_delta(x.builder, rank.embedding, rank.loss)
            peaks.append(x.record.peak_memory_bytes + extra + delta["parameters"] + delta["optimizer_state"])
            out = dict(x.breakdown)
            out["activations"] = out["activations"] + extra
            for key, value in delta.items():
                out[key] = out[key] + value
            breakdowns.append(out)
        fullest = int(np.argmax(peaks))
        record.peak_memory_bytes = int(peaks[fullest])
        busy = np.asarray(sched.busy_s)
        bubble = sched.makespan_s - busy
        record.extra["pipeline"] = {
            "stages": p, "chunks": v, "micro_batches": m, "schedule": self._schedule_name(),
            "layout": st.layout.source, "makespan_s": float(sched.makespan_s), "tail_s": float(tails.max()),
            "micro_batch_forward_s": float(max(w.forward_s for w in work)),
            "micro_batch_backward_s": float(max(w.backward_s for w in work)),
            "bubble_fraction": float(np.max(sched.bubble_fraction)), "send_s": [float(x) for x in self.send_s],
            "send_bytes_per_gpu": self.send_bytes * 2 * m * (p * (1 if self.dualpipe else v) - 1) / p,
            "in_flight": [int(x) for x in sched.in_flight],
            "in_flight_bytes": [float(x) for x in held],
            "stage_bubble_s": [float(x) for x in bubble],
            "stage_bubble_fraction": [float(x) for x in sched.bubble_fraction],
            "stage_busy_s": [float(x) for x in busy],
            "stage_end_s": [float(x) for x in ends], "stage_tail_s": [float(x) for x in tails],
            "stage_layers": [r.layers for r in st.ranks],
            "stage_chunk_layers": [[c.layers for c in r.chunks] for r in st.ranks],
            "stage_moe_layers": [r.mix[1] for r in st.ranks], "stage_mtp_layers": [r.mix[2] for r in st.ranks],
            "embedding_stages": [r.rank for r in st.ranks if r.embedding],
            "loss_stages": [r.rank for r in st.ranks if r.loss],
            "stage_forward_s": [[c.forward_s for c in w.chunks] for w in work],
            "stage_backward_s": [[c.backward_s for c in w.chunks] for w in work],
            "stage_weight_s": [[c.weight_s for c in w.chunks] for w in work],
            "stage_held_bytes": [[c.held_bytes for c in w.chunks] for w in work],
            "stage_peak_memory_bytes": [float(x) for x in peaks],
            "stage_memory_breakdown_bytes": [{k: float(v) for k, v in b.items()} for b in breakdowns],
            "stage_simulated_as": list(st.simulated), "simulated_stages": len(sims),
            "parameter_copies": PARAMETER_COPIES if self.dualpipe else 1,
            "fullest_stage": fullest,
        }
        pipe = record.extra["pipeline"]
        pipe["moe_expert_parallel_comm"] = self.combined
        pipe["stage_overlapped_pairs"] = self._pairs(sched)
        pipe["overlapped_pairs"] = sum(pipe["stage_overlapped_pairs"])
        if pair is not None:
            key = "stage_pair_s" if self.combined else "stage_overlapped_s"
            pipe[key] = pair.tolist()
            pipe["stage_forward_compute_s"] = [[c.forward_compute_s for c in w.chunks] for w in work]
            pipe["stage_backward_compute_s"] = [[c.backward_compute_s for c in w.chunks] for w in work]
        return record, breakdowns[fullest]

    def _pairs(self, sched) -> list[int]:
        """Overlapped pairs each rank ran: DualPipe's F&B ops, combined 1F1B's steady-state ones."""
        if self.dualpipe:
            return [sum(op.kind == "F&B" for op in order) for order in sched.orders]
        return [int(x) for x in sched.pairs]

    def _schedule_name(self) -> str:
        if self.dualpipe:
            return "dualpipe"
        return "interleaved" if self.s.parallelism.pp_chunks > 1 else "1f1b"
