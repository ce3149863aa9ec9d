"""A pipeline rank's memory from its simulated stage (``sim.pipeline.run``): the embedding and
head it holds, and the micro-batches' activations its schedule keeps in flight.

- Embedding and head: a simulated stage holds the input embedding and the output head
  (one V x H matrix when tied) as every simulated step does; a pipeline rank holds the
  embedding only with its first model chunk and the head only with the chunk holding the
  loss (tied: the one matrix on both, as Megatron-Core keeps a copy of the shared embedding
  on the last stage). ``embedding_head_delta`` is what a rank holds more (less: negative)
  than its simulated stage: the weights (1/tp each, the model's dtype), their gradients
  (ZeRO-2's shard) and Adam's state (ZeRO-1's shard), as ``sim.backend.ClusterSim`` counts
  them.
- In flight: walking a rank's op order, each chunk's forward of a micro-batch takes that
  chunk's ``held_bytes`` until its backward starts (``in_flight_bytes``; DualPipe: an
  input-gradient backward frees them, its weight gradient later keeps none, an overlapped
  pair frees its backward's before its forward's are taken, as ``sim.pipeline.dualpipe``
  counts micro-batches; combined 1F1B's pairs likewise, their two halves walking the layers
  in opposite order, so a pair's own peak, up to a layer more, is left out). The simulated
  stage held one micro-batch of each of its layers at its forward's end, where its memory
  peaks: a rank's peak is its stage's less that, plus the most its schedule holds at once,
  plus the embedding's and head's weights and Adam state it holds more (held all step;
  their gradients come in the backward, after the peak, and change the breakdown's
  ``gradients`` only). The layers' fp8 weight copies are no chunk's ``held_bytes``
  (``sim.pipeline.stage_work``): the simulated stage's peak and ``parameters`` hold them
  once, as the rank does whatever its schedule keeps in flight.

Left out: the gradient sync of an embedding or head a rank does not hold (its simulated
stage still all-reduces them: ``sim.pipeline.run``'s tail and bytes), and the cross-stage
all-reduce of a tied embedding's or of DualPipe's two copies' gradients.
"""

from __future__ import annotations

from sim.pipeline.dualpipe import DualPipeOp
from sim.pipeline.schedule import OverlappedPair
from testbed.model.whole_model import dense_weight_split


def embedding_head_params(shape, embedding: bool, loss: bool) -> int:
    """Parameters of the input embedding and output head a stage holding the ``embedding`` and
    the ``loss`` (or not) keeps (``shape``: ``testbed.model.transformer_shape.TransformerShape``)."""
    if shape.tied_embeddings:
        return shape.head_params if (embedding or loss) else 0
    return (shape.input_embedding_params if embedding else 0) + (shape.head_params if loss else 0)


def embedding_head_delta(builder, embedding: bool, loss: bool) -> dict[str, float]:
    """Bytes by memory category (``sim.step.memory_breakdown``'s) that a rank holding the
    ``embedding`` and ``loss`` (or not) keeps more than its simulated stage (module doc);
    ``builder``: the stage's ``PhaseBuilder``."""
    dense, s = builder.dense, builder.s
    t = s.transformer
    delta = embedding_head_params(dense.shape, embedding, loss) - embedding_head_params(dense.shape, True, True)
    per_gpu = delta / dense_weight_split(s)
    dense_state, _, dense_grad, _ = builder.zero
    state = t.optimizer_state_bytes / dense_state if t.optimizer == "adam" else 0.0
    return {"parameters": per_gpu * s.model.dtype_bytes, "gradients": per_gpu * s.model.dtype_bytes / dense_grad,
            "optimizer_state": per_gpu * state}


def in_flight_bytes(order, held: list[float]) -> float:
    """The most activation bytes a rank keeps at once over its op ``order`` (module doc):
    ``sim.pipeline.schedule`` orders of ("F" | "B", chunk, micro-batch) and ``OverlappedPair``, or
    ``sim.pipeline.dualpipe`` ones (``DualPipeOp``, a direction's chunk); ``held[c]``: chunk
    c's bytes for one micro-batch."""
    now = most = 0.0
    for op in order:
        if isinstance(op, DualPipeOp):
            if op.kind == "F&B":
                now -= held[op.backward_direction]
                now += held[op.direction]
            elif op.kind == "F":
                now += held[op.direction]
            elif op.kind in ("B", "I"):
                now -= held[op.direction]
        elif isinstance(op, OverlappedPair):
            now -= held[op.backward_chunk]
            now += held[op.forward_chunk]
        else:
            kind, chunk, _ = op
            now += held[chunk] if kind == "F" else -held[chunk]
        most = max(most, now)
    return most
