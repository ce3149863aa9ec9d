"""DeepEP's normal dispatch and combine as collective ops (``comm.token_strategy = "deepep"``, M7).

DeepSeek-V3 (arXiv 2412.19437, section 3.2.2) and DeepEP's normal kernels
(github.com/deepseek-ai/DeepEP): a token crosses the network once per destination node,
to the GPU with its own local index there (its rail peer), which forwards it over NVLink
to each GPU of that node holding one of its experts; that GPU applies each of its experts
the token chose. The combine runs in reverse: each expert GPU sends one sum per token
(its experts' outputs weighted by their router probabilities) to the forwarding GPU,
which adds those of its node and sends one partial sum per (token, node) back across the
network, where the source adds its nodes' sums.

The EP group is a grid of A nodes x B members per node (rows by node, ranks ascending,
as the hierarchical all-to-all's; every node must hold as many members): member (a, b)
sends its tokens for node a' to (a', b), the *inter-node hop* along column b, and (a', b)
forwards them to (a', b'), the *intra-node forward* inside row a'. With the group inside
one node (A = 1) only the forward remains (DeepEP's intranode kernels), with one member
per node (B = 1) only the hop.

What a token strategy that moves tokens, not slots, needs beyond the routed counts is
the *fanout* of each member i of an EP group (EP-index order):

- ``to_member[i, j]``: tokens of i with at least one kept slot on member j;
- ``to_node[i, a]``: tokens of i with at least one kept slot on grid row (node) a;

one row ``[to_member | to_node]`` of P + A counts per rank (``fanout_of_tokens``). The
members share them first (DeepEP's notify: ``num_tokens_per_rank`` and
``num_tokens_per_rdma_rank``): ``fanout_op``, an int32 all-gather, batch 0 of the
dispatch (micro-batches, M22, split its few bytes as any op's; DeepEP would notify each
micro-batch whole). On the simulator's synthetic routing, which has counts and no
tokens, the fanout is modelled (``modelled_fanout``); a replayed real run brings its own.

Rows per stage (``hop_matrices``): on the hop along column b, member (a, b) sends
(a', b) ``to_node[(a, b), a']`` rows; on the forward inside row a', forwarder (a', b)
sends (a', b') ``sum_a to_member[(a, b), (a', b')]`` rows (its own column's tokens
for b', from every node, its own included). The combine and the backward carry the same
rows the other way. Bytes per row (``row_bytes``):

- dispatch: the token (``comm.payload_dtype``: fp8, 1 byte an element, or the model
  dtype), its K expert indices (int32) and K probabilities (fp32), masked to the
  receiver's experts, as three messages (DeepEP sends ``topk_idx`` and
  ``topk_weights`` with the token);
- combine: a partial sum at the model dtype (DeepEP combines in bf16);
- combine_backward: the output gradient, as the dispatch's token (fp8 with fp8 payloads:
  V3 dispatches the activation gradient before the down-projection in fp8 and keeps both
  combines in bf16, section 3.3, "Low-Precision Communication");
- dispatch_backward: the token gradient at the model dtype and K probability gradients.

So ``comm.payload_dtype = "fp8"`` gives DeepEP's fp8 dispatch and bf16 (model dtype)
combine, ``"model"`` everything at the model dtype. fp8 rows carry no scales (as the
testbed's fp8 codec, ``real.comm.collectives.PayloadCodec``); DeepEP's per-128-element
fp32 scales would add 4/128 of a row.

The hop and the forward are one batch: DeepEP forwards chunks over NVLink as they
arrive over the network, so the two overlap ("communications via IB and NVLink are
fully overlapped", V3 section 3.2.2); the real CPU ranks run them one after the other
(the data needs it), which changes their time, not their bytes.
"""

from __future__ import annotations

import numpy as np

from testbed.policy.collectives import CollectiveOp
from testbed.scenario.topology import Layout

FANOUT_BYTES = 4  # the fanout counts travel as int32
INDEX_BYTES = 4  # an expert index, int32
PROB_BYTES = 4  # a probability or its gradient, fp32


# ---- the grid ---------------------------------------------------------------------------------
def grid_of(layout: Layout, group: int) -> np.ndarray:
    """EP group ``group`` as (nodes A, members per node B) ranks, rows by node, ranks
    ascending (``Layout.node_grid``); ScenarioError naming deepep when nodes hold
    different numbers of its members."""
    return layout.node_grid(group, "deepep")


