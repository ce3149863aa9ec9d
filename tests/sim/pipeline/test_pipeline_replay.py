"""A pipelined scenario replaying a routing trace (``workload.trace``) on the simulator: each
pipeline rank replays each micro-batch's counts (``micro_routed``, as a pipelined real run
writes it), so the step's bytes are every micro-batch's of every rank; a trace without them is
refused naming what is missing (issue 25, item 4). And the heat map under pipeline stages."""

import numpy as np
import pytest
import tomli_w

from testbed.core.errors import ScenarioError
from testbed.policy.pipeline_stages import PipelineStages, rank_scenario
from testbed.run.backend import get_backend
from testbed.run.routing_trace import RoutingTrace
from testbed.scenario.scenario import Scenario

M, STEPS, L, W, E, T, K = 4, 2, 4, 2, 4, 128, 2  # micro-batches, steps, layers, a stage's GPUs, experts, tokens, top-k
TOKEN_STAGES = ("route", "dispatch", "combine", "combine_backward", "dispatch_backward")


def scenario(tmp_path, **sections) -> Scenario:
    """The real backend's pipelined test (tests/real/rank/test_pipeline_micro_batches.py) on the
    simulator: 4 GPUs (2 nodes of 2), PP 2 x EP 2, 4 MoE layers of 4 experts, 4 micro-batches of one
    32-token sequence; dropless unless a test sets the capacity."""
    d = {
        "model": {"hidden_size": 32, "ffn_hidden_size": 64, "num_layers": L, "num_experts": E},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2, "pp_size": 2},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": 32, "vocab_size": 256,
                        "moe_every": 2, "micro_batches": M},
        "router": {"noise": "none", "capacity_factor": 0.0},
        "pager": {"enabled": False},
        "comm": {"expert_sync": "allreduce"},
        "workload": {"tokens_per_rank": T},
        "run": {"steps": STEPS, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")},
    }
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    return Scenario.from_dict(d)


