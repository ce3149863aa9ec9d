"""The bound that DeepEP's internode kernels put on their own forwarding. After the
inter-node hop, a node's forwarding GPUs pass each token row on over NVLink to the GPUs of
its experts (``testbed.policy.deepep``). The kernels do this on ``comm.deepep_sms`` SMs, and
their copy rate, not NVLink's, can be what limits them.

The published measurement: 16 H200s (two nodes, one 400 Gb/s CX7 NIC a GPU) with DeepEP's
test routing and 24 SMs reach 124.92 GB/s (FP8 dispatch) and 145.16 GB/s (combine) of the
rows a GPU receives over NVLink, its own included (DeepEP's "NVL" figure), and 38.19 and
44.37 GB/s "RDMA" (deepseek-ai/DeepEP#493). An H200's NVLink carries about 370 GB/s a
direction (nccl-tests#212), so the link is not the limit there.

The profile gives those rates (``collectives.deepep_dispatch_GBps`` and
``deepep_combine_GBps``) at 24 SMs. Assumed:
- the rate is in proportion to the kernels' SMs;
- it is the same on every GH100 (H800, H100, H200: the same SMs at the same clocks).

A forward op (``CollectiveOp.forward_sms > 0``) then takes at least

    (the most bytes one member receives, source -> expert, or sends, expert -> source)
    / (rate x forward_sms / REFERENCE_SMS)

besides what its links allow. Both timing modes take that floor (``sim.step.schedule``,
``sim.network.analytic_timer``).

Seconds, bytes, GB/s = 1e9 bytes/s.
"""

from __future__ import annotations

from testbed.policy.collectives import CollectiveOp
from testbed.scenario.profile import CollectiveFigures

#: SMs of the kernels the profile's rates were measured with (DeepEP's tests' default num_sms)
REFERENCE_SMS = 24
#: token stages whose rows go source -> expert (the others: expert -> source)
TO_EXPERTS = ("dispatch", "combine_backward")


def forward_floor_seconds(op: CollectiveOp, collectives: CollectiveFigures) -> float:
    """The least seconds ``op`` takes by its forwarding kernels' rate (module doc); 0 for an
    op that is no DeepEP forward or a profile without the rate."""
    if op.forward_sms <= 0 or op.matrix is None:
        return 0.0
    to_experts = op.stage in TO_EXPERTS
    rate = collectives.deepep_dispatch_GBps if to_experts else collectives.deepep_combine_GBps
    if rate <= 0:
        return 0.0
    most = float(op.matrix.sum(axis=0 if to_experts else 1).max())
    return most / (rate * 1e9 * op.forward_sms / REFERENCE_SMS)
