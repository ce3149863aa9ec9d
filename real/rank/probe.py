"""M20's probe activation on a real rank: how long a probed expert takes to answer.

Each probed expert instance this rank holds an up-to-date replica of is activated for
real: its weights are read from wherever its pages are (a frozen expert's from the host
pool, across PCIe on a GPU) and it runs on ``heat.probe_tokens`` tokens drawn from a
generator seeded by (run seed, step, instance). The seconds from the start of the read to
the result (device synchronised) are its answer; the answers are maximised over all ranks
(``Planner.probe_ops``: an instance answers when its slowest replica has), so every rank's
heat map wakes the same experts. The probe changes no page table: it reads the pages
where they are.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from real.kernels.experts import split_flat
from real.kernels.ffn_activation import ffn_forward
from real.rank.layer import own_op, seed_of


def probe_answers(st, step: int, instances: np.ndarray) -> np.ndarray:
    """Seconds each of ``instances`` took to answer its probe, the slowest replica's
    (``st``: the rank's ``RankState``)."""
    s, m = st.scenario, st.scenario.model
    local = set(st.controller.local_instances(st.rank).tolist())
    group = st.layout.group_of[st.rank]
    cuda = st.device.type == "cuda"
    answers = np.zeros(len(instances))
    for k, inst in enumerate(np.asarray(instances).tolist()):
        if inst not in local or not st.controller.fresh[inst, group]:
            continue  # no replica here, or a stale one (it has no weights to run)
        gen = torch.Generator().manual_seed(seed_of(s.run.seed, step, inst, 0x9808E))
        x = torch.randn(s.heat.probe_tokens, m.hidden_size, generator=gen).to(st.device, st.dtype)
        if cuda:
            torch.cuda.synchronize(st.device)
        start = time.perf_counter()
        with torch.no_grad():
            swiglu = m.ffn_activation == "swiglu"
            w1, w2 = split_flat(st.read_weights(inst), m.hidden_size, m.ffn_hidden_size, swiglu)
            y = ffn_forward(x, w1, w2, swiglu)
        if cuda:
            torch.cuda.synchronize(st.device)
        del y
        answers[k] = time.perf_counter() - start
    buf = torch.from_numpy(answers).to(st.device)
    op = own_op(st.planner.probe_ops(len(instances)), st.rank, buf)
    if op is not None:
        st.comm.all_reduce(buf, op.members, st.groups.get(op.members), reduce_op=dist.ReduceOp.MAX)
    return buf.cpu().numpy()
