"""Megatron-Core's distributed optimizer (ZeRO-1; issue 25, item 5): the gradient sum as a
reduce-scatter and the updated parameters' all-gather, bucket by bucket, and the dtype the
gradients are summed in.

Followed: NVIDIA/Megatron-LM d98e8a64 (``megatron/core/distributed/param_and_grad_buffer.py``,
``distributed_data_parallel.py``, ``megatron/core/optimizer/distrib_optimizer.py``,
``megatron/training/arguments.py``):

- With ``--use-distributed-optimizer`` (here: ``transformer.zero_stage`` >= 1 with the whole
  transformer's Adam, ``distributed_optimizer``) every gradient bucket is reduce-scattered
  over its data-parallel group (``start_grad_sync``: ``reduce_scatter_tensor``), each rank
  updates its 1/DP shard of the fp32 master weights, and the updated parameters of each
  bucket are all-gathered (``start_param_sync``: ``all_gather_into_tensor``). Expert
  parameters have buffers of their own over the expert-DP group (``expert_parallel_buffers``
  over ``intra_expt_dp_group``): here each expert shard's gradients over its replicas (its
  expert-DP group with expert TP), one layer at a time, as the expert sync's all-reduce ran
  them. ZeRO-2 (``zero_stage`` 2) moves the same bytes; it keeps only the gradient shard.
- A bucket is padded so that every member's shard is equal (``pad_bucket_end``: to a multiple
  of lcm(DP, 128) elements; here to a multiple of DP bytes). In the byte ledger's conventions
  (``testbed.policy.collectives``) its reduce-scatter has ``size`` = the padded bucket's
  gradient bytes, (p - 1) size on the wire, (p - 1) / p of the bucket from each member; its
  all-gather ``size`` = a member's shard of the updated parameters, p (p - 1) size on the wire:
  together the all-reduce's 2 (p - 1) size when the gradients are summed in the parameters'
  dtype.
- ``transformer.grad_reduce_dtype`` (``grad_reduce_in_fp32``; Megatron-LM's
  ``--accumulate-allreduce-grads-in-fp32``, its default with ``--bf16`` unless
  ``--grad-reduce-in-bf16``): the gradient buffers' dtype, so the reduce-scatter's (or, without
  the distributed optimizer, the all-reduce's) element size; the all-gather moves parameters
  in their own dtype (``start_param_sync``: "Use param dtype (e.g., bf16), NOT grad dtype").
  The routers' weights are kept in fp32 here, their gradients summed in fp32 either way.
- ``transformer.overlap_grad_reduce``: a bucket's reduce-scatter is issued once the backward of
  its layers is done (``_make_backward_post_hook``); ``overlap_param_gather``: the first
  bucket's all-gather is issued at the step's start (``zero_grad``), each next one when the
  forward reaches the bucket before it (``finish_param_sync`` dispatches
  ``next_param_gather_bucket_group``), each module's forward waiting for its own
  (``_make_forward_pre_hook``); without it every all-gather runs after the optimizer step
  (``step_with_ready_grads``). Megatron-LM asks for ``--overlap-grad-reduce`` with
  ``--overlap-param-gather`` and the distributed optimizer for the latter (arguments.py):
  ``check_distributed_optimizer`` refuses the rest.

Left out: Megatron-Core's bucket size (``--ddp-bucket-size``, default max(40M, 1M x DP)
parameters, one bucket per buffer without ``--overlap-grad-reduce``): the buckets are the
testbed's (``comm.grad_bucket_bytes``); the gradient buffer's memory in fp32
(``grad_reduce_dtype`` moves the wire bytes only).
"""

from __future__ import annotations

from testbed.core.errors import ScenarioError
from testbed.policy.collectives import CollectiveOp
from testbed.scenario.scenario import Scenario

#: the label that opens every all-gather of updated parameters (``is_param_gather``)
PARAM_GATHER_LABEL = "updated parameters"
FP32_BYTES = 4


