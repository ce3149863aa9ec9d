"""deepep's simulated dispatch and combine against DeepEP's published normal-kernel bandwidths.

    python benchmarks/deepep_bandwidth.py [--seed 0]

What is simulated and how (DeepEP's test routing, its logical bandwidth, what is not
modelled): ``sim.step.deepep_bandwidth``. The machine is the built-in h800 profile
(testbed/scenario/profiles/h800.toml): NVLink 160 GB/s per direction (what DeepSeek-V3 and
DeepEP's README give as achievable of H800's 200 GB/s), NIC 48 GB/s (a 400 Gb/s NDR NIC's
rate NCCL's maintainers report), the GH100's 132 SMs, and the internode kernels' forwarding
rate at 24 SMs (a user's H200 run, deepseek-ai/DeepEP#493: ``sim.network.deepep_forward``);
each figure's source is in the profile. Nothing is fitted to the published figures
(docs/published.md section 5): they are only printed beside the simulated ones.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from sim.step.deepep_bandwidth import simulate
from testbed.core.errors import run_as_command
from testbed.scenario.profile import MachineProfile, load_profile
from testbed.study.published_runs import DEEPEP_ROWS

#: docs/published.md section 5: (type, EP, dispatch GB/s, combine GB/s, the bottleneck link)
PUBLISHED = [(r.kind, r.ep, r.dispatch_GBps, r.combine_GBps, r.link) for r in DEEPEP_ROWS]


def h800_like() -> MachineProfile:
    """The built-in h800 profile (module doc)."""
    return load_profile("h800")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="seed of the routing's scores (default 0)")
    args = ap.parse_args(argv)

    def work() -> int:
        profile = h800_like()
        c = profile.collectives
        print(f"profile {profile.name}: NVLink {profile.links.nvlink.bandwidth_GBps:g} GB/s, "
              f"NIC {profile.links.nic.bandwidth_GBps:g} GB/s per direction, internode forwarding "
              f"{c.deepep_dispatch_GBps:g} / {c.deepep_combine_GBps:g} GB/s (dispatch / combine); "
              f"routing seed {args.seed}")
        print(f"{'type':<10} {'EP':>3} {'stage':<9} {'link':<7} {'published GB/s':>15} {'simulated GB/s':>15} "
              f"{'error':>7} {'sim time us':>12}")
        for kind, ep, dispatch, combine, link in PUBLISHED:
            got = simulate(ep, profile, np.random.default_rng([args.seed, ep]))  # as validate_published
            for stage, published in (("dispatch", dispatch), ("combine", combine)):
                nbytes, seconds = got[stage]
                simulated = nbytes / seconds / 1e9
                print(f"{kind:<10} {ep:>3} {stage:<9} {link:<7} {published:>15.0f} {simulated:>15.1f} "
                      f"{(simulated - published) / published:>+7.0%} {seconds * 1e6:>12.0f}")
        return 0
    return run_as_command("deepep_bandwidth", work, "stopped")


if __name__ == "__main__":
    sys.exit(main())
