"""MegaScale-MoE against Megatron-LM on MegaScale-352B, and the seed's mechanisms on top (claim C1).

The published pair (configs/published/, issue 18): MegaScale-352B on H800 in Megatron-LM's
layout (``megascale-352b-N-h800-megatron.toml``: TP 8 with sequence parallelism, EP 8, PP 15)
and in MegaScale-MoE's (``-megascale.toml``: Ulysses sequence parallelism 8, EP 8, PP 15),
simulated. The published 1.88x (arXiv 2505.11432, abstract) is MegaScale-MoE over Megatron-LM
at 1,440 GPUs. On top of the MegaScale layout at 1,440 GPUs, the seed's mechanisms one at a
time (paging, the heat map, two-stage expert sync) and all of them that the simulator runs
with that layout together (the seed's system): a mechanism the scenario refuses with that
layout (paging with pipelines) is kept with its refusal's one-line reason instead of a run.

Per run: iteration time, MFU, tokens per second per GPU, the memory breakdown of the fullest
GPU and where its peak is, and the communication share of the step. ``--quick`` runs the
1,440-GPU pair and its mechanisms only; without it the pair also at 240, 480, 720 and 960
GPUs (Table 3's counts). Every run is 2 steps (1 warm-up, 1 measured): the routing is
balanced and the simulator deterministic, so more steps give the same step.

``experiments/claims.py`` judges C1 on this sweep (``variants``, ``runs_by_label``, ``speedups``): the
same runs, never a copy.

    python experiments/paper_scale.py --quick --json
"""

from __future__ import annotations

import sys

from testbed.cli.experiment import ROOT, Experiment, bytes_by_level_figure, experiment_main, figure
from testbed.core.errors import ScenarioError
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario
from testbed.study.run_figures import scenario_of
from testbed.study.sweep import Sweep

PUBLISHED = ROOT / "configs" / "published"
GPU_COUNTS = (240, 480, 720, 960, 1440)
JUDGED_GPUS = 1440  # the published 1.88x is at 1,440 GPUs
LAYOUTS = {"megatron": "Megatron-LM layout", "megascale": "MegaScale-MoE layout"}
#: the seed's mechanisms (SPEC M6-M9, M11-M13: paging, the heat map, two-stage sync), as scenario changes
MECHANISMS = {"paging": {"pager": {"enabled": True}}, "heat map": {"heat": {"enabled": True}},
              "two-stage sync": {"comm": {"expert_sync": "two_stage"}}}
STEPS = {"run": {"steps": 2, "warmup_steps": 1}}
COMM_STAGES = ("dispatch", "combine", "combine_backward", "dispatch_backward", "expert_sync", "dense_sync")


def config_path(gpus: int, layout: str):
    return PUBLISHED / f"megascale-352b-{gpus}-h800-{layout}.toml"


def layout_label(gpus: int, layout: str) -> str:
    return f"{LAYOUTS[layout]} ({gpus:,} H800)"


def label_of(s: Scenario) -> str:
    """A run's label from its own scenario: layout, GPUs and the seed's mechanisms it runs."""
    layout = "megascale" if s.parallelism.attention_parallel == "ulysses" else "megatron"
    on = [name for name, yes in (("paging", s.pager.enabled), ("heat map", s.heat.enabled),
                                 ("two-stage sync", s.comm.expert_sync == "two_stage")) if yes]
    return " + ".join([layout_label(s.world_size, layout), *on])


def _load(opts, gpus: int, layout: str) -> Scenario:
    s = load_scenario(config_path(gpus, layout), opts.overrides).replace(**STEPS)
    return s.replace(run={"output_dir": opts.output_dir}) if opts.output_dir else s


def _with(base: Scenario, changes: list[dict]) -> Scenario | str:
    """``base`` with every section change of ``changes``, or the scenario's one-line refusal."""
    try:
        for ch in changes:
            base = base.replace(**ch)
    except ScenarioError as e:
        return str(e)
    return base


