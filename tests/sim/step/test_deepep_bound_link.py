"""Which link DeepEP's simulated normal kernels are bound by (sim.step.deepep_bandwidth):
two nodes (EP 16) forward more rows over NVLink than they send over the network, so the
NVLink figure binds, as DeepEP's maintainers report of their EP 16 run (DeepEP#285); four
nodes (EP 32) bind on the NIC. The -20% cut of the binding link slows the kernel by nearly
its whole 20% (latency is the rest); the other link's cut leaves it within 0.5%."""

import numpy as np
import pytest

from sim.step.deepep_bandwidth import bandwidths_GBps
from testbed.scenario.profile import load_profile
from testbed.study.profile_sensitivity import moved

NVLINK, NIC = "links.nvlink.bandwidth_GBps", "links.nic.bandwidth_GBps"


def _change(ep: int, key: str) -> dict[str, float]:
    profile = load_profile("h800")
    base = bandwidths_GBps(ep, profile, np.random.default_rng(3))
    cut = bandwidths_GBps(ep, moved(profile, key, 0.8), np.random.default_rng(3))
    return {stage: cut[stage] / base[stage] - 1 for stage in base}


@pytest.mark.parametrize("ep, bound, free", [(16, NVLINK, NIC), (32, NIC, NVLINK)])
def test_the_binding_link_takes_the_cut(ep, bound, free):
    for stage, change in _change(ep, bound).items():
        assert -0.20 <= change <= -0.18, (stage, change)
    for stage, change in _change(ep, free).items():
        assert abs(change) <= 0.005, (stage, change)
