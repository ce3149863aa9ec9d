"""Pipeline parallelism and micro-batches in the simulator (``sim.pipeline.run``): one
stage simulated on one micro-batch, the step timed by the 1F1B / interleaved schedule
with sends on the whole cluster's network."""

import pytest

from sim.pipeline.run import boundary_send_seconds
from testbed.core.errors import ScenarioError
from testbed.policy.pipeline_stages import stage_scenario
from testbed.run.runner import run_scenario
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario


def scenario(tmp_path, pp=1, micro=1, chunks=1, **over):
    """4 nodes of 8 H200s in 2 micro-clusters; 8 MoE layers of 16 experts, each after a
    dense layer; 8 sequences of 1,024 tokens per GPU; no paging."""
    d = {
        "model": {"hidden_size": 1024, "ffn_hidden_size": 2048, "num_layers": 8, "num_experts": 16, "dtype": "bf16"},
        "cluster": {"profile": "h200", "gpus_per_node": 8, "nodes_per_microcluster": 2, "microclusters": 2},
        "parallelism": {"ep_size": 8, "pp_size": pp, "pp_chunks": chunks},
        "pager": {"enabled": False},
        "transformer": {"enabled": True, "num_heads": 8, "seq_len": 1024, "vocab_size": 32000, "moe_every": 2,
                        "micro_batches": micro},
        "workload": {"tokens_per_rank": 8192},
        "run": {"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path)},
    }
    for name, values in over.items():
        d.setdefault(name, {}).update(values)
    return Scenario.from_dict(d)


def test_a_stage_is_its_share_of_the_cluster_and_the_model(tmp_path):
    st = stage_scenario(scenario(tmp_path, pp=2, micro=4))
    assert (st.world_size, st.cluster.microclusters, st.model.num_layers) == (16, 1, 4)
    assert st.workload.tokens_per_rank == 2048 and st.parallelism.pp_size == 1 and st.transformer.micro_batches == 1


def test_boundary_sends_cross_the_spine(tmp_path):
    """Stage 0 is micro-cluster 0, stage 1 micro-cluster 1: each of the 16 GPUs sends its
    2,048 tokens x 1,024 x 2 bytes (4 MiB) over its NIC and the spine, all at once; a
    non-blocking spine carries them at the NICs' rate: about 4 MiB / 50 GB/s."""
    s = scenario(tmp_path, pp=2, micro=4)
    seconds, nbytes = boundary_send_seconds(s, load_profile("h200"))
    assert nbytes == 2048 * 1024 * 2
    nic = load_profile("h200").links.nic.bandwidth_GBps * 1e9
    assert seconds.shape == (2,) and seconds[0] == pytest.approx(seconds[1])
    assert nbytes / nic < seconds[0] < 1.5 * nbytes / nic + 20e-6
    oversubscribed = scenario(tmp_path, pp=2, micro=4, cluster={"leaf_spine_oversubscription": 4.0})
    slower, _ = boundary_send_seconds(oversubscribed, load_profile("h200"))
    assert slower[0] > 3 * seconds[0]  # the 16 flows share a quarter of the uplinks


def test_the_bubble_comes_from_the_schedule(tmp_path):
    """1F1B with p = 2: the step is the makespan of the stages' micro-batches plus the
    tail; with equal stages it would be (m + p - 1) (t_f + t_b); here stage 0 lacks the
    head, so the larger of the two bubbles is at least the closed form's (p-1)/(m+p-1),
    and more micro-batches shrink it."""
    four = run_scenario(scenario(tmp_path, pp=2, micro=4), "sim")
    eight = run_scenario(scenario(tmp_path, pp=2, micro=8), "sim")
    p4, p8 = four["pipeline"], eight["pipeline"]
    assert p4["bubble_fraction"] >= 1 / 5 - 1e-9 and p8["bubble_fraction"] >= 1 / 9 - 1e-9
    assert p8["bubble_fraction"] < p4["bubble_fraction"]
    f, b = p4["micro_batch_forward_s"], p4["micro_batch_backward_s"]
    assert p4["makespan_s"] >= 4 * (f + b)  # the last stage's own work, at least
    assert four["step_time_s"] == pytest.approx(p4["makespan_s"] + p4["tail_s"], rel=0.02)  # the median of one step
    assert p4["in_flight"] == [2, 1]  # 1F1B: stage s holds p - s micro-batches


def test_interleaving_shrinks_the_bubble_and_holds_more(tmp_path):
    plain = run_scenario(scenario(tmp_path, pp=2, micro=8), "sim")
    inter = run_scenario(scenario(tmp_path, pp=2, micro=8, chunks=2), "sim")
    assert inter["pipeline"]["bubble_fraction"] < plain["pipeline"]["bubble_fraction"]
    assert inter["pipeline"]["in_flight"][0] > plain["pipeline"]["in_flight"][0]
    assert inter["memory_breakdown_bytes"]["activations"] > plain["memory_breakdown_bytes"]["activations"]


@pytest.mark.slow
def test_micro_batches_without_pipeline_accumulate(tmp_path):
    """p = 1, m = 4: four micro-batches back to back, no bubble, a quarter of the
    activations held; the byte counts of the token exchange stay those of the whole
    batch (4 x a quarter), the gradient sync's those of one step."""
    whole = run_scenario(scenario(tmp_path), "sim")
    accum = run_scenario(scenario(tmp_path, micro=4), "sim")
    assert accum["pipeline"]["bubble_fraction"] == pytest.approx(0.0, abs=1e-12)
    assert accum["bytes_by_stage"]["dense_sync"] == whole["bytes_by_stage"]["dense_sync"]
    assert accum["bytes_by_stage"]["dispatch"] == pytest.approx(whole["bytes_by_stage"]["dispatch"], rel=0.05)
    assert accum["memory_breakdown_bytes"]["activations"] < 0.3 * whole["memory_breakdown_bytes"]["activations"]
    assert accum["model_flops_per_step"] == whole["model_flops_per_step"]


@pytest.mark.parametrize("over, field", [
    ({"parallelism": {"pp_size": 3}}, "parallelism.pp_size"),
    ({"parallelism": {"pp_size": 2, "pp_chunks": 2}, "transformer": {"micro_batches": 3}}, "transformer.micro_batches"),
    ({"parallelism": {"pp_size": 2, "pp_chunks": 3}}, "model.num_layers"),
    ({"parallelism": {"pp_size": 2}, "pager": {"enabled": True}}, "pager.enabled"),
    ({"parallelism": {"pp_size": 2}, "transformer": {"enabled": False}}, "parallelism.pp_size"),
])
def test_bad_pipelines_are_refused(tmp_path, over, field):
    with pytest.raises(ScenarioError) as err:
        scenario(tmp_path, **over)
    assert field in str(err.value)


def test_the_summary_shows_the_pipeline_and_no_stage_counters(tmp_path):
    """The network counters saw one stage's micro-batch: a pipelined run reports none."""
    from testbed.cli.main import format_summary

    out = run_scenario(scenario(tmp_path, pp=2, micro=4), "sim")
    text = format_summary(out)
    assert "pipeline   2 stages x 1 chunks, 4 micro-batches" in text and "per GPU a step" in text
    assert out["wire_bytes_by_level"] is None and not out["utilization_by_level"]
    assert out["pipeline"]["send_bytes_per_gpu"] == 2 * 4 * (2048 * 1024 * 2) / 2  # 4 each way per boundary
