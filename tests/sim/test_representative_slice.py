"""The fast evaluation of a layout (``sim.representative_slice``, issue 27 item 2): a slice of
the GPUs stands for the whole scenario within 2% of its step time where its conditions hold,
and the full simulation runs, saying why, where they do not."""

import json

import numpy as np
import pytest

from sim.backend import ClusterSim, SimBackend
from sim.step.representative_slice import slice_gpus, slice_refusal, slice_scenario
from testbed.layout.process_groups import build_process_groups
from testbed.policy.scored_routing import ScoredRouting
from testbed.policy.workload import SyntheticWorkload
from testbed.scenario.file import load_scenario
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

AGREEMENT = 0.02  # issue 27: within 2% of the full simulation's step time

# the published configs whose simulated stages the slice stands for (the others' stages run the
# flow model, or are one slice: deepseek-v3's, whose representative routing is timed in a minute
# by benchmarks/plan_speed.py --full); each takes about a second either way
PUBLISHED_SLICED = ["configs/published/mixtral-8x22b-1024-h100-mcore-gbs1024.toml",
                    "configs/published/megascale-352b-1440-h800-megascale.toml",
                    "configs/published/megascale-352b-1440-h800-megatron.toml"]


def small(**sections) -> Scenario:
    """32 GPUs, 2 a node, 8 nodes a rail-optimised micro-cluster: EP groups of 4 over 2 nodes
    (cross-rail traffic crosses the spine), 8 blocks, 2 slices of 8 GPUs under each leaf."""
    data = {
        "model": {"hidden_size": 256, "ffn_hidden_size": 512, "num_layers": 4, "num_experts": 8, "top_k": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 8, "microclusters": 2, "rail_optimized": True,
                    "profile": "h100"},
        "parallelism": {"ep_size": 4},
        "workload": {"tokens_per_rank": 4096, "skew": 0.5, "locality": 0.0},
        "pager": {"enabled": False}, "heat": {"enabled": False},
        "sim": {"network_model": "analytic"},
        "run": {"steps": 3, "warmup_steps": 1},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return Scenario.from_dict(data)


def step_time(s: Scenario, on: bool):
    r = SimBackend().run(s.replace(sim={"representative_slice": on}))
    return float(np.median([x.step_time_s for x in r.records[s.run.warmup_steps:]])), r


@pytest.mark.parametrize("sections", [
    {},
    {"comm": {"expert_sync": "allreduce"}, "parallelism": {"ep_size": 2}},  # blocks of one node, 4 slices a leaf
    # the sync over an oversubscribed spine, each slice's all-to-alls inside its leaf
    {"cluster": {"leaf_spine_oversubscription": 4.0, "rail_optimized": False}},
])
def test_slice_agrees_with_full_on_a_small_multi_group_layout(sections):
    s = small(**sections)
    assert slice_refusal(s) is None
    full, _ = step_time(s, False)
    part, r = step_time(s, True)
    note = r.extra["representative_slice"]
    assert note["used"] and note["gpus"] == slice_gpus(s) < s.world_size
    assert abs(part / full - 1) <= AGREEMENT


def test_slice_bytes_are_the_whole_clusters():
    """The slice's byte totals scaled to every GPU: the token stages' exactly as the full
    simulation counts them (each rank moves the same law's tokens), within 2% in all."""
    s = small()
    _, a = step_time(s, False)
    _, b = step_time(s, True)
    fa, fb = a.records[-1], b.records[-1]
    assert fb.routed_slots == fa.routed_slots
    total_a, total_b = sum(fa.bytes_by_stage.values()), sum(fb.bytes_by_stage.values())
    assert abs(total_b / total_a - 1) <= AGREEMENT


@pytest.mark.parametrize("path", PUBLISHED_SLICED)
def test_slice_agrees_with_full_on_published_configs(path):
    s = load_scenario(path, ["run.steps=2", "run.warmup_steps=1"])
    full, a = step_time(s, False)
    part, b = step_time(s, True)
    assert b.extra["representative_slice"]["used"]
    assert abs(part / full - 1) <= AGREEMENT
    # the fullest GPU's memory too (the sync's buffers sized by the slice's groups: module doc)
    assert abs(b.records[-1].peak_memory_bytes / a.records[-1].peak_memory_bytes - 1) <= AGREEMENT


@pytest.mark.parametrize("sections, why", [
    ({"pager": {"enabled": True, "page_size_bytes": "64KiB", "gpu_budget_bytes": "4MiB"}}, "paging"),
    ({"workload": {"locality": 0.5}}, "locality"),
    ({"parallelism": {"placement": "strided"}}, "placement"),
    ({"sim": {"network_model": "flow"}}, "flow network model"),
    ({"cluster": {"microclusters": 1, "nodes_per_microcluster": 4}}, "slices"),
    ({"cluster": {"leaf_spine_oversubscription": 4.0}}, "oversubscribed spine"),
])
def test_full_simulation_where_the_conditions_do_not_hold(sections, why):
    s = small(**sections).replace(run={"steps": 2})
    full = SimBackend().run(s)
    other = SimBackend().run(s.replace(sim={"representative_slice": True}))
    note = other.extra["representative_slice"]
    assert not note["used"] and why in note["reason"]
    assert [x.step_time_s for x in other.records] == [x.step_time_s for x in full.records]


def test_same_scenario_and_seed_give_identical_slices():
    s = small().replace(sim={"representative_slice": True})
    a = [r.to_dict() for r in SimBackend().run(s).records]
    b = [r.to_dict() for r in SimBackend().run(s).records]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_sync_ops_are_timed_over_the_whole_groups():
    """A slice's DP and expert-DP groups stand for the whole scenario's groups of their ranks."""
    s = small(parallelism={"ep_size": 4, "tp_size": 1})
    n = slice_gpus(s)
    sim = ClusterSim(slice_scenario(s), load_profile(s.cluster.profile), slice_of=s)
    assert (sim.timer.gpus, sim.timer.slices) == (n, s.world_size // n)
    whole = build_process_groups(s.world_size, 1, 1, 1, 4, 1, "folded")
    part = build_process_groups(n, 1, 1, 1, 4, 1, "folded")
    for r in range(n):
        assert sim.timer.whole_members(part.of(r).edp) == whole.of(r).edp
        assert sim.timer.whole_members(part.of(r).dp) == whole.of(r).dp
    assert sim.timer.whole_members(tuple(range(n))) == tuple(range(s.world_size))  # M10's world all-gather


def test_slice_scenario_keeps_the_per_gpu_work():
    s = small(parallelism={"ep_size": 4, "tp_size": 2}, transformer={"enabled": True, "seq_len": 1024})
    part = slice_scenario(s)
    assert part.world_size == 8  # two blocks of lcm(TP 2, EP 4, 2 GPUs a node) = 4 GPUs
    assert part.workload.tokens_per_rank == s.workload.tokens_per_rank
    assert (part.parallelism.tp_size, part.parallelism.ep_size) == (2, 4)


def scored(**sections) -> Scenario:
    sections.setdefault("workload", {}).setdefault("skew", 0.0)
    return small(router={"expert_groups": 4, "groups_per_token": 2, "score": "sigmoid", "bias_update_rate": 1e-3},
                 model={"num_experts": 16, "top_k": 4}, **sections)


def test_representative_routing_is_one_block_of_one_layer():
    s = scored(sim={"representative_slice": True})
    counts = SyntheticWorkload(s).routed_counts(1)
    block = s.parallelism.ep_size
    unit = s.model.num_experts // s.router.expert_groups
    for layer in range(s.model.num_layers):  # every layer layer 0's, its experts moved by whole groups
        assert (counts[layer] == np.roll(counts[0], layer % s.router.expert_groups * unit, axis=1)).all()
    assert (counts == np.tile(counts[:, :block], (1, s.world_size // block, 1))).all()  # every block block 0's
    assert (counts.sum(axis=2) == s.workload.tokens_per_rank * s.model.top_k).all()
    full = SyntheticWorkload(s.replace(sim={"representative_slice": False})).routed_counts(1)
    # the same law: every expert's share of the block's slots within 5% of the full routing's
    # (4 ranks x 4,096 tokens x 4 of 16 experts: 4,096 slots an expert, a standard deviation of 1.5%)
    share = counts[0].sum(0) / counts[0].sum()
    assert np.abs(share / (full.sum((0, 1)) / full.sum()) - 1).max() < 0.05


def test_representative_routing_needs_one_law():
    s = scored(sim={"representative_slice": True}, workload={"skew": 1.0})
    counts = ScoredRouting(s, SyntheticWorkload(s).routing_popularity).routed_counts(0)
    assert not (counts == counts[:1]).all()  # layers with their own popularity: routed one by one
    assert (counts[:, :4] != counts[:, 4:8]).any()  # and every rank


def test_the_run_says_how_it_was_evaluated():
    r = SimBackend().run(scored(sim={"representative_slice": True}, run={"steps": 1, "warmup_steps": 0}))
    note = r.extra["representative_slice"]
    assert note["used"] and note["slices"] == 4
    assert note["routing"].startswith("one layer of one block of 4 GPUs")
