"""The real backend: the scenario's ranks as PyTorch processes (gloo on CPU, NCCL on GPUs)."""

from __future__ import annotations

from real.launch import pick_device, run_ranks
from testbed.backend import RunResult
from testbed.errors import ScenarioError
from testbed.progress import Progress
from testbed.routing_trace import RoutingTrace
from testbed.scenario import Scenario


class RealBackend:
    name = "real"

    def run(self, scenario: Scenario, *, progress: bool = False, on_step=None, debug: dict | None = None) -> RunResult:
        """Run the scenario's ranks; ``debug`` is for tests (``RankRunner.run``)."""
        if scenario.workload.trace:
            raise ScenarioError("workload.trace", scenario.workload.trace,
                                "the real backend routes real tokens; a trace is replayed by --backend sim")
        records = []
        bar = Progress(scenario.run.steps, f"real x{scenario.world_size}", enabled=progress)

        def step(record):
            records.append(record)
            if on_step:
                on_step(record)
            bar.update(note=f"step {record.step_time_s * 1e3:.1f} ms, loss {record.loss:.4f}")

        payload = run_ranks(scenario, step, debug)
        routing = RoutingTrace(payload["routing"], scenario.workload.tokens_per_rank, scenario.model.top_k)
        extra = {"device": pick_device(scenario), "group_create_s": payload["group_create_s"]}
        return RunResult(scenario, records, payload["trace"], routing, extra, captured=payload.get("captured"))
