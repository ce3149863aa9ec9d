"""Run a scenario on a backend and store it in the run store (``testbed.run.store``).

Besides the steps, every run's summary says how its batch and its GPUs are laid out as
Megatron-Core defines them (issue 25, item 1):

- ``batch``: the step's batch in sequences (``testbed.layout.batch``): from
  ``workload.global_batch``, or today's ``workload.tokens_per_rank`` converted (or why it
  cannot be); the whole transformer's only.
- ``groups``: rank 0's process groups as Megatron-Core's ``initialize_model_parallel``
  forms them for the scenario's sizes (``testbed.layout.process_groups``), every GPU's in
  the run folder's ``groups.json``. The backends form their EP and expert-DP (replica)
  groups from ``parallelism.placement`` (``testbed.scenario.topology.Layout``, each
  pipeline stage laid out alone); where those are not Megatron's (placement strided or
  random) the line gives the backends' and says so, and ``groups.json`` holds both.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from testbed.core.errors import ScenarioError
from testbed.layout.batch import equivalent_batch, megatron_batch
from testbed.layout.process_groups import build_process_groups, describe_groups, groups_of_kind, groups_table
from testbed.policy.pipeline_stages import stage_scenario
from testbed.run.backend import RunResult, get_backend
from testbed.run.features import check_features
from testbed.run.guards import check_size
from testbed.run.memory_verdict import summary_memory_verdict
from testbed.run.results import StepRecord, summarize, throughput
from testbed.run.sources import describe_sources
from testbed.run.store import GROUPS_FILE, RunWriter, check_resumable, latest_run, load_run, new_run_id
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


def _peak_flops(scenario: Scenario) -> float | None:
    """One GPU's matmul peak for the model's dtype from the scenario's profile (None when
    the profile cannot be read: then there is no MFU)."""
    try:
        return load_profile(scenario.cluster.profile).compute.peak(scenario.model.dtype)
    except ScenarioError:  # a profile that cannot be read only costs the MFU figure
        return None


def batch_summary(scenario: Scenario) -> dict | None:
    """The step's batch in sequences (module doc), None without the whole transformer:
    ``source`` the field it comes from, ``global_batch`` and ``micro_batch_size`` in
    sequences (None where today's tokens have no whole equivalent), ``dp`` (None where the
    layout is not whole), ``micro_batches`` and ``tokens_per_rank`` as the run takes them,
    ``seq_len``, and ``text``, the one line a summary prints."""
    s, w, t, p = scenario, scenario.workload, scenario.transformer, scenario.parallelism
    if not t.enabled:
        return None
    out = {"micro_batches": t.micro_batches, "tokens_per_rank": w.tokens_per_rank, "seq_len": t.seq_len}
    sizes = (t.seq_len, s.world_size, p.tp_size, p.cp_size, p.pp_size, p.sequence_parallel)
    if w.global_batch:
        b = megatron_batch(w.global_batch, w.micro_batch_size, *sizes)  # Scenario.from_dict made these figures
        text = (f"workload.global_batch = {b.global_batch} sequences of {b.seq_len} tokens, micro-batches of "
                f"{b.micro_batch} on each of DP {b.dp}: transformer.micro_batches = {t.micro_batches}, "
                f"workload.tokens_per_rank = {w.tokens_per_rank} ({b.routed_tokens_per_micro_batch} a "
                f"micro-batch on each GPU)")
        return {"source": "workload.global_batch", "global_batch": b.global_batch, "micro_batch_size": b.micro_batch,
                "dp": b.dp, **out, "text": text}
    try:
        c = equivalent_batch(w.tokens_per_rank, t.micro_batches, *sizes)
    except ScenarioError as e:  # a layout that is not whole in Megatron's terms
        text = f"workload.tokens_per_rank = {w.tokens_per_rank}: no Megatron batch ({e})"
        return {"source": "workload.tokens_per_rank", "global_batch": None, "micro_batch_size": None, "dp": None,
                **out, "text": text}
    return {"source": "workload.tokens_per_rank", "global_batch": c.global_batch, "micro_batch_size": c.micro_batch,
            "dp": s.world_size // (p.tp_size * p.cp_size * p.pp_size), **out, "text": c.message}


def backend_expert_groups(scenario: Scenario) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(EP groups, expert-DP groups) in global ranks as the backends form them: each
    pipeline stage's GPUs laid out by ``parallelism.placement`` as a cluster of their own
    (``testbed.policy.pipeline_stages``), its EP groups in EP-index order and the replica
    groups of each EP index (over which the experts' gradients are summed)."""
    s = scenario
    pp = s.parallelism.pp_size
    stage = stage_scenario(s) if pp > 1 else s
    layout, per = Layout(stage), s.world_size // pp
    ep = [tuple(k * per + r for r in layout.ep_group(g)) for k in range(pp) for g in range(layout.replicas)]
    slices = layout.expert_dp_groups() if layout.megatron_groups else [layout.replica_group(j) for j in range(layout.ep_size)]
    edp = [tuple(k * per + r for r in g) for k in range(pp) for g in slices]
    return ep, edp


