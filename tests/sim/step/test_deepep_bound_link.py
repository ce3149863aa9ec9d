"""What DeepEP's simulated normal kernels are bound by (sim.step.deepep_bandwidth) on the
h800 profile. Two nodes (EP 16) forward more rows over NVLink than they send over the
network: the forwarding kernels' rate (sim.network.deepep_forward, 124.92 GB/s at 24 SMs,
DeepEP#493's H200 figure) binds before NVLink's 160 GB/s does. DeepEP's maintainers put that
run's limit on the forwarding over NVLink too ("when the RDMA bandwidth reaches 43 GB/s, the
NVLink bandwidth will exceed 140 GB/s", DeepEP#285). Four nodes (EP 32) bind on the NIC, the
forwarders within 1% of binding too (a -20% cut of theirs would bind). The -20% cut of the
binding figure slows the kernel by nearly its whole 20% (a link's latency is the rest; the
forwarding floor has none, so all of it). A cut of a figure that does not bind moves it by
under 1% (NVLink at EP 16 comes nearest: at -20% it nearly binds the combine)."""

import numpy as np
import pytest

from sim.network.deepep_forward import REFERENCE_SMS, forward_floor_seconds
from sim.step.deepep_bandwidth import bandwidths_GBps
from testbed.policy.collectives import CollectiveOp
from testbed.scenario.profile import load_profile
from testbed.study.profile_sensitivity import moved

NVLINK, NIC = "links.nvlink.bandwidth_GBps", "links.nic.bandwidth_GBps"
FORWARD = ("collectives.deepep_dispatch_GBps", "collectives.deepep_combine_GBps")


def _change(ep: int, keys) -> dict[str, float]:
    profile = load_profile("h800")
    base = bandwidths_GBps(ep, profile, np.random.default_rng(3))
    cut = profile
    for key in (keys,) if isinstance(keys, str) else keys:
        cut = moved(cut, key, 0.8)
    cut = bandwidths_GBps(ep, cut, np.random.default_rng(3))
    return {stage: cut[stage] / base[stage] - 1 for stage in base}


@pytest.mark.parametrize("ep, bound, free", [(16, FORWARD, (NVLINK, NIC)), (32, NIC, (NVLINK,))])
def test_the_binding_figure_takes_the_cut(ep, bound, free):
    for stage, change in _change(ep, bound).items():
        assert -0.20 - 1e-9 <= change <= -0.18, (stage, change)
    for keys in free:
        for stage, change in _change(ep, keys).items():
            assert abs(change) <= 0.01, (keys, stage, change)


def test_the_forward_floor_by_hand():
    """A node's forward of 3 members: member 1 receives the most, 6e9 bytes (dispatch:
    column sums 2, 6, 1 GB); at 124.92 GB/s and 12 SMs (half the reference 24) it takes at
    least 6e9 / 62.46e9 s. The combine's matrix is the transpose: row sums, at 145.16 GB/s.
    Ops that are no forward (forward_sms 0: the hop, the intranode kernels) have no floor."""
    c = load_profile("h800").collectives
    m = np.array([[1, 2, 0], [1, 3, 1], [0, 1, 0]]) * 10**9
    op = CollectiveOp("all_to_all_v", (0, 1, 2), "dispatch", matrix=m, forward_sms=REFERENCE_SMS // 2)
    assert forward_floor_seconds(op, c) == pytest.approx(6e9 / (124.92e9 / 2))
    back = CollectiveOp("all_to_all_v", (0, 1, 2), "combine", matrix=m.T, forward_sms=REFERENCE_SMS)
    assert forward_floor_seconds(back, c) == pytest.approx(6e9 / 145.16e9)
    assert forward_floor_seconds(CollectiveOp("all_to_all_v", (0, 1, 2), "dispatch", matrix=m), c) == 0.0
    assert forward_floor_seconds(op, load_profile("a100-seed").collectives) == 0.0  # no rate in the profile
