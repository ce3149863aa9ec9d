"""How a token exchange splits into micro-batches (M22, ``overlap.micro_batches``).

Each sender splits the rows it sends each receiver into ``n`` consecutive chunks, the
first ``count % n`` of them one row longer: micro-batch ``i`` carries chunk ``i`` of
every (sender, receiver) pair. The simulator splits an op's byte matrix this way
(``sim.step.phase_sizes.split_op``, in whole rows of ``CollectiveOp.row_bytes``) and the real
backend moves exactly these rows (``real.comm.micro_batches``), so both count the same bytes per
micro-batch.
"""

from __future__ import annotations

import numpy as np


def chunk_rows(count, n: int, i: int):
    """Rows of chunk ``i`` of ``n`` of ``count`` rows (elementwise on arrays)."""
    count = np.asarray(count)
    return count // n + (count % n > i)


def chunk_start(count, n: int, i: int):
    """Offset of chunk ``i`` of ``n`` in ``count`` rows (elementwise on arrays)."""
    count = np.asarray(count)
    return i * (count // n) + np.minimum(i, count % n)
