"""Megatron-Core's --tp-comm-overlap on the simulator (``overlap.tp_comm``,
``sim.step.context_parallel_ring``): a block's tensor-parallel all-gathers and reduce-scatters
run on the comm stream beside its compute, the compute slowed by the reduce-scatters' 16 SMs
(``sm_slowed``), and the chain goes on when both are done; and NCCL's exchange kernels' SMs
(``collectives.kernel_sms``) slow the shared experts beside a dispatch as DeepEP's do."""

import numpy as np
import pytest

from sim.backend import ClusterSim, routing_source
from sim.step.context_parallel_ring import UB_REDUCE_SCATTER_SMS
from sim.step.kernel_sms import exchange_sm_share, sm_slowed
from sim.step.schedule import run_analytic
from testbed.core.errors import ScenarioError
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario


def scenario(**overlap) -> Scenario:
    """4 H200s of one node, TP 2 with sequence parallelism, EP 2, one MoE layer and its
    attention (a dense layer before it)."""
    return Scenario.from_dict({
        "model": {"hidden_size": 256, "ffn_hidden_size": 512, "num_experts": 4, "top_k": 2, "num_layers": 2,
                  "dtype": "bf16"},
        "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 1, "microclusters": 1, "profile": "h200"},
        "parallelism": {"tp_size": 2, "ep_size": 2, "etp_size": 2, "moe_layout": "nested", "sequence_parallel": True},
        "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": 512, "vocab_size": 1024,
                        "moe_every": 2},
        "pager": {"enabled": False}, "heat": {"enabled": False}, "router": {"capacity_factor": 0.0},
        "workload": {"tokens_per_rank": 512, "skew": 0.0}, "sim": {"network_model": "analytic"},
        "overlap": overlap, "run": {"steps": 1, "warmup_steps": 0}})


def step(s: Scenario):
    sim = ClusterSim(s, load_profile("h200"))
    _, phases, *_ = sim.step(0, np.asarray(routing_source(s)(0)), [])
    return sim, phases


def test_tp_comm_overlap_needs_sequence_parallelism():
    with pytest.raises(ScenarioError, match="overlap.tp_comm"):
        Scenario.from_dict({**scenario().to_dict(), "overlap": {"tp_comm": True},
                            "parallelism": {"tp_size": 2, "ep_size": 2, "etp_size": 2, "moe_layout": "nested",
                                            "sequence_parallel": False}})


def test_a_blocks_collectives_run_beside_its_compute_and_the_chain_waits_for_both():
    sim, phases = step(scenario(tp_comm=True))
    _, plain = step(scenario(tp_comm=False))
    tl = run_analytic(phases, 4, sim.timer, 0.0, sim.copy_latency)
    blocks = [i for i, ph in enumerate(phases) if ph.stage == "dense" and ph.kind == "wait" and len(ph.deps) == 2]
    assert blocks, "every overlapped block ends in a wait for its compute and its collectives"
    for i in blocks:
        compute, comm = phases[i].deps
        assert phases[compute].stream == "compute" and phases[comm].stream == "comm"
        # the block's first collective starts with its compute (both after the chain's end before them)
        first_ops = next(j for j in range(compute + 1, comm + 1) if phases[j].kind == "ops")
        assert phases[first_ops].deps == phases[compute].deps
        assert np.allclose(tl.start[first_ops], tl.start[compute])
        assert np.allclose(tl.end[i], np.maximum(tl.end[compute], tl.end[comm]))
    # the compute beside reduce-scatters runs on 132 - 16 SMs while they run (sm_slowed, alone times)
    share = UB_REDUCE_SCATTER_SMS / load_profile("h200").compute.sm_count
    i = blocks[0]
    compute, comm = phases[i].deps
    scatters = [op for ph in phases[compute + 1:comm + 1] if ph.kind == "ops" for op in ph.ops
                if op.kind == "reduce_scatter"]
    assert scatters
    unslowed = next(ph for ph in plain if ph.stage == "dense" and ph.kind == "compute").seconds
    want = sm_slowed(unslowed, sim.builder.batch_seconds(scatters), share)
    assert np.allclose(phases[compute].seconds, want, rtol=1e-12)
    assert np.all(phases[compute].seconds > unslowed)


