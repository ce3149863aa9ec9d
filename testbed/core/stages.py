"""The one vocabulary of a training step, shared by the simulator, the real backend,
metrics, traces and reports (DESIGN: "One vocabulary for both backends").

Per MoE layer forward: dense -> route -> dispatch -> experts -> combine; backward
mirrors it; then the once-per-step stages. ``dense`` is the layer's non-MoE compute
when the whole transformer is modelled (``transformer.enabled``: attention, the dense
layers before it, the output head after the last layer), else empty. ``paging`` holds
every page move and replica refresh, wherever in the step it happens; ``heat`` is the
heat-map update (M18).
"""

FORWARD = ("dense", "route", "dispatch", "experts", "combine")
BACKWARD = ("combine_backward", "experts_backward", "dispatch_backward", "route_backward", "dense_backward")
PER_STEP = ("expert_sync", "dense_sync", "optimizer", "paging", "heat")
STAGES = FORWARD + BACKWARD + PER_STEP

#: streams a GPU works on (simulator) and the real backend labels its regions with
STREAMS = ("compute", "comm", "copy")


def empty_stage_map(value=0):
    """{stage: value} for every stage, in step order."""
    return {s: value for s in STAGES}

#: stages whose work depends on the token strategy (their host cost is per strategy)
TOKEN_STAGES = ("dispatch", "combine", "combine_backward", "dispatch_backward")


def stage_variant(stage: str, token_strategy: str, expert_sync: str) -> str:
    """The strategy a stage's host cost depends on: the token strategy for token stages,
    the expert sync for expert_sync, none ("") for the others (calibration and the
    simulator's host costs must agree on this)."""
    if stage in TOKEN_STAGES:
        return token_strategy
    return expert_sync if stage == "expert_sync" else ""
