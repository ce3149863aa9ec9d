"""Sizes of a step's work per GPU, from the controller's decisions: the page copies and
slots of page moves, the pages M17 compacts, the send and receive buffers of collectives,
and how ops split into concurrent batches and micro-batches.
"""

from __future__ import annotations

from itertools import groupby

import numpy as np

from testbed.policy.collectives import CollectiveOp
from testbed.policy.micro_batches import chunk_rows
from testbed.policy.page_moves import GPU, HOST
from testbed.policy.pager_pool import MovesByRank


def batches(ops: list[CollectiveOp]) -> list[list[CollectiveOp]]:
    """Consecutive ops of one (layer, batch) run together."""
    return [list(g) for _, g in groupby(ops, key=lambda o: (o.layer, o.batch))]


def split_op(op: CollectiveOp, n: int, i: int) -> CollectiveOp:
    """Micro-batch ``i`` of ``n`` of an op: an n-th of its bytes (remainders to the
    first), an all-to-all of token rows in whole rows as the real backend sends them
    (``testbed.policy.micro_batches``)."""
    if op.kind == "all_to_all_v":
        if op.row_bytes > 0:
            matrix = chunk_rows(op.matrix // op.row_bytes, n, i) * op.row_bytes
        else:
            matrix = chunk_rows(op.matrix, n, i)
        return CollectiveOp(op.kind, op.members, op.stage, op.layer, matrix=matrix, batch=op.batch,
                            stream=op.stream, label=op.label, row_bytes=op.row_bytes, forward_sms=op.forward_sms)
    size = op.size // n + (op.size % n > i)
    return CollectiveOp(op.kind, op.members, op.stage, op.layer, size=size, batch=op.batch,
                        stream=op.stream, label=op.label)


def page_copy(moves: MovesByRank, world: int):
    """(h2d bytes, d2h bytes, pages copied, GPU slots taken (+) or freed (-)) per rank."""
    h2d, d2h = np.zeros(world), np.zeros(world)
    pages, slots = np.zeros(world, dtype=np.int64), np.zeros(world, dtype=np.int64)
    for ranks, m in moves.groups():  # every rank of a group moved the same pages
        load = (m.src == HOST) & (m.dst == GPU)
        out = (m.src == GPU) & (m.dst == HOST) & (m.nbytes > 0)
        h2d[ranks] += m.nbytes[load].sum()
        d2h[ranks] += m.nbytes[out].sum()
        pages[ranks] += int(load.sum() + out.sum())
        slots[ranks] += int(((m.dst == GPU) & (m.src != GPU)).sum() - ((m.src == GPU) & (m.dst != GPU)).sum())
    return h2d, d2h, pages, slots


def defrag_pages(moves: MovesByRank, world: int) -> np.ndarray:
    """[W] pages each GPU moves from one device slot to another (M17's compaction)."""
    out = np.zeros(world, dtype=np.int64)
    for ranks, m in moves.groups():
        out[ranks] += int(((m.src == GPU) & (m.dst == GPU)).sum())
    return out


def buffer_bytes(ops: list[CollectiveOp], world: int) -> np.ndarray:
    """[W] send + receive buffer bytes each rank holds while ``ops`` run."""
    out = np.zeros(world)
    for op in ops:
        m = np.asarray(op.members)
        if op.kind == "all_to_all_v":
            out[m] += op.matrix.sum(axis=1) + op.matrix.sum(axis=0)
        elif op.kind == "all_gather":
            out[m] += op.size * (1 + len(m))
        elif op.kind == "reduce_scatter":
            out[m] += op.size * (1 + 1 / len(m))
        else:  # all_reduce in place, p2p one buffer
            out[m] += op.size
    return out
