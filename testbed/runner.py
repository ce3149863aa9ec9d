"""Run a scenario on a backend and store it as a run folder (``testbed.runs``)."""

from __future__ import annotations

from testbed.backend import RunResult, get_backend
from testbed.results import StepRecord, summarize
from testbed.runs import RunWriter, find_complete, load_run
from testbed.scenario import Scenario


def run_scenario(scenario: Scenario, backend: str = "sim", *, progress: bool = False,
                 reuse: bool = False) -> dict:
    """Run ``scenario`` on ``backend`` and return its summary (with ``run_dir``).

    ``reuse=True`` returns the summary of an identical finished run instead of running
    again (what sweeps use to resume where they stopped).
    """
    if reuse and (done := find_complete(scenario, backend)) is not None:
        return load_run(done)[1]
    impl = get_backend(backend)
    writer = RunWriter(scenario, backend)
    records: list[StepRecord] = []

    def on_step(record: StepRecord) -> None:
        records.append(record)
        writer.write_step(record)

    fields = {"backend": backend, "run_dir": str(writer.dir)}
    try:
        result: RunResult = impl.run(scenario, progress=progress, on_step=on_step)
    except BaseException:
        # stopped or failed: keep what was measured, marked incomplete
        writer.finish(summarize(records, scenario.run.warmup_steps, **fields), [], None, complete=False)
        raise
    summary = summarize(result.records, scenario.run.warmup_steps, **fields)
    summary.update(result.extra)
    writer.finish(summary, result.trace_events, result.routing)
    return summary