def process_groups_file(scenario: Scenario) -> tuple[dict, dict]:
    """(``groups.json``'s content, the summary's ``groups`` entry) of the scenario (module
    doc). ``groups.json``: Megatron-Core's groups (``groups_table``), ``backend`` the EP and
    expert-DP groups the backends form and ``ep_as_megatron`` whether they are Megatron's;
    or ``error``, why Megatron-Core cannot form this layout. The entry: ``file``, ``rank0``
    (rank 0's groups, one line, the backends' EP side), ``ep_as_megatron``, ``note``."""
    s, p = scenario, scenario.parallelism
    try:
        groups = build_process_groups(s.world_size, p.tp_size, p.cp_size, p.pp_size, p.ep_size, p.etp_size,
                                      p.moe_layout)
    except ScenarioError as e:
        note = f"not a layout Megatron-Core forms: {e}"
        return {"error": str(e)}, {"file": GROUPS_FILE, "rank0": None, "ep_as_megatron": False, "note": note}
    ep, edp = backend_expert_groups(s)
    same = set(ep) == set(groups_of_kind(groups, "ep")) and set(edp) == set(groups_of_kind(groups, "edp"))
    note = ""
    if not same:  # the line gives rank 0's EP side as the backends run it
        ep0, edp0 = next(g for g in ep if 0 in g), next(g for g in edp if 0 in g)
        ranks = (dataclasses.replace(groups.ranks[0], ep=ep0, etp=(0,), edp=edp0, tp_ep=ep0), *groups.ranks[1:])
        groups_line = dataclasses.replace(groups, ranks=ranks)
        note = (f"ep, edp and tp_ep as parallelism.placement = {p.placement} forms them, not Megatron-Core's "
                f"(both in {GROUPS_FILE})")
    else:
        groups_line = groups
    table = {**groups_table(groups), "backend": {"placement": p.placement, "ep": [list(g) for g in ep],
                                                "edp": [list(g) for g in edp]}, "ep_as_megatron": same}
    return table, {"file": GROUPS_FILE, "rank0": describe_groups(groups_line, 0), "ep_as_megatron": same,
                   "note": note}


def run_scenario(scenario: Scenario, backend: str = "sim", *, progress: bool = False,
                 reuse: bool = False, resume: str | Path | None = None, force: bool = False) -> dict:
    """Run ``scenario`` on ``backend`` and return its summary (with ``run_dir``).

    ``reuse=True`` returns the summary of the latest complete run of this scenario instead
    of running again (what sweeps use to resume where they stopped).

    ``resume``: a stopped run folder of this scenario to continue from its latest
    complete checkpoint (M23; backends that keep checkpoints: real); its steps.jsonl
    keeps the steps before that point and continues. A resume that is refused leaves the
    folder as it was.

    Before anything starts, the scenario's size is checked against what this machine
    holds (``testbed.run.guards``; ``force`` goes on anyway), and the backend checks what it
    can run (``check(scenario, resume, force)``). A run that fails or is stopped before
    its first step leaves no folder; one stopped later keeps its steps, marked incomplete.

    Backends that take a run folder (``takes_run_dir``) are given it, for checkpoints and
    profiler traces. A backend may say this process does not write the run folder
    (``writes_run_folder()``: a torchrun rank other than 0, which runs its share of the
    job while rank 0 writes): then nothing is written and the summary is only
    ``{"backend", "run_dir": None, "writer": False}``.
    """
    if reuse and resume is None and (done := latest_run(scenario, backend)) is not None:
        return load_run(done)[1]
    impl = get_backend(backend)
    takes_run_dir = getattr(impl, "takes_run_dir", False)
    if resume is not None:
        if not takes_run_dir:
            raise ScenarioError("--resume", str(resume), f"the {backend} backend keeps no checkpoints to resume from")
        check_resumable(resume, scenario)
    check_features(scenario, backend)
    check_size(scenario, backend, force=force)
    if hasattr(impl, "check"):
        impl.check(scenario, resume=resume, force=force)
    writes = getattr(impl, "writes_run_folder", lambda: True)()
    run_id = new_run_id(scenario, backend, getattr(impl, "job_id", lambda: None)())
    writer = RunWriter(scenario, backend, resume, run_id) if writes else None
    if writer is not None:
        run_dir = writer.dir
    else:  # the folder rank 0 writes; checkpoints and profiler traces of this rank go there too
        run_dir = Path(resume) if resume is not None else Path(scenario.run.output_dir) / run_id
    records: list[StepRecord] = []

    def on_step(record: StepRecord) -> None:
        records.append(record)
        if writer is not None:
            writer.write_step(record)

    options = {"run_dir": run_dir, "resume": True if resume is not None else None} if takes_run_dir else {}
    groups_json, groups = process_groups_file(scenario)
    files = {GROUPS_FILE: json.dumps(groups_json, separators=(",", ":"))}
    # ranks and the cores of the machine the run ran on: CPU ranks sharing fewer cores is
    # one reason a measured step differs from a simulated one (testbed.report.comparison_findings)
    fields = {"backend": backend, "run_dir": str(run_dir), "ranks": scenario.world_size,
              "host_cpu_count": os.cpu_count(), **describe_sources(scenario, backend),
              "batch": batch_summary(scenario), "groups": groups}
    try:
        result: RunResult = impl.run(scenario, progress=progress, on_step=on_step, **options)
    except BaseException:
        if writer is not None and writer.started_writing:  # stopped or failed: keep what was measured
            writer.finish(summarize(writer.kept + records, scenario.run.warmup_steps, **fields), [], None,
                          complete=False, files=files)
        elif writer is not None:
            writer.abandon()  # refused or failed before its first step: no folder
        raise
    if writer is None:
        return {"backend": backend, "run_dir": None, "writer": False}
    kept = writer.continue_from(result.extra["resumed_from"]) if resume is not None else []
    summary = summarize(kept + result.records, scenario.run.warmup_steps, **fields)
    summary.update(throughput(scenario, kept + result.records, summary["step_time_s"], _peak_flops(scenario)))
    summary.update(result.extra)
    if (verdict := summary_memory_verdict(summary)) is not None:  # what overflows the device, and by how much
        summary["memory_verdict"] = verdict
    writer.finish(summary, result.trace_events, result.routing, files=files)
    return summary
