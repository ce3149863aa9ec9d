"""The layout space a plan searches (``testbed.study.layout_space``), against hand counts."""

from __future__ import annotations

import pytest

from testbed.core.errors import ScenarioError
from testbed.scenario.scenario import Scenario
from testbed.study.layout_space import default_knobs, enumerate_layouts, layout_scenario

KNOBS = {"parallelism.tp_size": [1, 2], "parallelism.pp_size": [1, 2], "parallelism.ep_size": [1, 2, 4]}


def base(**changes) -> Scenario:
    """4 GPUs as 2 nodes of 2; 4 layers of 4 experts, 4 heads; a global batch of 8 sequences."""
    d = {"model": {"hidden_size": 64, "ffn_hidden_size": 128, "num_layers": 4, "num_experts": 4, "top_k": 2},
         "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
         "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 4, "seq_len": 128, "vocab_size": 100},
         "workload": {"global_batch": 8, "micro_batch_size": 1},
         "pager": {"enabled": False}, "comm": {"expert_sync": "allreduce"}}
    for key, value in changes.items():
        d[key] = {**d.get(key, {}), **value}
    return Scenario.from_dict(d)


def test_the_layouts_of_four_gpus_by_hand():
    """TP 1 or 2 (a node of 2), PP 1 or 2 (stages of whole nodes), EP 1, 2 or 4 (folded, ETP 1):
    Megatron-Core needs ETP x EP x PP to divide the 4 GPUs, which EP 4 with PP 2 does not.
    So 2 x (3 + 2) = 10 layouts, and the 2 others refused on parallelism.ep_size."""
    space = enumerate_layouts(base(), KNOBS)
    assert space.size == 12 and len(space.valid) == 10
    assert space.refused == {"parallelism.ep_size": 2}
    assert {"parallelism.tp_size": 2, "parallelism.pp_size": 2, "parallelism.ep_size": 4} not in space.valid


def test_each_layout_derives_its_own_batch():
    """The global batch's micro-batches follow the layout: DP = 4 / (tp x pp), 8 / DP of one
    sequence each; tokens a GPU a step = micro-batches x 128 / tp (a TP pair shares a sequence)."""
    for tp, pp, micro, tokens in ((1, 1, 2, 256), (2, 1, 4, 256), (1, 2, 4, 512), (2, 2, 8, 512)):
        s = layout_scenario(base(), {"parallelism.tp_size": tp, "parallelism.pp_size": pp})
        assert (s.transformer.micro_batches, s.workload.tokens_per_rank) == (micro, tokens)


def test_fixing_a_knob_pins_it_and_an_unknown_one_is_refused():
    space = enumerate_layouts(base(), KNOBS, fixed={"parallelism.pp_size": 2})
    assert len(space.valid) == 4 and all(p["parallelism.pp_size"] == 2 for p in space.valid)
    with pytest.raises(ScenarioError, match=r"^--fix = 'parallelism.vpp': not a knob"):
        enumerate_layouts(base(), KNOBS, fixed={"parallelism.vpp": 2})


def test_what_the_simulator_refuses_is_counted_by_its_field():
    """Expert TP 2 with the allgather dispatcher: the simulator's expert-TP check refuses the
    token strategy (testbed.policy.expert_tensor_parallel), so of ETP 1 or 2 x two strategies at
    TP 2, EP 2, PP 1 (no heat map: a slice's heat is not modelled) one is refused on
    comm.token_strategy; with the heat map on, both ETP 2 layouts on heat.enabled."""
    knobs = {"parallelism.etp_size": [1, 2], "comm.token_strategy": ["alltoall", "allgather"]}
    space = enumerate_layouts(base(parallelism={"tp_size": 2, "ep_size": 2}, heat={"enabled": False}), knobs)
    assert len(space.valid) == 3 and space.refused == {"comm.token_strategy": 1}
    assert enumerate_layouts(base(parallelism={"tp_size": 2, "ep_size": 2}), knobs).refused == {"heat.enabled": 2}


def test_the_default_knobs_of_a_cluster():
    knobs = default_knobs(base())
    assert knobs["parallelism.tp_size"] == [1, 2] and knobs["parallelism.pp_size"] == [1, 2]
    assert knobs["parallelism.ep_size"] == [1, 2, 4]


def test_the_plans_default_space_has_fp8_only_where_the_profile_has_its_ceiling():
    from testbed.study.layout_space import plan_knobs

    assert plan_knobs(base(cluster={"profile": "h100"}))["model.gemm_dtype"] == ["model", "fp8"]
    assert plan_knobs(base(cluster={"profile": "local-cpu"}))["model.gemm_dtype"] == ["model"]
