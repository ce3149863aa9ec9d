"""The router fields that must fit together and with the model: group-limited routing's
groups and the experts and top-k they hold (checked when the scenario is built, so a bad
value is one line before any rank starts)."""

from __future__ import annotations

from testbed.core.errors import ScenarioError
from testbed.scenario.sections import RouterConfig


def check_router(cfg: RouterConfig, num_experts: int, top_k: int) -> None:
    """Raise ``ScenarioError`` for router fields that do not fit together or the model."""
    g, m = cfg.expert_groups, cfg.groups_per_token
    if g == 0:
        if m:
            raise ScenarioError("router.groups_per_token", m, "needs router.expert_groups (0: no group limit)")
        return
    if num_experts % g:
        raise ScenarioError("router.expert_groups", g, f"does not divide model.num_experts = {num_experts}")
    if not 1 <= m <= g:
        raise ScenarioError("router.groups_per_token", m, f"must be between 1 and router.expert_groups = {g}")
    per_group = num_experts // g
    if m * per_group < top_k:
        raise ScenarioError("router.groups_per_token", m, f"{m} groups of {per_group} experts hold fewer than "
                                                          f"model.top_k = {top_k}")
    if cfg.group_score == "top2_sum" and per_group < 2:
        raise ScenarioError("router.group_score", "top2_sum", "needs two or more experts per group "
                                                              f"({num_experts} experts in {g} groups)")
