"""Where a run's numbers come from: the machine profile, how it was made, and the routing.

A simulated step time means little without knowing whether the simulator used a generic
built-in profile or one calibrated on this machine, and whether it timed synthetic
routing or replayed a real run's; a real run routes with its router.

A validation judges the simulator on points calibration never saw. What calibration did
is recorded in the profile (``[calibration]``, written by ``testbed calibrate``):
``check_calibration`` refuses a profile made otherwise (unless allowed, and then says
so), one measured on another kind of device or network; ``check_out_of_sample`` refuses
points that share a fitted scenario's model shape and token count; ``shared_settings``
says what calibration and validation do share.
"""

from __future__ import annotations

import platform

from testbed.core.errors import ScenarioError
from testbed.scenario.profile import CALIBRATE_TOOL, MachineProfile, load_profile
from testbed.scenario.scenario import Scenario

#: a scenario's model shape and token count: a judged point may share none with a fitted scenario
SHAPE_KEYS = ("hidden", "ffn_hidden", "num_experts", "top_k", "tokens_per_rank")
#: what a judged point may share with the fitted scenarios, each named in the report (a
#: single part of the shape too: only all of ``SHAPE_KEYS`` together is refused)
SETTING_KEYS = {"cluster": "cluster (GPUs per node x nodes per micro-cluster x micro-clusters)",
                "world": "world size", "ep_size": "EP size", "token_strategy": "token strategy",
                "expert_sync": "expert sync", "num_layers": "layers", "dtype": "dtype",
                "seq_len": "sequence length", "hidden": "hidden size", "ffn_hidden": "expert ffn size",
                "num_experts": "experts", "top_k": "top-k", "tokens_per_rank": "tokens per rank"}


def calibrated_here(profile: MachineProfile) -> bool:
    """The profile was made by ``testbed calibrate`` (or holds its measurements) on this machine."""
    m = profile.measured
    made = profile.calibration.made_by_calibrate or bool(m.collective_latency or m.compute_scale or m.stage_us)
    host = platform.node()
    return made and (profile.versions.get("host") == host or (bool(host) and host in profile.description))


def describe_sources(scenario: Scenario, backend: str) -> dict:
    """Summary fields: ``profile``, ``profile_source`` (its first sentence),
    ``profile_calibrated_here`` and ``routing_source``. Loading the profile here also
    refuses a missing one before any run starts."""
    profile = load_profile(scenario.cluster.profile)
    if backend == "real":
        routing = "real router"
    elif scenario.workload.trace:
        routing = f"replayed trace of {scenario.workload.trace}"
    else:
        routing = "synthetic workload (M4)"
    return {"profile": profile.name, "profile_source": profile.source.split(". ")[0].strip()[:200],
            "profile_calibrated_here": calibrated_here(profile), "routing_source": routing}


# ---- what calibration did, against what a validation judges --------------------------------
def scenario_record(name: str, s: Scenario) -> dict:
    """A ``calibration.scenarios`` row of scenario ``s`` (also how a judged point is compared)."""
    m, c = s.model, s.cluster
    return {"name": name, "world": s.world_size, "gpus_per_node": c.gpus_per_node,
            "nodes_per_microcluster": c.nodes_per_microcluster, "microclusters": c.microclusters,
            "ep_size": s.parallelism.ep_size, "hidden": m.hidden_size, "ffn_hidden": m.ffn_hidden_size,
            "num_experts": m.num_experts, "top_k": m.top_k, "num_layers": m.num_layers, "dtype": m.dtype,
            "tokens_per_rank": s.workload.tokens_per_rank,
            "seq_len": s.transformer.seq_len if s.transformer.enabled else 0,
            "token_strategy": s.comm.token_strategy, "expert_sync": s.comm.expert_sync}


def shape_text(row: dict) -> str:
    """hidden x ffn x experts top-k x tokens per rank of a record."""
    return (f"{row['hidden']}x{row['ffn_hidden']}x{row['num_experts']} top-{row['top_k']}, "
            f"{row['tokens_per_rank']} tokens a rank")


