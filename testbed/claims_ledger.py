"""The claims ledger's runs (``experiments/claims.py``): the sweeps the claims C1-C16 need,
each run once and reused from its index, and helpers to read their summaries.

The experiments that exist (experiments/*.py) are loaded by path, so their sweeps are
run as they are, and a run either of them finished is not run again.
"""

from __future__ import annotations

from typing import Any

from testbed.experiment import ROOT, Options, load_experiment  # noqa: F401 (load_experiment: re-exported)
from testbed.scenario import Scenario
from testbed.sweep import Sweep, SweepResult, run_sweep

NAME = "claims"
QUESTION = "Which of the seed documents' claims C1-C16 hold on the testbed, simulated and measured?"
EXPERIMENTS = ROOT / "experiments"
CONFIGS = ROOT / "configs"
MiB, GiB = 2**20, 2**30


def names(labels) -> str:
    return "; ".join(labels)


# ---- running the scenarios ----------------------------------------------------------------


class Ledger:
    """The sweeps the claims need, each run once (and reused from its index)."""

    def __init__(self, opts: Options, jobs: int | None = None, executor: str = "local", address: str | None = None,
                 fresh: bool = False, progress: bool = True):
        self.opts = opts
        self.jobs, self.executor, self.address, self.fresh, self.progress = jobs, executor, address, fresh, progress
        self._done: dict[str, SweepResult] = {}

    @property
    def quick(self) -> bool:
        return self.opts.quick

    @property
    def sim(self) -> bool:
        return "sim" in self.opts.backends

    @property
    def real(self) -> bool:
        return "real" in self.opts.backends

    def run(self, sweep: Sweep) -> SweepResult | None:
        if not sweep.backends:
            return None
        if sweep.name not in self._done:
            self._done[sweep.name] = run_sweep(sweep, jobs=self.jobs, executor=self.executor, address=self.address,
                                               fresh=self.fresh, progress=self.progress)
        return self._done[sweep.name]

    def experiment(self, name: str) -> tuple[Any, SweepResult | None]:
        module = load_experiment(name)
        return module, self.run(module.build(self.opts))

    def both(self, name: str, base: Scenario, **kw) -> SweepResult | None:
        """A sweep on the command line's backends (small scenarios: real ranks can run them)."""
        return self.run(self.opts.sweep(name, base, **kw))

    def sim_only(self, name: str, base: Scenario, **kw) -> SweepResult | None:
        """A simulated sweep with the scenario's own profile (seed-scale scenarios)."""
        return self.run(Sweep(name, base, backends=("sim",) if self.sim else (), repeats=1, **kw))

    # ---- bases ------------------------------------------------------------------------
    def config(self, name: str, **changes) -> Scenario:
        return self.opts.base(CONFIGS / f"{name}.toml").replace(**changes) if changes else \
            self.opts.base(CONFIGS / f"{name}.toml")

    def seed_base(self, *, at_scale: bool | None = None, **changes) -> Scenario:
        """paper-1440.toml, analytic network, 2 steps (1 measured); with --quick (or
        at_scale=False) on 64 GPUs with the same per-GPU shapes."""
        at_scale = (not self.quick) if at_scale is None else at_scale
        base = self.config("paper-1440", sim={"network_model": "analytic"}, run={"steps": 2, "warmup_steps": 1})
        if not at_scale:
            base = base.replace(cluster={"nodes_per_microcluster": 4, "microclusters": 2})
        return base.replace(**changes) if changes else base

    def seed_label(self, at_scale: bool | None = None) -> str:
        at_scale = (not self.quick) if at_scale is None else at_scale
        return "paper-1440 (1,440 GPUs)" if at_scale else "paper-1440 shapes on 64 GPUs (8 x 4 x 2, EP 32)"

    # ---- shared studies ---------------------------------------------------------------
    def seed(self) -> SweepResult | None:
        """The seed's scenario: two-stage sync paged (as shipped), all-reduce sync paged and
        unpaged (all-reduce: the paging comparison of C2 without two-stage sync's cost
        in wall time; the peak differs little between the two syncs)."""
        points = [{"comm.expert_sync": "two_stage", "pager.enabled": True},
                  {"comm.expert_sync": "allreduce", "pager.enabled": True},
                  {"comm.expert_sync": "allreduce", "pager.enabled": False}]
        return self.sim_only("claims_seed", self.seed_base(), points=points)

    def seed_replicas(self) -> SweepResult | None:
        """The seed's shapes on 64 GPUs with EP 8 (8 replicas of every expert): routing only
        matters here (C6), so paging is off and sync is all-reduce to keep it fast."""
        base = self.seed_base(at_scale=False, parallelism={"ep_size": 8}, pager={"enabled": False},
                              comm={"expert_sync": "allreduce"})
        return self.sim_only("claims_seed_ep8", base)

    def sparse(self) -> SweepResult | None:
        """configs/heat-drift.toml's sparse routing (16 tokens per rank, Zipf 3, mostly each
        rank's own preference) under both expert syncs, on its own 4 ranks (2 replicas):
        small enough for real ranks."""
        base = self.config("heat-drift", run={"steps": 10 if self.quick else 40, "warmup_steps": 2})
        return self.both("claims_sync_sparse", base, axes={SYNC: ["allreduce", "two_stage"]})

    def sparse_replicas(self) -> SweepResult | None:
        """The same routing on 16 simulated ranks (2 per node, 4 nodes per micro-cluster, 2
        micro-clusters) with EP 2: 8 replicas of every expert."""
        base = self.config("heat-drift", cluster={"nodes_per_microcluster": 4, "microclusters": 2},
                           run={"steps": 10 if self.quick else 40, "warmup_steps": 2})
        return self.sim_only("claims_sync_sparse_16", base, axes={SYNC: ["allreduce", "two_stage"]})

    def routing_runs(self) -> dict[str, SweepResult | None]:
        """110-step runs of two shipped small scenarios (C7, C16): real routing needs the
        real router, which these scenarios train."""
        out = {}
        for cfg in ("heat-drift", "local-cpu"):
            base = self.config(cfg)
            base = base.replace(run={"steps": 110, "warmup_steps": min(base.run.warmup_steps, 109)})
            out[cfg] = self.both(f"claims_routing_{cfg}", base)
        return out

    def page_sizes(self) -> tuple[str, SweepResult | None, SweepResult | None]:
        """(source, small sweep on both backends, seed-shaped sweep with MB pages on h200)."""
        source, small = "configs/paging-pressure.toml", None
        if (EXPERIMENTS / "sweep_page_size.py").is_file():
            module = load_experiment("sweep_page_size")
            sweep = module.build(self.opts)
            if PAGE in sweep.keys:
                source, small = "experiments/sweep_page_size.py", self.run(sweep)
        if small is None:
            sizes = [16 * 2**10, 64 * 2**10, 256 * 2**10] if self.quick else [2**k * 2**10 for k in range(2, 9)]
            small = self.both("claims_page_size", self.config("paging-pressure"), axes={PAGE: sizes})
        mb = [8 * MiB, 16 * MiB, 32 * MiB] if self.quick else [4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB]
        # all-reduce sync (as paging-pressure.toml): every replica stays current, so page moves
        # are demand loads and evictions only, not refreshes of stale replicas
        big = self.sim_only("claims_page_size_h200", self.seed_base(at_scale=False, cluster={"profile": "h200"},
                                                                     comm={"expert_sync": "allreduce"}),
                            axes={PAGE: mb})
        return source, small, big


PAGE = "pager.page_size_bytes"
SYNC = "comm.expert_sync"
SPARSE = "heat-drift routing (16 tokens per rank, Zipf 3)"
C12_LAYERS = 4


def at(result: SweepResult | None, backend: str, **match) -> list[dict]:
    """Summaries of ``backend``'s runs at the points that match ``match`` (keys with dots
    written with double underscores: pager__enabled=True)."""
    if result is None:
        return []
    want = {k.replace("__", "."): v for k, v in match.items()}
    return [s for (i, b, _), s in sorted(result.summaries.items())
            if b == backend and all(result.grid[i].get(k) == v for k, v in want.items())]


def backends_of(result: SweepResult | None) -> list[str]:
    if result is None:
        return []
    return [b for b in ("sim", "real") if any(k[1] == b for k in result.summaries)]


def side(backend: str) -> str:
    return "simulated" if backend == "sim" else "measured"
