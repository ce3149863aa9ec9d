"""Expert tensor parallelism (``parallelism.etp_size`` > 1, issue 25 item 3): the token ops
around the expert-parallel exchange, the expert slices' sizes, and what it cannot run with.

Each routed expert's FFN is split over its ETP group as Megatron-Core's experts are under
expert TP: the first matrix by columns (SwiGLU's gate and up alike), the second by rows, so
every rank holds ``1 / ETP`` of each of its shard's experts (``model.ffn_hidden_size / ETP``
of the inner dimension) and computes that share of each on every token its ETP group was
sent; the partial outputs are summed over the group. Megatron-Core's
``MoEAlltoAllTokenDispatcher`` (NVIDIA/Megatron-LM d98e8a64dd,
``megatron/core/transformer/moe/token_dispatcher.py``): ``preprocess`` gathers each rank's
tokens per expert over the ``tp_ep`` group (ETP x EP) to size the exchanges; ``token_dispatch``
runs the all-to-all over the EP group (ranks of one ETP index); ``dispatch_postprocess``
all-gathers the received tokens over the ETP group (``gather_from_sequence_parallel_region``,
``output_split_sizes = output_splits_tp``: each member's own count); after the experts
``combine_preprocess`` reduce-scatters the partial outputs over the ETP group
(``reduce_scatter_to_sequence_parallel_region``, each member getting back the rows it
received) and ``token_combine`` runs the all-to-all back. The backward mirrors each.

The ops (``etp_token_ops``): the all-gather of uneven shares, which torch runs as one
broadcast per member (``all_gather`` of unequal output splits), is planned as the
``all_to_all_v`` whose row a is member a's N_a rows to every member (each of the other
ETP - 1 receives them: ``(ETP - 1) sum_a N_a`` rows on the wire, a ring all-gather's bytes
when the shares are equal); the reduce-scatter as its transpose (member a sends member b
its partial sums of b's N_b rows). Batch 2 of their stage, after the all-to-all (dispatch,
combine_backward) or before it (combine, dispatch_backward). The gathered rows travel as
the exchange's payload (``comm.payload_dtype``); the partial sums in the model's dtype
(Megatron-Core sums them in the probabilities' dtype, the model's by default). The
probabilities Megatron-Core moves beside the tokens (one value a row) are left out, as in
the testbed's all-to-all.

Expert weights, gradients and optimizer state per GPU are one slice's; the slice's
gradient is summed over its expert-DP group (``Layout.expert_dp_groups``: Megatron-Core's
``edp``, data modulo expert with CP in the nested layout). Not modelled with ETP > 1, and
refused (``check_expert_tensor_parallel``): paging and the heat map (M12-M20: the pages
and heat of a slice), two-stage sync (M9-M10: a slice's active group is its ETP group's),
and the allgather and deepep token strategies (Megatron's allgather and flex dispatchers
exchange over the ``tp_ep`` group instead).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from testbed.core.errors import ScenarioError
from testbed.model.transformer_shape import TransformerShape
from testbed.policy.collectives import CollectiveOp
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout

#: the ETP ops' batch in their stage (the all-to-all's are 0, the hierarchical one's 0 and 1)
ETP_BATCH = 2
#: stages whose ETP op all-gathers (after the all-to-all); the others reduce-scatter (before it)
GATHERING = ("dispatch", "combine_backward")
LABELS = {"dispatch": "tokens", "combine": "partial outputs", "combine_backward": "output gradients",
          "dispatch_backward": "token gradients"}
TOKEN_STRATEGIES = ("alltoall", "hierarchical")


def check_expert_tensor_parallel(scenario: Scenario) -> None:
    """A ScenarioError naming the field for what expert TP (``parallelism.etp_size`` > 1)
    cannot run with (module doc); nothing with ETP 1."""
    p, m = scenario.parallelism, scenario.model
    etp = p.etp_size
    if etp <= 1:
        return
    why = f"with parallelism.etp_size = {etp}"
    if m.ffn_hidden_size % etp:
        raise ScenarioError("model.ffn_hidden_size", m.ffn_hidden_size, f"{why} each GPU holds 1/etp_size of "
                            "every expert's inner dimension: it must be a multiple of etp_size")
    off = [f for f, on in (("pager.enabled", scenario.pager.enabled), ("heat.enabled", scenario.heat.enabled)) if on]
    if off:
        raise ScenarioError(off[0], True, f"{why} the pages and heat of a 1/etp_size slice of an expert are not "
                            f"modelled: set {' and '.join(f + ' = false' for f in off)}")
    if scenario.comm.expert_sync != "allreduce":
        raise ScenarioError("comm.expert_sync", scenario.comm.expert_sync, f"{why} a slice's gradient is summed "
                            "over its expert-DP group: use allreduce")
    if scenario.comm.token_strategy not in TOKEN_STRATEGIES:
        raise ScenarioError("comm.token_strategy", scenario.comm.token_strategy, f"{why} the expert-TP all-gather "
                            f"and reduce-scatter follow the all-to-all: use {' or '.join(TOKEN_STRATEGIES)}")


def received_rows(kept: np.ndarray, layout: Layout) -> np.ndarray:
    """[W] token rows each rank receives in the all-to-all (its own included): the kept
    slots of its EP group for its shard's experts (``kept``: ranks x experts)."""
    per_group = kept[layout.rank_of].sum(axis=1)  # [R, E]
    per_shard = per_group.reshape(layout.replicas, layout.ep_size, layout.experts_per_rank).sum(-1)  # [R, P]
    rows = np.empty(layout.world, dtype=np.int64)
    rows[layout.rank_of] = per_shard
    return rows