def check_calibration(profile: MachineProfile, device: str, fabric: str, allow_uncalibrated: bool = False,
                      flag: str = "--profile", gpu: str = "") -> str:
    """Refuse ``profile`` for a validation grid whose real runs use ``device`` (cpu or cuda)
    over ``fabric`` (loopback, emulated; device for GPU ranks); returns the report's
    sentence on how the profile was made.

    A profile not made by ``testbed calibrate`` is refused unless ``allow_uncalibrated``
    (the sentence then says so); one calibrated on another kind of device or network, or
    (``gpu``) on another GPU, is always refused: its figures describe another machine."""
    cal = profile.calibration
    if not cal.made_by_calibrate:
        if not allow_uncalibrated:
            raise ScenarioError(flag, profile.name,
                                f"not made by {CALIBRATE_TOOL} (the profile has no [calibration] section): run "
                                f"`{CALIBRATE_TOOL}{' --device cuda' if device == 'cuda' else ''}"
                                f"{' --fabric emulated' if fabric == 'emulated' else ''} --name NAME` first, or "
                                "pass --allow-uncalibrated to judge it anyway")
        return (f"The profile {profile.name} was not made by {CALIBRATE_TOOL} (allowed by --allow-uncalibrated): "
                "its figures were not measured on this machine, and nothing checks that they were not fitted to "
                "the points judged here.")
    if cal.device != device:
        raise ScenarioError(flag, profile.name, f"calibrated on {cal.device}, but these points run on {device}: "
                            f"run `{CALIBRATE_TOOL} --device {device} --name NAME`")
    if cal.fabric != fabric:
        raise ScenarioError(flag, profile.name, f"calibrated over the {cal.fabric} network, but these points run "
                            f"over the {fabric} one")
    if gpu and cal.gpu != gpu:
        raise ScenarioError(flag, profile.name, f"calibrated on a {cal.gpu or 'CPU'}, but these points run on a {gpu}")
    fitted = len(cal.scenarios)
    return (f"The profile {profile.name} was made by {CALIBRATE_TOOL} on {cal.gpu or cal.device} over the "
            f"{cal.fabric} network{' (--quick)' if cal.quick else ''}, fitting the real runs of {fitted} "
            f"scenario{'s' if fitted != 1 else ''}.")


def check_out_of_sample(profile: MachineProfile, points: list[tuple[str, Scenario]], flag: str = "--profile") -> str:
    """Refuse judged ``points`` ((name, scenario)) when one shares a fitted scenario's model
    shape and token count (``SHAPE_KEYS``); returns the report's sentence saying so."""
    fitted = profile.calibration.scenarios
    if not profile.calibration.made_by_calibrate:
        return "Nothing records which scenarios the profile was fitted to: the points are not checked against them."
    by_shape = {tuple(r[k] for k in SHAPE_KEYS): r for r in fitted}
    for name, s in points:
        row = scenario_record(name, s)
        hit = by_shape.get(tuple(row[k] for k in SHAPE_KEYS))
        if hit is not None:
            raise ScenarioError(flag, profile.name, f"point {name} shares the model shape and token count "
                                f"({shape_text(row)}) of calibration scenario {hit['name']}: it is not out of sample")
    shapes = sorted({shape_text(r) for r in fitted})
    if not shapes:
        return "Calibration fitted no scenario's runs (micro-benchmarks only): no point can share one's shape."
    return (f"No point shares a model shape and token count with a calibration scenario (checked for all "
            f"{len(points)} points against calibration's {'; '.join(shapes)}).")


def shared_settings(profile: MachineProfile, points: list[tuple[str, Scenario]]) -> list[str]:
    """What the judged points share with the scenarios calibration fitted, one sentence
    per ``SETTING_KEYS`` entry they share (the values in common), plus the machine."""
    cal = profile.calibration
    if not cal.made_by_calibrate:
        return []
    out = [f"the machine and its network ({cal.gpu or cal.device}, {cal.fabric})"]
    fitted = [dict(r, cluster=f"{r['gpus_per_node']}x{r['nodes_per_microcluster']}x{r['microclusters']}")
              for r in cal.scenarios]
    judged = [dict(scenario_record(n, s), cluster=f"{s.cluster.gpus_per_node}x{s.cluster.nodes_per_microcluster}"
                   f"x{s.cluster.microclusters}") for n, s in points]
    for key, what in SETTING_KEYS.items():
        common = sorted({r[key] for r in fitted} & {r[key] for r in judged}, key=str)
        if key == "seq_len":  # 0: no transformer around the MoE layers
            common = ["none (the MoE stack alone)" if v == 0 else v for v in common]
        if common:
            out.append(f"{what} {', '.join(map(str, common))}")
    return out
