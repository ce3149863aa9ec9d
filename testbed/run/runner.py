"""Run a scenario on a backend and store it in the run store (``testbed.run.store``)."""

from __future__ import annotations

import os
from pathlib import Path

from testbed.core.errors import ScenarioError
from testbed.run.backend import RunResult, get_backend
from testbed.run.features import check_features
from testbed.run.guards import check_size
from testbed.run.results import StepRecord, summarize, throughput
from testbed.run.sources import describe_sources
from testbed.run.store import RunWriter, check_resumable, latest_run, load_run, new_run_id
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario


def _peak_flops(scenario: Scenario) -> float | None:
    """One GPU's matmul peak for the model's dtype from the scenario's profile (None when
    the profile cannot be read: then there is no MFU)."""
    try:
        return load_profile(scenario.cluster.profile).compute.peak(scenario.model.dtype)
    except ScenarioError:  # a profile that cannot be read only costs the MFU figure
        return None


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
    # ranks and the cores of the machine the run ran on: CPU ranks sharing fewer cores is
    # one reason a measured step differs from a simulated one (testbed.report.comparison_findings)
    fields = {"backend": backend, "run_dir": str(run_dir), "ranks": scenario.world_size,
              "host_cpu_count": os.cpu_count(), **describe_sources(scenario, backend)}
    try:
        result: RunResult = impl.run(scenario, progress=progress, on_step=on_step, **options)
    except BaseException:
        if writer is not None and writer.started_writing:  # stopped or failed: keep what was measured
            writer.finish(summarize(writer.kept + records, scenario.run.warmup_steps, **fields), [], None,
                          complete=False)
        elif writer is not None:
            writer.abandon()  # refused or failed before its first step: no folder
        raise
    if writer is None:
        return {"backend": backend, "run_dir": None, "writer": False}
    kept = writer.continue_from(result.extra["resumed_from"]) if resume is not None else []
    summary = summarize(kept + result.records, scenario.run.warmup_steps, **fields)
    summary.update(throughput(scenario, kept + result.records, summary["step_time_s"], _peak_flops(scenario)))
    summary.update(result.extra)
    writer.finish(summary, result.trace_events, result.routing)
    return summary
