"""Megatron-Core's pipeline layout strings and its split without one (testbed.layout.pipeline_layout)."""

from __future__ import annotations

import pytest

from testbed.core.errors import ScenarioError
from testbed.layout.pipeline_layout import (
    LAYOUT_FIELD,
    LayoutItem,
    default_pipeline_layout,
    parse_pipeline_layout,
)

DSV3_H100 = "Et*3|(tt|)*29m|L"  # DeepSeek-V3 on 1,024 H100 (issue 25): TP 2, PP 8, VPP 4, 61 layers, 1 MTP


def test_deepseek_v3_on_1024_h100_pp8():
    lay = parse_pipeline_layout(DSV3_H100, 8, 61, 1)
    # "Et*3|" + 29 x "tt|" + "m|L": 1 + 29 + 2 = 32 stages over 8 ranks -> 4 virtual chunks each
    assert (len(lay.stages), lay.pp_size, lay.vpp_size) == (32, 8, 4)
    per = lay.layers_per_stage()
    assert per[0] == (3, 2, 2, 2)  # stage 0 (E ttt), then stages 8, 16, 24
    assert all(per[r] == (2, 2, 2, 2) for r in range(1, 6))
    assert per[6] == (2, 2, 2, 0) and per[7] == (2, 2, 2, 0)  # stages 30 (m) and 31 (L) hold no transformer layer
    assert [sum(row) for row in per] == [9, 8, 8, 8, 8, 8, 6, 6]
    assert sum(map(sum, per)) == 61
    assert lay.embedding_stage == (0, 0)
    assert lay.mtp_stage == (6, 3)  # stage 30: rank 30 % 8, chunk 30 // 8
    assert lay.loss_stage == (7, 3)
    assert lay.mtp_standalone  # MTP on rank 6, not the last one
    assert lay.items(0, 0) == (LayoutItem("embedding", 0),) + tuple(LayoutItem("decoder", i) for i in range(3))
    assert lay.items(6, 3) == (LayoutItem("mtp", 0),)
    assert lay.items(7, 3) == (LayoutItem("loss", 0),)
    # model-order stage k in 1..29 holds layers 2k+1, 2k+2 and runs on rank k % 8 as chunk k // 8
    for k in range(1, 30):
        assert lay.placement(k) == (k % 8, k // 8)
        assert lay.layer_ids(k % 8, k // 8) == (2 * k + 1, 2 * k + 2)
    assert lay.layer_ids(0, 1) == (17, 18) and lay.layer_ids(5, 3) == (59, 60)
    assert [lay.stage_index(*lay.placement(i)) for i in range(32)] == list(range(32))
    with pytest.raises(IndexError):
        lay.items(8, 0)


def test_deepseek_v3_pp16_matches_megatrons_pretty_print():
    # megatron_pp_layout.md: the same string on PP 16 is 32 stages, VPP 2; rank 0: embedding, decoder*3 | decoder*2,
    # ranks 1-13: decoder*2 | decoder*2, rank 14: decoder*2 | mtp, rank 15: decoder*2 | loss
    for text in (DSV3_H100, "Et*3|(tt|)*29,m|L", "Ettt|(tt|)*29,m|L"):
        lay = parse_pipeline_layout(text, 16, 61, 1)
        assert lay.vpp_size == 2
        assert [[it.kind for it in st] for st in lay.stages] == [["embedding"] + ["decoder"] * 3] + \
            [["decoder"] * 2] * 29 + [["mtp"], ["loss"]]
        assert lay.layers_per_stage() == ((3, 2),) + ((2, 2),) * 13 + ((2, 0), (2, 0))
        assert (lay.mtp_stage, lay.loss_stage) == ((14, 1), (15, 1))


def test_help_text_example_parses_but_its_mtp_placement_is_refused():
    # Megatron's --pipeline-model-parallel-layout help: "E|(t|)*3,m|m||L" is E | t | t | t | m | m | (empty) | L.
    # Its own validate_layer_layout refuses it for 2 MTP layers: with PP 2 the m stages 4 and 5 are chunk 2 of 4.
    with pytest.raises(ScenarioError, match="last virtual chunk"):
        parse_pipeline_layout("E|(t|)*3,m|m||L", 2, 3, 2)
    with pytest.raises(ScenarioError, match=r"all be in one stage, found in stages \[4, 5\]"):
        parse_pipeline_layout("E|(t|)*3,m|m||L", 4, 3, 2)  # VPP 2: both in the last chunk, but two stages
    lay = parse_pipeline_layout("E|(t|)*3,mm||L", 7, 3, 2)  # one m stage: 7 stages, VPP 1
    assert [len(st) for st in lay.stages] == [1, 1, 1, 1, 2, 0, 1]
    assert lay.mtp_stage == (4, 0) and lay.layer_ids(4, 0, "mtp") == (0, 1)


@pytest.mark.parametrize("text, stages", [
    ("(t|t)*0EL", ["EL"]),  # a group repeated 0 times vanishes
    ("E(t|)*2L", ["Et", "t", "L"]),
    ("E|t*3,|L", ["E", "ttt", "L"]),
    ("E|(|t)*2|L", ["E", "", "t", "t", "L"]),  # the bracketed text is repeated as it is, | included
    ("Et|*2L", ["Et", "", "L"]),  # x*n repeats any one character, | too
])
def test_repeats_are_textual(text, stages):
    n_t = sum(s.count("t") for s in stages)
    lay = parse_pipeline_layout(text, len(stages), n_t)
    chars = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    assert ["".join(chars[it.kind] for it in st) for st in lay.stages] == stages


@pytest.mark.parametrize("text, pp, layers, mtp, match", [
    (61, 8, 61, 1, "must be a string"),
    ("Et x|L", 2, 1, 0, "unknown character"),
    ("Eencoder|L", 2, 0, 0, "unknown character"),
    ("E((t|)*2)*2|L", 2, 4, 0, "parentheses"),
    ("E(t|L", 2, 1, 0, "parentheses"),
    ("E()*3|L", 2, 0, 0, "parentheses"),
    ("E(t|)L", 2, 1, 0, "parentheses"),
    ("Et*|L", 2, 1, 0, r"a \* must"),
    ("E|t**2|L", 3, 2, 0, r"a \* must"),
    ("Et*999999999|L", 2, 999999999, 0, "expands to more than"),
    ("E(tt|)*999999|L", 2, 1999998, 0, "expands to more than"),
    (DSV3_H100, 3, 61, 1, "32 stages are not a multiple of parallelism.pp_size = 3"),
    (DSV3_H100, 0, 61, 1, "positive integer"),
    ("", 1, 0, 0, "first item must be E"),
    ("t|EL", 2, 1, 0, "first item must be E"),
    ("Et|tL|m", 3, 2, 1, "last item must be L"),
    ("Et|EL", 2, 1, 0, "once each, got 2 E and 1 L"),
    ("EL|tL", 2, 1, 0, "once each, got 1 E and 2 L"),
    (DSV3_H100, 8, 60, 1, "61 transformer layers"),
    (DSV3_H100, 8, 61, 0, "1 MTP layers"),
    ("Et|mt|L", 3, 2, 1, "before the MTP layers"),
    ("Et|m||L", 2, 1, 1, "last virtual chunk"),  # stage 1 = chunk 0 of rank 1
    ("Et|tm|m|L", 2, 2, 2, "last virtual chunk"),
    ("Et|t|m|mL", 2, 2, 2, r"found in stages \[2, 3\]"),
])
def test_every_layout_error_is_one_line_naming_the_field(text, pp, layers, mtp, match):
    with pytest.raises(ScenarioError, match=match) as e:
        parse_pipeline_layout(text, pp, layers, mtp)
    assert "\n" not in str(e.value)
    assert e.value.field == ("parallelism.pp_size" if pp < 1 else LAYOUT_FIELD)


def test_megatrons_even_interleaved_split():
    # Megatron's get_num_layers_to_build comment: 8 layers, 2 stages, 4 chunks: stage 0 [0] [2] [4] [6],
    # stage 1 [1] [3] [5] [7]; with 2 chunks: stage 0 [0, 1] [4, 5], stage 1 [2, 3] [6, 7]
    four = default_pipeline_layout(8, 2, 4)
    assert [four.layer_ids(0, c) for c in range(4)] == [(0,), (2,), (4,), (6,)]
    assert [four.layer_ids(1, c) for c in range(4)] == [(1,), (3,), (5,), (7,)]
    two = default_pipeline_layout(8, 2, 2)
    assert [two.layer_ids(0, c) for c in range(2)] == [(0, 1), (4, 5)]
    assert [two.layer_ids(1, c) for c in range(2)] == [(2, 3), (6, 7)]
    # the embedding on the first stage only, the head (and MTP) on the last only
    assert (four.embedding_stage, four.loss_stage) == ((0, 0), (1, 3))
    assert sum(it.kind == "embedding" for st in four.stages for it in st) == 1


def test_default_places_mtp_before_the_loss_on_the_last_stage():
    lay = default_pipeline_layout(16, 4, 2, mtp_layers=1)
    assert lay.mtp_stage == lay.loss_stage == (3, 1)
    assert not lay.mtp_standalone
    assert [it.kind for it in lay.items(3, 1)] == ["decoder", "decoder", "mtp", "loss"]
    assert lay.layer_ids(3, 1) == (14, 15)


def test_uneven_first_and_last_stages_as_megatron_offsets_them():
    # 14 layers, PP 4, VPP 2, first 2, last 4: the two middle ranks share 8 (4 each), every rank 1/2 per chunk.
    # get_transformer_layer_offset: a round of chunks is 2/2 + 8/2 + 4/2 = 7 layers; rank r > 0 of chunk c starts at
    # 7c + 1 + (r - 1) * 2.
    lay = default_pipeline_layout(14, 4, 2, first_stage_layers=2, last_stage_layers=4)
    assert lay.layers_per_stage() == ((1, 1), (2, 2), (2, 2), (2, 2))
    for c in range(2):
        assert lay.layer_ids(0, c) == (7 * c,)
        for r in range(1, 4):
            start = 7 * c + 1 + (r - 1) * 2
            assert lay.layer_ids(r, c) == (start, start + 1)
    # one end only: DeepSeek-like 61 layers over PP 8 with 5 on the first, 8 on each of the other seven
    lay = default_pipeline_layout(61, 8, first_stage_layers=5)
    assert [row[0] for row in lay.layers_per_stage()] == [5] + [8] * 7
    assert lay.layer_ids(1, 0) == tuple(range(5, 13)) and lay.layer_ids(7, 0) == tuple(range(53, 61))
    # PP 2 with both ends given: no middle rank
    assert default_pipeline_layout(6, 2, first_stage_layers=2, last_stage_layers=4).layers_per_stage() == ((2,), (4,))


@pytest.mark.parametrize("kwargs, field, match", [
    ({"num_layers": 61, "pp_size": 8}, "parallelism.pp_size", r"61 transformer layers do not split evenly over 8"),
    ({"num_layers": 16, "pp_size": 4, "vpp_size": 3}, "parallelism.pp_size", "over 4 rank"),
    ({"num_layers": 14, "pp_size": 4, "first_stage_layers": 3}, "parallelism.pp_size", r"the 11 layers left after"),
    ({"num_layers": 4, "pp_size": 4, "first_stage_layers": 6}, "parallelism.pp_size", "the -2 layers left"),
    ({"num_layers": 8, "pp_size": 2, "vpp_size": 2, "first_stage_layers": 3},
     "parallelism.decoder_first_pipeline_num_layers", "multiple of parallelism.pp_chunks = 2"),
    ({"num_layers": 8, "pp_size": 2, "last_stage_layers": -1}, "parallelism.decoder_last_pipeline_num_layers",
     "whole number"),
    ({"num_layers": 8, "pp_size": 2, "first_stage_layers": 3, "last_stage_layers": 4},
     "parallelism.decoder_last_pipeline_num_layers", "with no middle stage"),
    ({"num_layers": 8, "pp_size": 1, "first_stage_layers": 8}, "parallelism.decoder_first_pipeline_num_layers",
     "pp_size > 1"),
    ({"num_layers": 8, "pp_size": 1, "last_stage_layers": 8}, "parallelism.decoder_last_pipeline_num_layers",
     "pp_size > 1"),
    ({"num_layers": 8, "pp_size": 1, "vpp_size": 2}, "parallelism.pp_chunks", "pp_size > 1"),
    ({"num_layers": 8, "pp_size": 2, "vpp_size": 0}, "parallelism.pp_chunks", "positive integer"),
])
def test_default_layout_errors(kwargs, field, match):
    with pytest.raises(ScenarioError, match=match) as e:
        default_pipeline_layout(**kwargs)
    assert e.value.field == field and "\n" not in str(e.value)


def test_layer_counts_are_the_callers_and_must_be_whole():
    with pytest.raises(ValueError, match="num_layers"):
        parse_pipeline_layout("EL", 1, -1)
    with pytest.raises(ValueError, match="mtp_layers"):
        default_pipeline_layout(8, 2, mtp_layers=1.5)