def etp_token_ops(stage: str, layer: int, kept: np.ndarray, layout: Layout, gather_row_bytes: int,
                  scatter_row_bytes: int) -> list[CollectiveOp]:
    """The ETP group's op of one token stage, for every ETP group (module doc): an
    all-gather of each member's received rows (``gather_row_bytes`` each) in ``GATHERING``
    stages, else the reduce-scatter of the partial sums (``scatter_row_bytes`` each)."""
    rows = received_rows(kept, layout)
    gather = stage in GATHERING
    row_bytes = gather_row_bytes if gather else scatter_row_bytes
    what = "expert-TP all-gather" if gather else "expert-TP reduce-scatter"
    ops = []
    for group in layout.etp_groups():
        members = tuple(sorted(group))
        sent = rows[list(members)] * row_bytes  # [ETP] bytes of each member's rows
        matrix = np.repeat(sent[:, None], len(members), axis=1)  # all-gather: row a to every member
        ops.append(CollectiveOp("all_to_all_v", members, stage, layer, matrix=matrix if gather else matrix.T.copy(),
                                batch=ETP_BATCH, label=f"{LABELS[stage]}, {what}", row_bytes=row_bytes))
    return ops


def with_etp_ops(stage: str, ep_ops: list[CollectiveOp], etp_ops: list[CollectiveOp]) -> list[CollectiveOp]:
    """A token stage's ops in the order they run: the all-to-all then the all-gather
    (dispatch, combine_backward), or the reduce-scatter then the all-to-all."""
    return ep_ops + etp_ops if stage in GATHERING else etp_ops + ep_ops


def expert_slice_shape(shape: TransformerShape, etp: int) -> TransformerShape:
    """``shape`` with each routed expert one GPU's slice under expert TP ``etp``: its inner
    dimension ``expert_ffn / etp`` (the first matrix's columns, the second's rows; so its
    first matrix's biases too, the second's H whole on every member, as a row-parallel
    linear's); the shared experts as they were."""
    if etp == 1:
        return shape
    return replace(shape, expert_ffn=shape.expert_ffn // etp, shared_ffn=shape.shared_ffn_width)


def expert_zero_shards(scenario: Scenario, stage_world: int) -> tuple[int, int]:
    """(optimizer state, gradient) shards of an expert slice under ZeRO
    (``transformer.zero_stage``: 1 shards the state, 2 the gradients too) over its
    expert-DP group of ``stage_world / (ETP x EP)`` GPUs (the GPUs of the stage laid out)."""
    p, stage = scenario.parallelism, scenario.transformer.zero_stage
    edp = stage_world // (p.etp_size * p.ep_size)
    return (edp if stage >= 1 else 1), (edp if stage >= 2 else 1)
