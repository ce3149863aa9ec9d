"""MegaScale-MoE's Megatron-LM baseline (arXiv 2505.11432 §6.1: 1,440 GPUs, TP 8 with
sequence parallelism inside a node, PP 15, DP 12, a global batch of 720 x 8,192) on the
simulator, one step: the scenario tests/testbed/scenario/test_batch_resolution.py builds,
with the megascale-352b preset's shared expert left out (the simulator plans no shared
experts under tensor parallelism: ``sim.hardware.model_support``) and the h200 profile as
a placeholder for the H800 (issue 19)."""

import pytest

from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

#: as tests/testbed/scenario/test_batch_resolution.py's, the shared expert left out (module doc);
#: micro-batches of 1 (assumed: not stated); 15 micro-clusters of 12 nodes, a stage each
MEGASCALE_BASELINE = {
    "model": {"preset": "megascale-352b", "shared_experts": 0},
    "cluster": {"gpus_per_node": 8, "nodes_per_microcluster": 12, "microclusters": 15, "profile": "h200"},
    "parallelism": {"tp_size": 8, "sequence_parallel": True, "pp_size": 15, "ep_size": 8},
    "transformer": {"enabled": True, "seq_len": 8192},
    "pager": {"enabled": False},
    "workload": {"global_batch": 720, "micro_batch_size": 1},
}


def test_one_step_of_the_megatron_baseline_on_1440_gpus(tmp_path):
    """The pipeline of 15 stages runs its 60 micro-batches; each GPU sends its own 1,024
    tokens' activations (bf16, H 4,096) across a stage boundary per micro-batch and their
    gradient back (14 of 15 stages send each way, on average per GPU); rank 0's groups are
    Megatron-Core's: TP 0-7, PP every 96th rank, DP every 8th of its stage."""
    data = {k: dict(v) for k, v in MEGASCALE_BASELINE.items()}
    data["run"] = {"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)}
    s = Scenario.from_dict(data)
    summary = run_scenario(s, "sim")
    pipe = summary["pipeline"]
    assert (pipe["stages"], pipe["micro_batches"]) == (15, 60)
    assert pipe["send_bytes_per_gpu"] == 1024 * 4096 * 2 * 2 * 60 * 14 / 15
    assert 0 < pipe["bubble_fraction"] < 1
    # the step's tokens: 720 x 8,192 over 1,440 GPUs
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(720 * 8192 / 1440 / summary["step_time_s"], rel=1e-9)
    assert summary["groups"]["rank0"].startswith("rank 0: tp [0..7] cp [0] dp [0,8..88] dp_cp [0,8..88] "
                                                 "pp [0,96..1344] ep [0..7]")
    assert summary["batch"]["micro_batches"] == 60 and summary["batch"]["dp"] == 12