def grids_of(layout: Layout) -> list[np.ndarray]:
    """``grid_of`` every EP group."""
    return [grid_of(layout, g) for g in range(layout.replicas)]


def grid_positions(layout: Layout, grid: np.ndarray) -> np.ndarray:
    """[A, B] EP index of each grid cell."""
    return layout.index_of[grid]


def node_of_member(layout: Layout, grid: np.ndarray) -> np.ndarray:
    """[P] grid row (node) of each EP index."""
    pos = grid_positions(layout, grid)
    out = np.empty(pos.size, dtype=np.int64)
    out[pos.reshape(-1)] = np.repeat(np.arange(pos.shape[0]), pos.shape[1])
    return out


# ---- the fanout -----------------------------------------------------------------------------------
def fanout_of_tokens(experts_TK: np.ndarray, keep_TK: np.ndarray, experts_per_rank: int,
                     node_of: np.ndarray) -> np.ndarray:
    """One rank's fanout ``[to_member (P) | to_node (A)]`` from its tokens' expert choices
    ``experts_TK`` [T, K] (global expert ids) and which slots were kept ``keep_TK``
    [T, K]; ``node_of`` [P]: the grid row of each EP index."""
    p, a = len(node_of), int(node_of.max()) + 1
    experts_TK = np.asarray(experts_TK, dtype=np.int64)
    keep_TK = np.asarray(keep_TK, dtype=bool)
    member = experts_TK // experts_per_rank
    to_member = np.zeros((len(experts_TK), p), dtype=bool)
    to_node = np.zeros((len(experts_TK), a), dtype=bool)
    t, k = np.nonzero(keep_TK)
    to_member[t, member[t, k]] = True
    to_node[t, node_of[member[t, k]]] = True
    return np.concatenate([to_member.sum(axis=0), to_node.sum(axis=0)]).astype(np.int64)


def modelled_fanout(kept: np.ndarray, tokens: int, layout: Layout, grids: list[np.ndarray]) -> np.ndarray:
    """[W, P + A] the fanout of kept counts ``kept`` [W, E] without the tokens: each
    expert's kept slots of a rank fall on distinct tokens, drawn independently of the
    other experts' (a token then misses a set S of experts with probability
    prod_{e in S} (1 - c_e / T)), rounded to whole tokens, at least the largest count
    in S and at most min(T, their sum)."""
    lay = layout
    w, p, n = lay.world, lay.ep_size, lay.experts_per_rank
    a = grids[0].shape[0]
    kept = np.asarray(kept, dtype=np.float64)
    with np.errstate(divide="ignore"):  # -inf where every token went to e: none misses it
        miss = np.log1p(-np.clip(kept / tokens, 0.0, 1.0))  # [W, E]
    # experts of each rank's EP group in EP-index order: member j holds experts j*n ... (j+1)*n - 1
    by_member = kept.reshape(w, p, n)
    miss_member = miss.reshape(w, p, n).sum(axis=2)  # [W, P]
    out = np.zeros((w, p + a), dtype=np.int64)
    out[:, :p] = _tokens_hit(miss_member, by_member.max(axis=2), by_member.sum(axis=2), tokens)
    for g, grid in enumerate(grids):
        ranks = lay.rank_of[g]
        node_of = node_of_member(lay, grid)
        km, mm = by_member[ranks], miss_member[ranks]  # [P src, P dst, n], [P src, P dst]
        rows = [node_of == row for row in range(a)]
        node_miss = np.stack([mm[:, r].sum(axis=1) for r in rows], axis=1)  # [P, A]
        node_max = np.stack([km[:, r].max(axis=(1, 2)) for r in rows], axis=1)
        node_sum = np.stack([km[:, r].sum(axis=(1, 2)) for r in rows], axis=1)
        out[ranks, p:] = _tokens_hit(node_miss, node_max, node_sum, tokens)
    return out


def _tokens_hit(log_miss: np.ndarray, largest: np.ndarray, total: np.ndarray, tokens: int) -> np.ndarray:
    expected = np.rint(tokens * -np.expm1(log_miss))
    return np.clip(expected, largest, np.minimum(total, tokens)).astype(np.int64)