def variants(opts) -> list[tuple[str, Scenario | str]]:
    """(label, scenario, or the one-line reason the scenario refuses it) of every point, in
    the sweep's order: the pair at each GPU count, then the seed's mechanisms on the
    MegaScale layout at 1,440 GPUs, each alone, then every one accepted alone together (the
    seed's system, last)."""
    counts = (JUDGED_GPUS,) if opts.quick else GPU_COUNTS
    out: list[tuple[str, Scenario | str]] = [(layout_label(n, lay), _load(opts, n, lay))
                                             for n in counts for lay in LAYOUTS]
    base = _load(opts, JUDGED_GPUS, "megascale")
    alone = [(name, _with(base, [ch])) for name, ch in MECHANISMS.items()]
    out += [(f"{layout_label(JUDGED_GPUS, 'megascale')} + {name}", s)
            for name, s in alone]
    accepted = [name for name, s in alone if not isinstance(s, str)]
    if len(accepted) > 1:  # one alone is its own point already
        out.append((" + ".join([layout_label(JUDGED_GPUS, "megascale"), *accepted]),
                    _with(base, [MECHANISMS[name] for name in accepted])))
    return out


def build(opts) -> Sweep:
    """Simulated only, each scenario with its own profile (h800)."""
    scenarios = [s for _, s in variants(opts) if not isinstance(s, str)]
    return Sweep.of_scenarios("paper_scale_quick" if opts.quick else "paper_scale", scenarios,
                              backends=("sim",) if "sim" in opts.backends else (), repeats=1)


def runs_by_label(result) -> dict[str, dict]:
    """label (``label_of`` its scenario) -> the simulated run's summary, of the sweep ``build`` made."""
    if result is None:
        return {}
    return {label_of(scenario_of(s)): s for (i, b, _), s in sorted(result.summaries.items()) if b == "sim"}


def comm_share(summary: dict) -> float | None:
    """The token stages and the gradient syncs (``COMM_STAGES``) over the step, exposed or not."""
    stages, step = summary.get("stage_time_s") or {}, summary.get("step_time_s")
    return sum(stages.get(st, 0.0) for st in COMM_STAGES) / step if step else None


def speedups(runs: dict[str, dict]) -> dict[str, float]:
    """Step-time ratios over the Megatron-LM layout at the same GPU count (``runs``:
    ``runs_by_label``): MegaScale-MoE's layout at every count (the published 1.88x is at
    1,440), and every point with the seed's mechanisms at 1,440 (keyed by its label)."""
    out = {}
    for n in GPU_COUNTS:
        a, b = runs.get(layout_label(n, "megatron")), runs.get(layout_label(n, "megascale"))
        if a and b:
            out[f"MegaScale-MoE over Megatron-LM at {n:,} GPUs"] = a["step_time_s"] / b["step_time_s"]
    base = runs.get(layout_label(JUDGED_GPUS, "megatron"))
    for label, s in runs.items():
        if base and label.startswith(layout_label(JUDGED_GPUS, "megascale") + " + "):
            out[f"{label} over Megatron-LM"] = base["step_time_s"] / s["step_time_s"]
    return out


def analyse(result) -> dict:
    runs = runs_by_label(result)
    head: dict = {}
    for label, s in runs.items():
        for key in ("step_time_s", "mfu", "tokens_per_s_per_gpu", "peak_memory_bytes", "fits_in_device_memory",
                    "peak_memory_at"):
            head[f"{label}.{key}"] = s.get(key)
        for cat, v in (s.get("memory_breakdown_bytes") or {}).items():
            head[f"{label}.memory.{cat}"] = v
        head[f"{label}.comm_share"] = comm_share(s)
    head.update({f"speedup: {k}": v for k, v in speedups(runs).items()})  # claim C1
    return head


def figures(result, headline) -> list:
    return [bytes_by_level_figure(result, "Bytes per link level per step (simulated): MegaScale-352B in "
                                  "Megatron-LM's and MegaScale-MoE's layouts, and the seed's mechanisms")]


EXPERIMENT = Experiment(
    name="paper_scale", question=__doc__.split("\n")[0], build=build, analyse=analyse, figures=figures,
    note="configs/published/megascale-352b-*-h800-{megatron,megascale}.toml, simulated with their h800 profile; "
         "their assumptions are in the files' headers. The seed's mechanisms are applied to the MegaScale layout "
         "at 1,440 GPUs; paging is refused with pipelines (the scenario's reason in claims.json's C1). "
         "comm_share: the token stages and the gradient syncs over the step, exposed or not.",
    columns=[("MFU", lambda p: f"{100 * v:.1f}%" if (v := figure(p, "sim", "mfu")) else "—"),
             ("peak GiB (where)", lambda p: f"{(figure(p, 'sim', 'peak_memory_bytes') or 0) / 2**30:.1f} "
                                            f"({figure(p, 'sim', 'peak_memory_at')})")])

if __name__ == "__main__":
    sys.exit(experiment_main(EXPERIMENT))
