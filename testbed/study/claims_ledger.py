"""The claims ledger's runs (``experiments/claims.py``): the sweeps the claims C1-C16 need,
each run once and reused from its index, and helpers to read their summaries.

The experiments that exist (experiments/*.py) are loaded by path, so their sweeps are
run as they are, and a run either of them finished is not run again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from testbed.core.errors import ScenarioError
from testbed.policy.capacity import expert_capacity, kept_counts
from testbed.policy.pager import RankPager
from testbed.run.routing_trace import RoutingTrace
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout
from testbed.study.experiments import ROOT, Options, load_experiment  # noqa: F401 (load_experiment: re-exported)
from testbed.study.run_figures import scenario_of
from testbed.study.sweep import Sweep, SweepResult, run_sweep

NAME = "claims"
QUESTION = "Which of the seed documents' claims C1-C16 hold on the testbed, simulated and measured?"
EXPERIMENTS = ROOT / "experiments"
CONFIGS = ROOT / "configs"
MiB, GiB = 2**20, 2**30


def names(labels) -> str:
    return "; ".join(labels)


#: memory categories (``memory_breakdown_bytes``) other than the expert weights' pages
NON_EXPERT_MEMORY = ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers", "communicators")


def page_budget_from(device_memory_bytes: float, breakdown: dict[str, float], free_fraction: float,
                     page_size_bytes: int) -> int | None:
    """C2's page budget, bytes per GPU, derived from the machine and an unpaged run, not
    from the claim: the device memory, less everything else the unpaged run's fullest
    GPU holds (``NON_EXPERT_MEMORY`` of its ``memory_breakdown_bytes``: each category at
    its most over the step, so their sum bounds what they hold at once from above), less
    M15's free margin (``free_fraction`` of the device), in whole pages. None where
    nothing is left for a page."""
    left = device_memory_bytes * (1 - free_fraction) - sum(float(breakdown.get(k, 0.0)) for k in NON_EXPERT_MEMORY)
    pages = int(left // page_size_bytes)
    return pages * page_size_bytes if pages > 0 else None


def first_pages_shares(summary: dict, first: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(share of the weight bytes each forward read from its expert's ``first`` pages,
    share of the expert's pages it read), one entry per forward of an expert replica.

    The counts are the pager's (``testbed.policy.pager.RankPager``, the page table both backends
    keep): the run's own routing (routing.npz, measured steps) is replayed through a
    pager per rank of the first EP group (one replica of every expert; the other groups'
    pagers count alike), and after each layer's ``access`` the pins of each accessed
    expert's pages (``refcount``) times their bytes are what that forward read. A forward
    is an expert whose EP group kept tokens for it in a layer of a step (M9's activity)."""
    s = scenario_of(summary)
    lay, m = Layout(s), s.model
    routed = RoutingTrace.load(summary["run_dir"]).routed[s.run.warmup_steps:]  # [S, L, W, E]
    capacity = expert_capacity(s.workload.tokens_per_rank, m.top_k, m.num_experts, s.router.capacity_factor,
                               lay.ep_size, s.router.pad_capacity_to_ep)
    pagers = {}
    for r in lay.rank_of[0]:
        experts = np.asarray(lay.local_experts(int(r)))
        instances = (np.arange(m.num_layers)[:, None] * m.num_experts + experts[None, :]).ravel()  # layer-major
        pagers[int(r)] = (experts, RankPager(int(r), instances, m.expert_bytes, s.pager))
    covered, read = [], []
    for step in range(routed.shape[0]):
        for layer in range(m.num_layers):
            active = kept_counts(routed[step, layer], capacity)[lay.rank_of].sum(axis=1) > 0  # [R, E]
            for r, (experts, pager) in pagers.items():
                used = layer * m.num_experts + experts[active[lay.group_of[r], experts]]
                pager.access(used, step)
                pins, nbytes = pager.refcount, pager.page_nbytes
                for inst in used:
                    pages = pager.pages_of(int(inst))
                    reads = pins[pages] * nbytes[pages]
                    covered.append(float(reads[:first].sum() / reads.sum()))
                    read.append(float((pins[pages] > 0).mean()))
                pager.end_step()
    return np.array(covered), np.array(read)


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
    def seed_unpaged(self) -> SweepResult | None:
        """paper-1440.toml as shipped (1,440 GPUs, whatever --quick says: ZeRO shards
        over the seed's 45 replicas; on 64 GPUs the optimizer state alone overflows a GPU)
        without paging: what a GPU holds besides its experts' pages (C2)."""
        return self.sim_only("claims_seed_unpaged", self.seed_base(at_scale=True, pager={"enabled": False}))

    def seed_page_budget(self) -> tuple[int | None, dict, list[dict]]:
        """(budget, its parts, the runs it comes from): ``page_budget_from`` on the
        unpaged seed run with its profile's ``compute.device_memory_GB`` (or the scenario's
        ``pager.device_memory_bytes``, as the simulator takes it) and the scenario's M15
        fraction (``pager.emergency_free_fraction``). (None, {}, []) without a simulated
        run; (None, parts, runs) where nothing is left for a page."""
        runs = at(self.seed_unpaged(), "sim")
        if not runs:
            return None, {}, []
        s = scenario_of(runs[0])
        # the device memory the simulator models: pager.device_memory_bytes, else the profile's
        device = float(s.pager.device_memory_bytes or load_profile(s.cluster.profile).compute.device_memory_GB * 1e9)
        breakdown = runs[0]["memory_breakdown_bytes"]
        budget = page_budget_from(device, breakdown, s.pager.emergency_free_fraction, s.pager.page_size_bytes)
        parts = {"device_memory_bytes": device,
                 "non_expert_memory_bytes": sum(float(breakdown.get(k, 0.0)) for k in NON_EXPERT_MEMORY),
                 "free_margin_bytes": s.pager.emergency_free_fraction * device,
                 "page_size_bytes": s.pager.page_size_bytes, "derived_page_budget_bytes": budget,
                 "config_page_budget_bytes": self.config("paper-1440").pager.gpu_budget_bytes}
        return budget, parts, runs

    def _budget(self) -> dict:
        """The paged seed points' pager budget: the derived one (the config's where none)."""
        budget = self.seed_page_budget()[0] if self.sim else None
        return {"pager.gpu_budget_bytes": budget} if budget else {}

    def seed_paged_at_scale(self) -> list[dict]:
        """Summaries of paper-1440 as shipped at 1,440 GPUs, paged with the derived budget
        (C2; ``seed``'s two-stage point where that runs at scale)."""
        if not self.quick:
            return at(self.seed(), "sim", comm__expert_sync="two_stage", pager__enabled=True)
        return at(self.sim_only("claims_seed_paged", self.seed_base(at_scale=True), points=[self._budget()]), "sim")

    def seed(self) -> SweepResult | None:
        """The seed's scenario, paged with the budget derived from the unpaged run
        (``seed_page_budget``, which configs/paper-1440.toml is meant to hold): two-stage
        sync (as shipped) and all-reduce sync."""
        points = [{"comm.expert_sync": sync, "pager.enabled": True, **self._budget()}
                  for sync in ("two_stage", "allreduce")]
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

    def a2a_payload(self) -> dict[str, SweepResult | None]:
        """C16's test (docs/claims.md): scenarios whose all-to-all takes different shares
        of the step, each with its dispatch/combine payload as the model's dtype and as fp8
        (M22 compression: half of bf16's bytes, a quarter of fp32's); label -> sweep. Two
        shipped small scenarios on the command line's backends, and the quickstart
        cluster on the seed's profile (a100-seed) with 4,096 tokens per rank, H = 2048 and
        FFNs of 1,024, 2,048 and 8,192 (simulated only): less FFN work per token puts a
        larger share of the step in the all-to-all."""
        steps = {"run": {"steps": 8 if self.quick else 20, "warmup_steps": 2}}
        out = {}
        for cfg in ("quickstart", "heat-drift"):
            out[f"{cfg} ({steps['run']['steps']} steps)"] = self.both(
                f"claims_a2a_payload_{cfg}", self.config(cfg, **steps), axes={PAYLOAD: ["model", "fp8"]})
        seed_hw = self.config("quickstart", cluster={"profile": "a100-seed"}, workload={"tokens_per_rank": 4096},
                              model={"hidden_size": 2048}, pager={"enabled": False},
                              comm={"expert_sync": "allreduce"}, **steps)
        out["quickstart cluster, a100-seed profile, 4,096 tokens per rank, H 2048"] = self.sim_only(
            "claims_a2a_payload_a100", seed_hw, axes={"model.ffn_hidden_size": [1024, 2048, 8192],
                                                      PAYLOAD: ["model", "fp8"]})
        return out

    def published_names(self) -> list[str]:
        """The published scenarios (configs/published/*.toml, by file stem) the ledger runs:
        all of them; with --quick all but ``SLOW_PUBLISHED``."""
        return [p.stem for p in sorted(PUBLISHED.glob("*.toml")) if not (self.quick and p.stem in SLOW_PUBLISHED)]

    def published(self) -> dict[str, dict[str, dict]]:
        """stem -> {payload -> summary}: every published scenario (``published_names``),
        simulated with its own profile, 2 steps (1 measured: the routing is balanced and the
        simulator deterministic), its dispatch/combine payload (``comm.payload_dtype``) as
        the model's dtype ("model") and as fp8; C13 reads the file's own payload, C16 both.
        A payload the scenario refuses is left out."""
        labelled, scenarios = [], []
        for stem in self.published_names():
            base = self.opts.base(PUBLISHED / f"{stem}.toml").replace(run={"steps": 2, "warmup_steps": 1})
            for payload in ("model", "fp8"):
                try:
                    scenarios.append(base.replace(comm={"payload_dtype": payload}))
                except ScenarioError:
                    continue
                labelled.append((stem, payload))
        if not scenarios:
            return {}
        res = self.run(Sweep.of_scenarios("claims_published_quick" if self.quick else "claims_published", scenarios,
                                          backends=("sim",) if self.sim else (), repeats=1))
        out: dict[str, dict[str, dict]] = {}
        for (i, b, _), s in sorted((res.summaries if res else {}).items()):
            if b == "sim":
                stem, payload = labelled[i]
                out.setdefault(stem, {})[payload] = s
        return out


PUBLISHED = CONFIGS / "published"
#: published scenarios the simulator takes minutes for (DeepEP's planner on 1,024 and 2,048
#: GPUs: about 100 s a run on this project's 2-core machine), left out with --quick
SLOW_PUBLISHED = ("deepseek-v3-1024-h100", "deepseek-v3-2048-h800")
PAGE = "pager.page_size_bytes"
PAYLOAD = "comm.payload_dtype"
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