def micro_counts(seed=0) -> np.ndarray:
    """[steps, M, L, W, E]: each micro-batch's T / M tokens, top-2, routed unevenly."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(E, 0.5), size=(STEPS, M, L, W))
    out = np.zeros_like(p, dtype=np.int64)
    for idx in np.ndindex(p.shape[:-1]):
        out[idx] = rng.multinomial(T // M * K, p[idx])
    return out


def write_trace(folder, counts, tokens=T) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    RoutingTrace(counts, tokens, K).save(folder)
    return str(folder)


def test_a_pipelined_replay_moves_one_micro_batchs_route_all_gather_more_per_micro_batch(tmp_path):
    """Against the one-stage replay of the step's counts summed (EP 2 on 2 GPUs, every layer, one
    micro-batch): dropless, the token rows of the micro-batches add up to the step's, so every
    stage and link level moves the same bytes but the route all-gathers, once per micro-batch and
    layer (E int32 over each EP group, inside a node: NVLink); the dense sync, once a step, holds
    the embedding on stage 0 and the head on stage 1 only, as the one stage holds each once."""
    trace = write_trace(tmp_path / "trace", micro_counts())
    s = scenario(tmp_path, workload={"trace": trace})
    one = s.replace(cluster={"nodes_per_microcluster": 1}, parallelism={"pp_size": 1}, transformer={"micro_batches": 1})
    pp, flat = get_backend("sim").run(s), get_backend("sim").run(one)
    for a, b in zip(flat.records, pp.records, strict=True):
        route = a.bytes_by_stage["route"]
        assert route == L * W * E * 4
        assert b.bytes_by_stage == dict(a.bytes_by_stage, route=M * route)
        assert b.bytes_by_level == dict(a.bytes_by_level, nvlink=a.bytes_by_level["nvlink"] + (M - 1) * route)
        assert b.bytes_by_stage["dense_sync"] > 0 and b.bytes_by_stage["dispatch"] > 0
    assert pp.extra["pipeline"]["in_flight"] == [2, 1]


def test_each_pipeline_rank_replays_each_micro_batch_with_its_own_capacity(tmp_path):
    """With a capacity (factor 1: T / M x 2 / 4 = 16 slots an expert and micro-batch) the kept rows
    depend on how the step's counts split into micro-batches: the pipelined replay's token-exchange
    bytes are the sum over its 2 pipeline ranks and 4 micro-batches of each one's replay on its own
    (its stage scenario, its layers, that micro-batch's counts), and not those of the step's counts
    summed, which drop fewer."""
    counts = micro_counts(1)
    trace = write_trace(tmp_path / "trace", counts)
    s = scenario(tmp_path, workload={"trace": trace}, router={"capacity_factor": 1.0})
    pp = get_backend("sim").run(s)
    stages = PipelineStages.of(s)
    want = {k: np.zeros(STEPS, dtype=np.int64) for k in TOKEN_STAGES}
    for r, rank in enumerate(stages.ranks):
        layers = [c.first_moe + j for c in rank.chunks for j in range(c.moe)]
        for i in range(M):
            folder = write_trace(tmp_path / f"rank{r}_micro{i}", counts[:, i][:, layers], T // M)
            alone = get_backend("sim").run(rank_scenario(s, rank.mix).replace(workload={"trace": folder}))
            for k in TOKEN_STAGES:
                want[k] += [rec.bytes_by_stage[k] for rec in alone.records]
    for step, rec in enumerate(pp.records):
        assert {k: rec.bytes_by_stage[k] for k in TOKEN_STAGES} == {k: int(want[k][step]) for k in TOKEN_STAGES}
    one = s.replace(cluster={"nodes_per_microcluster": 1}, parallelism={"pp_size": 1}, transformer={"micro_batches": 1})
    summed = get_backend("sim").run(one)
    assert all(a.bytes_by_stage["dispatch"] > b.bytes_by_stage["dispatch"] for a, b in zip(summed.records, pp.records))


def test_a_trace_without_each_micro_batchs_counts_is_refused(tmp_path):
    """The step's counts alone cannot be split into micro-batches: refused before a run, naming
    the field, the missing micro_routed and the shapes; so is a trace of the whole cluster's
    GPUs where a stage's are wanted."""
    summed = write_trace(tmp_path / "summed", micro_counts().sum(axis=1))
    with pytest.raises(ScenarioError, match=r"workload\.trace.*micro_routed \[steps, 4, layers, ranks, experts\].*"
                                            r"\[2, 4, 2, 4\], no micro_routed"):
        get_backend("sim").check(scenario(tmp_path, workload={"trace": summed}))
    wide = write_trace(tmp_path / "wide", np.concatenate([micro_counts()] * 2, axis=3))
    with pytest.raises(ScenarioError, match=r"the trace has 4 ranks but cluster \(GPUs\) / parallelism.pp_size 2 "
                                            r"\(a stage's\) = 2"):
        get_backend("sim").check(scenario(tmp_path, workload={"trace": wide}))


def test_testbed_run_replays_a_pipelined_trace_and_names_a_bad_one(tmp_path, capsys):
    """``testbed run --backend sim`` on a pipelined scenario: with a trace of each micro-batch it
    runs; with one of the step's counts it prints one line naming the field, no traceback."""
    from testbed.cli.main import main as cli_main

    path = tmp_path / "s.toml"
    path.write_text(tomli_w.dumps(scenario(tmp_path).to_dict()))
    good = write_trace(tmp_path / "good", micro_counts())
    assert cli_main(["run", str(path), "--backend", "sim", "--no-progress", "--json",
                     "--set", f"workload.trace={good}"]) == 0
    capsys.readouterr()
    bad = write_trace(tmp_path / "bad", micro_counts().sum(axis=1))
    assert cli_main(["run", str(path), "--backend", "sim", "--no-progress", "--set", f"workload.trace={bad}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "workload.trace" in err[0] and "no micro_routed" in err[0]


def test_the_heat_map_runs_under_pipeline_stages(tmp_path):
    """heat.enabled with PP 2 on 8 GPUs (a stage: 4 GPUs, EP 2, 2 replicas): each stage's heat
    map updates every 2 steps, its kept slots summed over the stage's GPUs by one all-reduce of
    the steps since the last update (2 x its 2 layers x 4 experts, float64), once a step on
    each stage, not per micro-batch; a step without an update moves no heat bytes."""
    s = scenario(tmp_path, cluster={"gpus_per_node": 4}, heat={"enabled": True, "update_interval": 2},
                 run={"steps": 4})
    out = get_backend("sim").run(s)
    heat = [r.bytes_by_stage.get("heat", 0) for r in out.records]
    assert heat[0] == heat[2] == 0 and heat[1] == heat[3] > 0
    per_stage_ring = 2 * (4 - 1) * (2 * 2 * E * 8)  # a ring all-reduce over 4 GPUs: 2 (n-1) / n x size, x n
    assert heat[1] == 2 * per_stage_ring
    assert out.records[1].expert_states is not None and sum(out.records[1].expert_states.values()) > 0
