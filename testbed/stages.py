"""The one vocabulary of a training step, shared by the simulator, the real backend,
metrics, traces and reports (DESIGN: "One vocabulary for both backends").

Per MoE layer forward: route -> dispatch -> experts -> combine; backward mirrors it;
then the once-per-step stages. ``paging`` holds every page move and replica refresh,
wherever in the step it happens; ``heat`` is the heat-map update (M18).
"""

FORWARD = ("route", "dispatch", "experts", "combine")
BACKWARD = ("combine_backward", "experts_backward", "dispatch_backward", "route_backward")
PER_STEP = ("expert_sync", "dense_sync", "optimizer", "paging", "heat")
STAGES = FORWARD + BACKWARD + PER_STEP

#: streams a GPU works on (simulator) and the real backend labels its regions with
STREAMS = ("compute", "comm", "copy")


def empty_stage_map(value=0):
    """{stage: value} for every stage, in step order."""
    return {s: value for s in STAGES}