def test_the_overlap_shortens_the_step_by_at_most_the_collectives():
    """Overlapped, the step is shorter than in the chain, and shorter by no more than the
    blocks' collectives take in the chain (what the overlap can hide)."""
    from sim.backend import SimBackend

    on = SimBackend().run(scenario(tp_comm=True)).records[0]
    off = SimBackend().run(scenario(tp_comm=False)).records[0]
    hidden = off.step_time_s - on.step_time_s
    assert hidden > 0
    sim, phases = step(scenario(tp_comm=False))
    tp_ops = [ph for ph in phases if ph.stage in ("dense", "dense_backward") and ph.kind == "ops"]
    tl = run_analytic(phases, 4, sim.timer, 0.0, sim.copy_latency)
    chain_s = max(float(sum((tl.end[phases.index(ph)] - tl.start[phases.index(ph)])[r] for ph in tp_ops))
                  for r in range(4))
    assert hidden <= chain_s * (1 + 1e-9)


def test_nccl_kernels_sms_are_the_profiles_and_deepeps_its_own():
    s = scenario()
    assert exchange_sm_share(s, 132, 16) == pytest.approx(16 / 132)
    assert exchange_sm_share(s, 0, 16) == 0.0  # CPU ranks: no SMs
    assert exchange_sm_share(s, 132, 0) == 0.0
    deepep = Scenario.from_dict({**s.to_dict(), "comm": {"token_strategy": "deepep", "deepep_sms": 20}})
    assert exchange_sm_share(deepep, 132, 16) == pytest.approx(20 / 132)
    with pytest.raises(ScenarioError, match="collectives.kernel_sms"):
        exchange_sm_share(s, 132, 132)


def test_nccls_sms_under_the_sync_stream_slow_the_compute_after_it(tmp_path):
    """With the gradient sync overlapped with the backward, each sync op's time alone runs
    beside the compute phases issued after it: the first of them takes ``sm_slowed`` of its
    seconds with the whole budget, and the budget shrinks by what it took."""
    from testbed.scenario.profile import profile_from_dict, save_profile

    d = load_profile("h200").to_dict()
    d["collectives"]["kernel_sms"] = 16
    path = save_profile(profile_from_dict(d, "sms"), tmp_path / "sms.toml")
    s = Scenario.from_dict({**scenario().to_dict(), "overlap": {"sync_with_backward": True}})
    s = Scenario.from_dict({**s.to_dict(), "cluster": {**s.to_dict()["cluster"], "profile": str(path)}})
    d0 = load_profile("h200").to_dict()
    d0["collectives"]["kernel_sms"] = 0
    path0 = save_profile(profile_from_dict(d0, "nosms"), tmp_path / "nosms.toml")
    s0 = Scenario.from_dict({**s.to_dict(), "cluster": {**s.to_dict()["cluster"], "profile": str(path0)}})
    sim = ClusterSim(s, load_profile(str(path)))
    _, phases, *_ = sim.step(0, np.asarray(routing_source(s)(0)), [])
    sim0 = ClusterSim(s0, load_profile(str(path0)))
    _, phases0, *_ = sim0.step(0, np.asarray(routing_source(s0)(0)), [])
    assert len(phases) == len(phases0)
    first_sync = next(i for i, ph in enumerate(phases) if ph.stream == "sync" and ph.kind == "ops")
    after = [i for i in range(first_sync + 1, len(phases))
             if phases[i].kind == "compute" and phases[i].stream == "compute"]
    assert after
    budget = sim.builder.batch_seconds(phases[first_sync].ops)
    i = after[0]
    between = [j for j in range(first_sync + 1, i) if phases[j].stream == "sync" and phases[j].kind == "ops"]
    for j in between:
        budget = budget + sim.builder.batch_seconds(phases[j].ops)
    want = sm_slowed(phases0[i].seconds, budget, 16 / 132)
    assert np.allclose(phases[i].seconds, want, rtol=1e-12) and np.all(phases[i].seconds > phases0[i].seconds)
    # before the first sync op nothing is slowed
    assert all(np.array_equal(phases[j].seconds, phases0[j].seconds) for j in range(first_sync)
               if phases[j].kind == "compute")
