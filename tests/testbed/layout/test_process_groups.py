"""Megatron-Core's process groups (testbed/layout/process_groups.py) against the worked
examples of /work/notes/research/megatron_groups.md, whose group lists were produced by
exec'ing Megatron-LM's RankGenerator (parallel_state.py at d98e8a64 and, before folding,
bbaa03a0), and the published layouts of issue 25."""

from __future__ import annotations

import pytest

from testbed.core.errors import ScenarioError
from testbed.layout.process_groups import (
    GROUP_KINDS,
    build_process_groups,
    describe_groups,
    groups_of_kind,
    orthogonal_groups,
)


def kinds(groups, *names):
    return {name: [list(g) for g in groups_of_kind(groups, name)] for name in names}


SINGLETONS_16 = [[r] for r in range(16)]


def test_orthogonal_groups_match_megatrons_docstring_examples():
    # generate_masked_orthogonal_rank_groups' docstring: sizes [tp 2, dp 3, pp 4], the dp groups
    dp = orthogonal_groups((("tp", 2), ("dp", 3), ("pp", 4)), ("dp",))
    assert len(dp) == 8
    assert dp[0] == (0, 2, 4) and dp[1] == (1, 3, 5) and dp[7] == (19, 21, 23)
    # ... and 8 GPUs in the order tp-pp-dp, sizes 2-2-2: dp groups [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert orthogonal_groups((("tp", 2), ("pp", 2), ("dp", 2)), ("dp",)) == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_world_16_tp2_pp2_ep4_etp1_folded():
    g = build_process_groups(16, tp=2, pp=2, ep=4, etp=1, moe_layout="folded")
    assert (g.dp, g.edp) == (4, 2)
    assert kinds(g, "tp", "dp", "dp_cp", "pp", "ep", "etp", "tp_ep", "edp") == {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
        # EP folds the attention's TP pair {0, 1} and its DP peers {0, 2}
        "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "etp": SINGLETONS_16,
        "tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    }
    assert kinds(g, "embedding")["embedding"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]


def test_world_16_default_etp_is_tp_and_equals_the_nested_layout():
    folded = build_process_groups(16, tp=2, pp=2, ep=4)  # etp None: Megatron's ETP = TP
    assert (folded.etp, folded.dp, folded.edp) == (2, 4, 1)
    assert kinds(folded, "etp", "ep", "edp") == {
        "etp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        "ep": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "edp": SINGLETONS_16,
    }
    nested = build_process_groups(16, tp=2, pp=2, ep=4, moe_layout="nested")
    assert (nested.dp, nested.edp) == (4, 1)
    assert kinds(nested, "ep", "edp", "tp_ep") == {
        "ep": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "edp": SINGLETONS_16,
        "tp_ep": [list(range(8)), list(range(8, 16))],
    }
    for kind in GROUP_KINDS:
        assert groups_of_kind(nested, kind) == groups_of_kind(folded, kind), kind


def test_world_16_nested_ep2_carves_ep_out_of_dp():
    g = build_process_groups(16, tp=2, pp=2, ep=2, moe_layout="nested")
    # the notes list the first groups; the rest continue the pattern (checked against the exec'd code)
    assert kinds(g, "ep", "edp") == {
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    }
    assert g.edp == 2


def test_world_16_with_cp2_and_ep8_folded():
    g = build_process_groups(16, tp=2, cp=2, pp=2, ep=8, etp=1)
    assert (g.dp, g.edp) == (2, 1)
    assert kinds(g, "cp", "dp", "dp_cp", "ep", "edp") == {
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        "ep": [list(range(8)), list(range(8, 16))],  # EP folds over TP x CP x DP
        "edp": SINGLETONS_16,
    }


def test_nested_with_cp_sums_expert_gradients_over_cp_too():
    # bbaa03a: expert gradients over data-modulo-expert WITH context parallel, CP x DP/EP ranks
    g = build_process_groups(16, tp=2, cp=2, pp=2, ep=2, moe_layout="nested")
    assert (g.dp, g.edp) == (2, 2)
    assert kinds(g, "ep", "edp") == {
        "ep": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    }


@pytest.mark.parametrize("moe_layout", ["folded", "nested"])
def test_deepseek_v3_on_2048_gpus_ep64_spans_8_nodes(moe_layout):
    # DeepSeek-V3 (arXiv 2412.19437 section 3.1): PP 16, EP 64 over 8 nodes, DP 128, no TP
    g = build_process_groups(2048, tp=1, pp=16, ep=64, moe_layout=moe_layout)
    assert (g.dp, g.edp) == (128, 2)
    ep = groups_of_kind(g, "ep")
    assert ep == tuple(tuple(range(64 * k, 64 * k + 64)) for k in range(32))
    assert all(sorted({r // 8 for r in group}) == list(range(group[0] // 8, group[0] // 8 + 8)) for group in ep)
    assert g.of(70).pp == tuple(range(70, 2048, 128))
    assert g.of(70).edp == (6, 70)
    assert g.of(70).dp == tuple(range(128))
    assert g.of(70).embedding == (70, 1990)
    assert g.of(200).embedding == ()  # stage 1 of 16 holds neither embedding nor head


def test_mixtral_8x22b_on_128_gpus_with_and_without_folding():
    # MoE parallel folding (arXiv 2504.14960): TP 2, EP 8, PP 8, ETP 1 folded
    folded = build_process_groups(128, tp=2, pp=8, ep=8, etp=1)
    assert (folded.dp, folded.edp) == (8, 2)
    assert folded.of(0).ep == tuple(range(8))  # four attention TP pairs
    assert folded.of(0).edp == (0, 8)
    # Megatron-Core without folding: TP 2, EP 4, PP 8 (expert TP = TP)
    nested = build_process_groups(128, tp=2, pp=8, ep=4, moe_layout="nested")
    assert (nested.dp, nested.edp) == (8, 2)
    assert nested.of(0).ep == (0, 2, 4, 6)
    assert nested.of(0).etp == (0, 1)
    assert nested.of(0).edp == (0, 8)


LAYOUTS = [
    dict(world=16, tp=2, pp=2, ep=4, etp=1),
    dict(world=16, tp=2, pp=2, ep=2, moe_layout="nested"),
    dict(world=16, tp=2, cp=2, pp=2, ep=8, etp=1),
    dict(world=16, tp=2, cp=2, pp=2, ep=2, moe_layout="nested"),
    dict(world=24, tp=2, cp=1, pp=3, ep=2, etp=2),
    dict(world=32, tp=4, cp=2, pp=1, ep=4, etp=2),
    dict(world=128, tp=2, pp=8, ep=8, etp=1),
    dict(world=2048, tp=1, pp=16, ep=64),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_kind_partitions_the_world(layout):
    g = build_process_groups(**layout)
    sizes = {"tp": g.tp, "cp": g.cp, "dp": g.dp, "dp_cp": g.dp * g.cp, "pp": g.pp, "ep": g.ep,
             "etp": g.etp, "edp": g.edp, "tp_ep": g.etp * g.ep}
    for kind, size in sizes.items():
        groups = groups_of_kind(g, kind)
        members = [r for group in groups for r in group]
        assert sorted(members) == list(range(g.world)), kind  # disjoint and covering
        assert {len(group) for group in groups} == {size}, kind
        for r in range(g.world):
            assert r in g.of(r).of_kind(kind), (kind, r)
    for group in groups_of_kind(g, "embedding"):
        pp = g.of(group[0]).pp
        assert group == tuple(dict.fromkeys((pp[0], pp[-1])))


@pytest.mark.parametrize("kwargs, field, words", [
    (dict(world=12, tp=2, pp=4), "parallelism.pp_size", ["tp_size = 2", "tp x cp x pp = 8", "12 GPUs"]),
    (dict(world=16, tp=2, pp=2, ep=8, etp=2), "parallelism.ep_size", ["etp_size = 2", "32", "16 GPUs"]),
    (dict(world=16, tp=2, pp=2, ep=8, moe_layout="nested"), "parallelism.ep_size", ["nested", "DP", "= 4"]),
    (dict(world=16, tp=2, pp=2, ep=4, etp=1, moe_layout="nested"), "parallelism.etp_size", ["tp_size = 2"]),
    (dict(world=16, moe_layout="mixed"), "parallelism.moe_layout", ["folded", "nested"]),
    (dict(world=16, tp=0), "parallelism.tp_size", ["positive"]),
    (dict(world=16, cp=-2), "parallelism.cp_size", ["positive"]),
    (dict(world=16, etp=0), "parallelism.etp_size", ["positive"]),
    (dict(world=0), "cluster.gpus", ["positive"]),
])
def test_invalid_layouts_name_the_fields(kwargs, field, words):
    with pytest.raises(ScenarioError) as e:
        build_process_groups(**kwargs)
    assert e.value.field == field
    for word in words:
        assert word in str(e.value)


def test_describe_groups_lists_every_kind_of_a_rank():
    g = build_process_groups(16, tp=2, pp=2, ep=4, etp=1)
    assert describe_groups(g, 5) == ("rank 5: tp [4,5] cp [5] dp [1,3,5,7] dp_cp [1,3,5,7] pp [5,13] "
                                     "ep [4,5,6,7] etp [5] edp [1,5] tp_ep [4,5,6,7] embedding [5,13]")
    v3 = build_process_groups(2048, tp=1, pp=16, ep=64)
    assert describe_groups(v3, 200) == ("rank 200: tp [200] cp [200] dp [128..255] dp_cp [128..255] "
                                        "pp [72,200..1992] ep [192..255] etp [200] edp [136,200] "
                                        "tp_ep [192..255] embedding -")