def distributed_optimizer(scenario: Scenario) -> bool:
    """Whether the gradients are summed as Megatron-Core's distributed optimizer sums them
    (module doc): ZeRO 1 or 2 of the whole transformer's Adam."""
    t = scenario.transformer
    return t.enabled and t.optimizer == "adam" and t.zero_stage >= 1


def check_distributed_optimizer(scenario: Scenario) -> None:
    """ScenarioError for ``transformer.overlap_param_gather`` without the distributed
    optimizer or without ``overlap_grad_reduce`` (Megatron-LM's arguments.py asks for both)."""
    t = scenario.transformer
    if not t.overlap_param_gather:
        return
    if not distributed_optimizer(scenario):
        raise ScenarioError("transformer.overlap_param_gather", True, "gathers the distributed optimizer's "
                            "updated parameters: it needs transformer.zero_stage >= 1 with the whole transformer's "
                            f"adam (zero_stage = {t.zero_stage}, enabled = {t.enabled}, optimizer = {t.optimizer!r})")
    if not t.overlap_grad_reduce:
        raise ScenarioError("transformer.overlap_param_gather", True, "Megatron-LM runs it only with "
                            "--overlap-grad-reduce: set transformer.overlap_grad_reduce too")


def reduced_bytes(scenario: Scenario, model_bytes: int) -> int:
    """Bytes of ``model_bytes`` of gradients in ``model.dtype`` as they are summed
    (``transformer.grad_reduce_dtype``: fp32 makes each element 4 bytes)."""
    if scenario.transformer.grad_reduce_dtype == "model":
        return model_bytes
    return model_bytes * (FP32_BYTES // scenario.model.dtype_bytes)


def gradient_sum_ops(scenario: Scenario, stage: str, members: tuple[int, ...], layer: int, fp32_bytes: int,
                     model_bytes: int, label: str, stream: int = 0) -> list[CollectiveOp]:
    """The collectives that sum one bucket's gradients over ``members``: ``fp32_bytes`` of
    gradients kept in fp32 (the routers') and ``model_bytes`` in ``model.dtype``. An
    all-reduce in the gradients' dtype (``reduced_bytes``), or with the distributed
    optimizer (module doc) its reduce-scatter (batch 0) and the all-gather of the updated
    parameters (batch 1, labelled ``PARAM_GATHER_LABEL``), each bucket padded to equal shards."""
    grads = fp32_bytes + reduced_bytes(scenario, model_bytes)
    if not distributed_optimizer(scenario):
        return [CollectiveOp("all_reduce", members, stage, layer, size=grads, stream=stream, label=label)]
    p = len(members)
    shard = -(-(fp32_bytes + model_bytes) // p)  # a member's shard of the updated parameters
    return [CollectiveOp("reduce_scatter", members, stage, layer, size=-(-grads // p) * p, stream=stream, label=label),
            CollectiveOp("all_gather", members, stage, layer, size=shard, batch=1, stream=stream,
                         label=f"{PARAM_GATHER_LABEL}, {label}")]


def is_param_gather(op: CollectiveOp) -> bool:
    """Whether ``op`` is an all-gather of the distributed optimizer's updated parameters:
    after the optimizer step, or with ``overlap_param_gather`` before the next forward."""
    return op.kind == "all_gather" and op.label.startswith(PARAM_GATHER_LABEL)


def split_param_gathers(ops: list[CollectiveOp]) -> tuple[list[CollectiveOp], list[CollectiveOp]]:
    """(the gradient sums and the rest, the all-gathers of updated parameters) of ``ops``,
    each in order: the sums run in the backward's sync, the gathers after the optimizer
    step or before the next forward (module doc)."""
    gathers = [op for op in ops if is_param_gather(op)]
    if not gathers:
        return ops, []
    return [op for op in ops if not is_param_gather(op)], gathers