def fanout_op(layout: Layout, group: int, layer: int, a_nodes: int) -> CollectiveOp:
    """The all-gather of every member's fanout (P + A int32) within EP group ``group``:
    DeepEP's notify, the split sizes of both hops; batch 0 of the dispatch."""
    return CollectiveOp("all_gather", tuple(sorted(layout.ep_group(group))), "dispatch", layer,
                        size=(layout.ep_size + a_nodes) * FANOUT_BYTES, label="token fanout (deepep)")


# ---- rows and bytes per stage ---------------------------------------------------------------------------
def hop_matrices(fanout: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the two hops of one EP group's dispatch from its members' fanout
    ``fanout`` [P, P + A] (EP-index order) and its grid ``pos`` [A, B] of EP indices:
    (inter [B, A, A]: inter[b, a, a'] rows (a, b) sends (a', b); intra [A, B, B]:
    intra[a', b, b'] rows forwarder (a', b) sends (a', b')). Diagonals stay on the rank."""
    a_nodes, b = pos.shape
    p = a_nodes * b
    cells = pos.reshape(-1)
    to_member = fanout[np.ix_(cells, cells)].reshape(a_nodes, b, a_nodes, b)  # [a, b, a', b']
    to_node = fanout[cells, p:].reshape(a_nodes, b, a_nodes)  # [a, b, a']
    inter = to_node.transpose(1, 0, 2)  # [b, a, a']
    intra = to_member.sum(axis=0).transpose(1, 0, 2)  # [a', b, b']
    return inter.astype(np.int64), intra.astype(np.int64)


#: per stage: the messages of each row, (label, bytes per row), given (token bytes, model-dtype bytes, K)
def row_bytes(stage: str, token_bytes: int, model_bytes: int, top_k: int) -> list[tuple[str, int]]:
    """The messages each row of ``stage`` travels as: (label, bytes per row) (module doc).
    ``token_bytes``: a dispatched token (fp8 or model dtype), ``model_bytes``: a row at
    the model dtype."""
    if stage == "dispatch":
        return [("tokens", token_bytes), ("expert indices", top_k * INDEX_BYTES), ("probabilities", top_k * PROB_BYTES)]
    if stage == "combine":
        return [("partial sums", model_bytes)]
    if stage == "combine_backward":
        return [("output gradients", token_bytes)]
    if stage == "dispatch_backward":
        return [("token gradients", model_bytes), ("probability gradients", top_k * PROB_BYTES)]
    raise ValueError(f"not a token stage: {stage!r}")


def deepep_ops(stage: str, layer: int, grid: np.ndarray, pos: np.ndarray, fanout: np.ndarray,
               messages: list[tuple[str, int]], batch: int = 0, sms: int = 0) -> list[CollectiveOp]:
    """One EP group's ops of a token stage: per message kind, an all_to_all_v along each
    column (the inter-node hop, A > 1) and inside each node (the forward, B > 1), all
    in one batch ``batch`` (module doc). The dispatch and combine_backward go source ->
    expert, the combine and dispatch_backward the way back (the matrices transposed).
    With a hop, the forward of the stage's first message (its token rows) carries
    ``forward_sms = sms``, the SMs of the kernels that forward it
    (``sim.network.deepep_forward``); the intranode kernels (A = 1) forward nothing."""
    inter, intra = hop_matrices(fanout, pos)
    a_nodes, b = grid.shape
    back = stage in ("combine", "dispatch_backward")
    ops = []
    for k, (label, per_row) in enumerate(messages):
        forward_sms = sms if a_nodes > 1 and k == 0 else 0
        if a_nodes > 1:
            ops += [CollectiveOp("all_to_all_v", tuple(int(r) for r in grid[:, c]), stage, layer,
                                 matrix=(inter[c].T if back else inter[c]) * per_row, batch=batch,
                                 label=f"{label} inter-node", row_bytes=per_row) for c in range(b)]
        if b > 1:
            ops += [CollectiveOp("all_to_all_v", tuple(int(r) for r in grid[row]), stage, layer,
                                 matrix=(intra[row].T if back else intra[row]) * per_row, batch=batch,
                                 label=f"{label} intra-node", row_bytes=per_row, forward_sms=forward_sms)
                    for row in range(a_nodes)]
    return ops
