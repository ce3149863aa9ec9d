"""Whether the simulator's synthetic routing needs per-token scores for the router's
fields; without torch, so that the simulator's controller and workload do not load it
for scenarios that need none. (The fields' checks: ``testbed.scenario.router_checks``.)
"""

from __future__ import annotations

from testbed.scenario.scenario import Scenario


def routes_by_scores(scenario: Scenario) -> bool:
    """Whether the router's choice needs scores beyond M4's popularity - a group limit or
    bias balancing - so that the simulator routes token by token
    (``testbed.policy.scored_routing``)."""
    r = scenario.router
    return r.expert_groups > 0 or r.bias_update_rate > 0
