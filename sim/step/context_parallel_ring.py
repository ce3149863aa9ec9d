"""A block's dense work as phases, with context parallelism's ring (``parallelism.cp_size``
CP > 1, ``testbed.policy.context_parallel``) overlapped as Transformer Engine's
``AttnFuncWithCPAndKVP2P`` runs it: at each of the ring's steps the GPU starts the send of
the block it holds (and receives the next) on the comm stream, computes its step's share
of attention's core on the compute stream, and the next step waits for both. A step so
takes max(its core, its send) (the send as the network model times it, beside whatever
else runs then), and an attention sublayer's forward ring

    sum over steps 0 .. CP - 2 of max(core / CP, send of one KV block) + core / CP,

its backward CP steps of max(2 core / CP, send of the step's KV and dK, dV).

``chain_block`` lays out one MoE layer's block on a ``PhaseBuilder``'s in-order chain: the
block's compute less its rings' core (``DenseLayers.ring_core_s``), its tensor-parallel
collectives after it (not overlapped, as without CP), then each attention sublayer's ring.
Without CP that is the block's compute and its collectives, as the builder lays them out
(the same phases).

With ``overlap.tp_comm`` (Megatron-Core's --tp-comm-overlap, Transformer Engine's userbuffers)
the block's tensor-parallel collectives run on the comm stream beside its compute, started
with it, and the chain waits for both: the block takes the longer of its compute and its
collectives, each as the network times it. Transformer Engine splits each GEMM and its
collective into chunks (``initialize_ub``'s defaults in
transformer_engine/pytorch/module/base.py at d0067d0): the all-gathers before a GEMM by ring
exchange on the copy engines (one SM, left out), the reduce-scatters after one pipelined in 4
chunks, or in the backward in bulk beside the weight gradient, on 16 SMs
(``UB_REDUCE_SCATTER_SMS``) that the compute beside them does without (``sim.step.kernel_sms``).
Left out, so the overlap is optimistic by these: each collective hides behind its own GEMM
only, not the whole block's compute, and the last of a pipelined reduce-scatter's 4 chunks
follows its GEMM's last chunk. The ring's buffers are held while it runs (``Phase.mem_transient``):
forward TE keeps every block it received until the attention returns (step i: i + 2
blocks, the last step CP), backward two buffers of a block and its gradient (4 blocks).
"""

from __future__ import annotations

import numpy as np

from sim.step.kernel_sms import sm_slowed
from testbed.policy.collectives import CollectiveOp
from testbed.policy.context_parallel import is_ring_batch, kv_block_bytes

#: SMs a userbuffer reduce-scatter holds: Transformer Engine's default num_sm for its "pipeline" and
#: "bulk" overlaps (1 for "ring_exchange"; transformer_engine/pytorch/module/base.py at d0067d0)
UB_REDUCE_SCATTER_SMS = 16

#: KV blocks of ring buffers the backward holds: a (block, dK dV) pair to send and one to receive
BACKWARD_BUFFER_BLOCKS = 4


def chain_block(builder, stage: str, layer: int, seconds: float, mem_delta, dense_ops: list[list[CollectiveOp]],
                ring_core_s: list[float]) -> int:
    """The block of MoE layer ``layer`` in ``stage`` (dense or dense_backward) on
    ``builder``'s chain (module doc): ``seconds`` its compute (``DenseLayers.forward_s``
    or ``backward_s``, the rings' core included), ``mem_delta`` [W] or a number the bytes it
    keeps (+) or frees (-) at its compute's end, ``dense_ops`` the planner's op batches
    (``Planner.dense_tp_ops``), ``ring_core_s`` its attention sublayers' core seconds (empty
    without CP). Returns the chain's last phase."""
    w = builder.layout.world
    rings = [ops for ops in dense_ops if is_ring_batch(ops)]
    tp_batches = [ops for ops in dense_ops if ops and not is_ring_batch(ops)]
    compute_s = np.full(w, seconds - sum(ring_core_s))
    mem = np.broadcast_to(np.asarray(mem_delta, dtype=float), (w,)).copy()
    if builder.s.overlap.tp_comm and tp_batches:
        overlapped_tp_block(builder, stage, layer, compute_s, mem, tp_batches)
    else:
        builder.chain(stage, layer, "compute", "compute", seconds=compute_s, mem_delta=mem)
        for ops in tp_batches:
            builder.chain(stage, layer, "ops", "comm", ops=ops)
    if not ring_core_s:
        return builder.main
    per = len(rings) // len(ring_core_s)  # ring steps that send, per sublayer
    for k, core in enumerate(ring_core_s):
        ring_phases(builder, stage, layer, core, rings[k * per:(k + 1) * per], stage == "dense_backward")
    return builder.main


def overlapped_tp_block(builder, stage: str, layer: int, compute_s: np.ndarray, mem: np.ndarray,
                        tp_batches: list[list[CollectiveOp]]) -> int:
    """A block's compute (``compute_s`` [W] seconds, keeping ``mem`` [W] bytes) with its
    tensor-parallel collectives ``tp_batches`` beside it on the comm stream, the chain's end
    after both (module doc, ``overlap.tp_comm``). Returns the chain's last phase."""
    start, w = builder.main, builder.layout.world
    scatters = [op for ops in tp_batches for op in ops if op.kind == "reduce_scatter"]
    if scatters and builder.sm_count > UB_REDUCE_SCATTER_SMS:
        compute_s = sm_slowed(compute_s, builder.batch_seconds(scatters), UB_REDUCE_SCATTER_SMS / builder.sm_count)
    compute = builder.add(stage, layer, "compute", "compute", (start,), seconds=compute_s, mem_delta=mem)
    comm = start
    for ops in tp_batches:
        comm = builder.add(stage, layer, "ops", "comm", (comm,), ops=ops)
    builder.main = builder.add(stage, layer, "wait", "compute", (compute, comm), seconds=np.zeros(w))
    return builder.main


def ring_phases(builder, stage: str, layer: int, core_s: float, steps: list[list[CollectiveOp]],
                backward: bool) -> int:
    """One attention sublayer's ring after ``builder``'s chain end: CP steps of ``core_s``
    / CP seconds on the compute stream, step i beside ``steps[i]`` (its sends) on the comm
    stream, each step after both of the one before; the chain ends once the last step's
    compute (and send) is done. Returns the chain's last phase."""
    s, w = builder.s, builder.layout.world
    cp = s.parallelism.cp_size
    block = kv_block_bytes(s)
    step_s = np.full(w, core_s / cp)
    after = (builder.main,)
    for i in range(cp):
        held = np.full(w, float(BACKWARD_BUFFER_BLOCKS if backward else min(i + 2, cp)) * block)
        compute = builder.add(stage, layer, "compute", "compute", after, seconds=step_s, mem_transient=held)
        if i < len(steps):
            sends = builder.add(stage, layer, "ops", "comm", after, ops=steps[i], mem_transient=held)
            after = (compute, sends)
        else:
            after = (compute,)
    if len(after) > 1:  # the last step's send too (the backward's dK, dV): the chain waits for it
        builder.main = builder.add(stage, layer, "wait", "compute", after, seconds=np.zeros(w))
    else:
        builder.main = after[0]
    return builder.main
