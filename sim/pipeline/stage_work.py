"""One micro-batch's work of each chunk a pipeline rank runs, from its simulated stage
(``sim.pipeline.run``; the ranks and chunks: ``testbed.policy.pipeline_stages``).

A pipeline rank is simulated as a scenario of its own: its GPUs, all the layers of its
chunks (the dense-first ones in its first MoE layer's block, its MTP modules after its
last MoE layer), one micro-batch, and the output head after them as every simulated
step has it. Its timeline is cut into its chunks' shares, per layer of the stage:

- spans: a layer's forward is the time from the end of the previous layer's forward
  phases (the stage's start for the first) to the end of its own, on the slowest GPU
  (the latest end of any phase so far: every phase of the step is counted once); its
  backward likewise from the later layers' down. A chunk takes the spans of its MoE
  layers, in the order the rank's chunks name them, and of its MTP modules;
- the dense-first layers' seconds (``DenseLayers.first_dense_s``, the closed form they
  were simulated with in the first MoE layer's block) go from that block to the chunks
  holding them, in proportion to their count;
- the output head and the loss go to the chunk holding the loss only, once for the model
  and once per MTP module of the whole model (Megatron-Core computes the MTP modules'
  logits on the loss stage), at ``DenseLayers.head_forward_s`` / ``head_backward_s`` per
  head: a stage without the loss leaves them out;
- the rank's totals are its simulated forward (up to the first backward phase) and
  backward (to the last backward phase), less the head it does not run, plus the heads
  it runs that it did not simulate: its last chunk takes what the others leave, so a
  rank of one chunk takes exactly those totals.

For DualPipe (``sim.pipeline.dualpipe``) each chunk's backward is split into the part the
previous stage waits for and the weight gradients (``weight_s``): a linear layer's backward
is two GEMMs of its forward's FLOPs, one for the input gradient and one for the weight
gradient, so the weight part is the chunk's forward compute (its GEMMs: attention's
projections, dense FFNs, router, routed and shared experts, the head) less the attention
core's forward (``attention_core_seconds``: flash attention has no weights, its backward is
input gradient); the attention core's backward, the fp8 casts, the recomputed forward and
the token exchange's and tensor-parallel collectives' backward are the input-gradient part.
``forward_compute_s`` / ``backward_compute_s`` are the chunk's compute-stream seconds, the
rest of its span being collectives and waits: what an overlapped forward-backward pair (DualPipe's,
combined 1F1B's) can hide behind the other's compute (``overlapped_seconds``, ``pair_seconds``).

Activations (``held_bytes``): what the chunk's forward phases allocate until its backward
(``Phase.mem_delta``: dense blocks, experts' rows, shared experts), the dense-first layers at
``DenseLayers.layer_activation``, the logits with the head, on the stage's fullest GPU. The
layers' fp8 weight copies (``PhaseBuilder.layer_fp8_copy_bytes``) are left out of them:
Transformer Engine casts a weight once a step and every micro-batch reuses the copy, so a
rank holds them once, as its simulated stage does (its peak, its breakdown's ``parameters``),
however many micro-batches are in flight.

Left out: the head's and the MTP modules' differences of host work, and layer-index
features (sliding windows every few layers) renumbered by the stage's scenario.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.step.phases import Phase
from testbed.policy.pipeline_stages import RankStages
from testbed.run.results import StepRecord

#: stages a micro-batch runs through (the rest run once per step)
MICRO_BATCH_STAGES = ("dense", "route", "dispatch", "experts", "combine", "combine_backward", "experts_backward",
                      "dispatch_backward", "route_backward", "dense_backward")
BACKWARD_STAGES = ("combine_backward", "experts_backward", "dispatch_backward", "route_backward", "dense_backward")
FORWARD_STAGES = tuple(st for st in MICRO_BATCH_STAGES if st not in BACKWARD_STAGES)


@dataclass
class SimulatedStage:
    """One simulated step of a stage scenario: its record and memory breakdown (of GPU
    ``fullest``), phases, timeline, layout and phase builder (``builder.dense``: the dense
    work's closed forms; ``builder.head_phases``). ``micro_batches_counted``: a replayed
    trace's stage, whose record's bytes count every micro-batch of the step, each decided
    from its own counts (``sim.backend.decide_step``); else they are one micro-batch's."""

    record: StepRecord
    breakdown: dict
    phases: list[Phase]
    tl: object
    layout: object
    builder: object
    fullest: int
    micro_batches_counted: bool = False


@dataclass(frozen=True)
class ChunkWork:
    """One micro-batch through one chunk of a pipeline rank (seconds on its slowest GPU, bytes
    on its fullest; module doc)."""

    forward_s: float
    backward_s: float
    weight_s: float
    forward_compute_s: float
    backward_compute_s: float
    held_bytes: float


@dataclass(frozen=True)
class RankWork:
    """A pipeline rank's chunks (``chunks``, in its order) and the step's tail after its
    backward (``tail_s``: exposed gradient sync, optimizer), from its simulated stage."""

    chunks: tuple[ChunkWork, ...]
    tail_s: float
    forward_s: float  # the rank's forward over all its chunks, one micro-batch
    backward_s: float
    simulated_held_bytes: float  # what the simulated stage held at its forward's end: a micro-batch of each layer


def attention_core_seconds(dense, sliding: bool) -> float:
    """Forward seconds of one layer's attention core (scores and weighted values) on the stage's
    tokens: the closed form of ``sim.hardware.dense_layers.DenseLayers._attention_parts``."""
    shape, t = dense.shape, dense.s.transformer
    flops = dense.tokens * shape.attention_core_flops_per_token(t.seq_len, sliding)
    return dense.compute.gemm_time(flops, t.seq_len, kernel="attention")


def _block_cores(dense, layer: int, main: int) -> float:
    """Attention-core forward seconds of the stage's layer ``layer``'s block (an MTP module's: one
    whole-sequence attention)."""
    if layer >= main:
        return attention_core_seconds(dense, False)
    return sum(attention_core_seconds(dense, dense.shape.is_sliding_layer(i)) for i in dense.block_layers(layer))


class StageCuts:
    """Per layer of one simulated stage: forward and backward spans (seconds), compute-stream
    seconds and weight-gradient seconds per GPU, held bytes per GPU (module doc)."""

    def __init__(self, sim: SimulatedStage):
        b, phases, tl = sim.builder, sim.phases, sim.tl
        self.sim, self.dense = sim, b.dense
        n = b.s.model.num_layers  # the controller's layers: the stage's MoE layers, then its MTP modules'
        self.main = self.dense.s.model.num_layers
        self.mtp = n - self.main
        w = tl.end.shape[1]
        head = set(b.head_phases)
        fwd_end, bwd_end = np.full(n, -np.inf), np.full(n, -np.inf)
        self.fwd_compute, self.bwd_compute = np.zeros((n, w)), np.zeros((n, w))
        self.weight, self.held = np.zeros((n, w)), np.zeros((n, w))
        back = [i for i, ph in enumerate(phases) if ph.stage in BACKWARD_STAGES]
        self.forward_end = float(tl.end[:back[0]].max())
        self.backward_end = float(tl.end[back].max())
        for i, ph in enumerate(phases):
            if i in head or ph.layer < 0 or ph.stage not in MICRO_BATCH_STAGES:
                continue
            ends = float(tl.end[i].max())
            compute = ph.kind == "compute" and ph.seconds is not None
            if ph.stage in FORWARD_STAGES:
                fwd_end[ph.layer] = max(fwd_end[ph.layer], ends)
                if compute:
                    self.fwd_compute[ph.layer] += ph.seconds
                    if not ph.fitted:  # a host cost is no GEMM
                        self.weight[ph.layer] += ph.seconds
                if ph.mem_delta is not None:
                    self.held[ph.layer] += ph.mem_delta
            else:
                bwd_end[ph.layer] = max(bwd_end[ph.layer], ends)
                if compute:
                    self.bwd_compute[ph.layer] += ph.seconds
        for layer, copies in b.layer_fp8_copy_bytes.items():  # held once a step, not per micro-batch (module doc)
            self.held[layer] -= copies
        if self.dense.enabled:
            self.weight -= np.array([_block_cores(self.dense, layer, self.main) for layer in range(n)])[:, None]
        fwd_cut = np.maximum.accumulate(np.concatenate([[tl.t0], fwd_end]))
        self.fwd_span = np.diff(fwd_cut)
        head_end = max((float(tl.end[i].max()) for i in head), default=self.forward_end)
        bwd_cut = np.maximum.accumulate(np.concatenate([[max(head_end, self.forward_end)], bwd_end[::-1]]))
        self.bwd_span = np.diff(bwd_cut)[::-1]
        self.t0 = tl.t0

    def rank_work(self, rank: RankStages, mtp_total: int) -> RankWork:
        """``rank``'s chunks' work (module doc); ``mtp_total``: the whole model's MTP modules,
        whose heads run on the loss chunk."""
        d, sim = self.dense, self.sim
        g = sim.fullest
        heads_here = 1 + self.mtp  # the heads the simulated stage ran
        per_head = (d.head_forward_s / heads_here, d.head_backward_s / heads_here, d.head_held_bytes / heads_here)
        heads_run = 1 + mtp_total
        head = [x if heads_run == heads_here else p * heads_run
                for x, p in zip((d.head_forward_s, d.head_backward_s, d.head_held_bytes), per_head)]
        dense_first = sum(c.dense_first for c in rank.chunks)
        df_f, df_b = d.first_dense_s if dense_first else (0.0, 0.0)
        df_held = dense_first * d.layer_activation(False) if dense_first else 0.0
        df_core = sum(attention_core_seconds(d, d.shape.is_sliding_layer(i)) for i in range(dense_first))
        first_moe_chunk = next(c for c, ch in enumerate(rank.chunks) if ch.moe)
        moe_at, mtp_at = 0, self.main
        raw = []
        for c, ch in enumerate(rank.chunks):
            layers = list(range(moe_at, moe_at + ch.moe)) + list(range(mtp_at, mtp_at + ch.mtp))
            moe_at, mtp_at = moe_at + ch.moe, mtp_at + ch.mtp
            share = ch.dense_first / dense_first if dense_first else 0.0
            moved = share - (1.0 if c == first_moe_chunk and dense_first else 0.0)  # dense-first work moved here
            loss = 1.0 if ch.loss else 0.0
            f = self.fwd_span[layers].sum() + moved * df_f + loss * head[0]
            b = self.bwd_span[layers].sum() + moved * df_b + loss * head[1]
            fc = (self.fwd_compute[layers].sum(axis=0) + moved * df_f + loss * head[0]).max()
            bc = (self.bwd_compute[layers].sum(axis=0) + moved * df_b + loss * head[1]).max()
            wt = (self.weight[layers].sum(axis=0) + moved * (df_f - df_core) + loss * head[0]).max()
            held = float(self.held[layers, g].sum() + moved * df_held + loss * head[2])
            raw.append([float(f), float(b), float(wt), float(fc), float(bc), held])
        forward = self.forward_end - self.t0
        backward = (self.backward_end - self.t0) - forward
        if not (rank.loss and heads_run == heads_here):  # it runs other heads than it simulated
            forward = forward - d.head_forward_s + (head[0] if rank.loss else 0.0)
            backward = backward - d.head_backward_s + (head[1] if rank.loss else 0.0)
        # the last chunk takes what the others leave of the rank's totals (one chunk: exactly them)
        raw[-1][0] = forward - sum(r[0] for r in raw[:-1])
        raw[-1][1] = backward - sum(r[1] for r in raw[:-1])
        chunks = []
        for f, b, wt, fc, bc, held in raw:
            f, b = max(f, 0.0), max(b, 0.0)
            chunks.append(ChunkWork(f, b, min(max(wt, 0.0), b), min(max(fc, 0.0), f), min(max(bc, 0.0), b), held))
        simulated = float(self.held[:, g].sum() + d.head_held_bytes)
        tail = max(sim.record.step_time_s - (self.backward_end - self.t0), 0.0)
        return RankWork(tuple(chunks), tail, max(forward, 0.0), max(backward, 0.0), simulated)


def overlapped_seconds(fwd: ChunkWork, bwd: ChunkWork) -> float:
    """Seconds of an overlapped pair: ``fwd``'s forward with ``bwd``'s whole backward, each one's
    collectives hidden behind the other's compute - DualPipe's F&B (DeepSeek-V3 §3.2.1, Fig. 4)
    and Megatron-Core's combined 1F1B (``testbed.policy.combined_1f1b``) alike: the longer of
    the two compute streams' sum and the two collectives' sum, never more than running them
    one after the other. Left out: the SMs a DeepEP exchange (``comm.deepep_sms``) takes from
    the other half's compute, which the simulated stage charges only where it overlapped there."""
    compute = fwd.forward_compute_s + bwd.backward_compute_s
    comm = (fwd.forward_s - fwd.forward_compute_s) + (bwd.backward_s - bwd.backward_compute_s)
    return min(max(compute, comm), fwd.forward_s + bwd.backward_s)


def pair_seconds(work: list[RankWork]) -> np.ndarray:
    """[p, v, v] seconds of each rank's overlapped pairs (``overlapped_seconds``) by (forward's
    chunk, backward's chunk), its v chunks in its order: combined 1F1B's ``pair_s``; DualPipe's
    are the pairs of its two chunks, [r, d, 1 - d] (a forward of direction d)."""
    return np.array([[[overlapped_seconds(f, b) for b in w.chunks] for f in w.chunks] for w in work])
