"""The batch as Megatron-Core defines it, resolved when a scenario is built (issue 25,
item 1; ``testbed.scenario.scenario.resolve_batch``): ``workload.global_batch`` and
``micro_batch_size`` give ``workload.tokens_per_rank`` and ``transformer.micro_batches``,
worked out by hand here; a derived field stated otherwise is refused naming both; a copy
derives them again. A tensor-parallel group with sequence parallelism shares its
micro-batch's sequences (each GPU may hold part of one); without sequence parallelism the
old rule (each GPU whole sequences) stays, with its old messages."""

import pytest

from testbed.cli.main import main as cli_main
from testbed.core.errors import ScenarioError
from testbed.policy.pipeline_stages import stage_scenario
from testbed.run.features import check_features
from testbed.scenario.scenario import Scenario

#: 16 GPUs (2 nodes of 8), TP 2 x PP 2 (a node a stage): DP = 16 / (2 x 2) = 4
BASE = {
    "model": {"num_layers": 4},
    "cluster": {"gpus_per_node": 8, "nodes_per_microcluster": 2, "microclusters": 1},
    "parallelism": {"ep_size": 4, "tp_size": 2, "pp_size": 2},
    "transformer": {"enabled": True, "seq_len": 64},
    "pager": {"enabled": False},
}


def build(**changes) -> Scenario:
    data = {k: dict(v) for k, v in BASE.items()}
    for section, fields in changes.items():
        data.setdefault(section, {}).update(fields)
    return Scenario.from_dict(data)


def test_global_batch_gives_tokens_per_rank_and_micro_batches_by_hand():
    """32 sequences of 64 in micro-batches of 2 on DP 4: 32 / (4 x 2) = 4 micro-batches a
    step; each GPU routes its sequence-parallel share, 2 x 64 / 2 = 64 tokens, of each:
    256 a step."""
    s = build(workload={"global_batch": 32, "micro_batch_size": 2})
    assert (s.workload.tokens_per_rank, s.transformer.micro_batches) == (256, 4)
    # the resolved scenario states them, consistently: it builds again to the same
    assert Scenario.from_dict(s.to_dict()) == s
    # micro-batches of 1: 8 of them, 32 tokens each
    s1 = build(workload={"global_batch": 32})
    assert (s1.workload.tokens_per_rank, s1.transformer.micro_batches) == (256, 8)


def test_both_backends_take_the_global_batch():
    s = build(workload={"global_batch": 32, "micro_batch_size": 2})
    for backend in ("sim", "real"):
        check_features(s, backend)  # what it derives is what both have always run


def test_stated_derived_fields_must_agree_and_are_named_with_the_batch():
    assert build(workload={"global_batch": 32, "micro_batch_size": 2, "tokens_per_rank": 256},
                 transformer={"micro_batches": 4}).workload.tokens_per_rank == 256
    for changes, field, given in (({"workload": {"tokens_per_rank": 128}}, "workload.tokens_per_rank", 128),
                                  ({"transformer": {"micro_batches": 2}}, "transformer.micro_batches", 2)):
        workload = {"global_batch": 32, "micro_batch_size": 2, **changes.get("workload", {})}
        with pytest.raises(ScenarioError) as err:
            build(workload=workload, transformer=changes.get("transformer", {}))
        assert err.value.field == field and err.value.value == given
        assert "workload.global_batch = 32" in str(err.value)


@pytest.mark.parametrize("changes, field", [
    ({"transformer": {"enabled": False}, "parallelism": {"tp_size": 1, "pp_size": 1}}, "workload.global_batch"),
    ({"workload": {"global_batch": 0, "micro_batch_size": 2}}, "workload.micro_batch_size"),
    ({"workload": {"global_batch": 30}}, "workload.global_batch"),  # not a multiple of DP 4 x micro 2
    ({"parallelism": {"sequence_parallel": False}}, "parallelism.sequence_parallel"),
])
def test_what_megatron_refuses_names_the_field(changes, field):
    workload = {"global_batch": 32, "micro_batch_size": 2, **changes.pop("workload", {})}
    with pytest.raises(ScenarioError) as err:
        build(workload=workload, **changes)
    assert err.value.field == field


def test_a_copy_derives_them_again_unless_it_gives_its_own():
    s = build(workload={"global_batch": 32, "micro_batch_size": 2})
    # TP 1: DP 8, 32 / (8 x 2) = 2 micro-batches of 2 x 64 = 128 tokens on each GPU
    t1 = s.replace(parallelism={"tp_size": 1})
    assert (t1.workload.tokens_per_rank, t1.transformer.micro_batches) == (256, 2)
    mine = s.replace(workload={"tokens_per_rank": 512})
    assert (mine.workload.global_batch, mine.workload.tokens_per_rank, mine.transformer.micro_batches) == (0, 512, 4)
    # a pipeline stage is one micro-batch of per-GPU tokens (what both backends run)
    stage = stage_scenario(s)
    assert (stage.world_size, stage.workload.tokens_per_rank, stage.transformer.micro_batches) == (8, 64, 1)
    assert stage.workload.global_batch == 0


def test_a_tensor_parallel_group_shares_its_sequences_with_sequence_parallelism():
    """TP 2: each GPU may hold half a sequence (the group's 2 x 32 tokens are one); without
    sequence parallelism, or without TP, each GPU's tokens stay whole sequences, refused
    with the old messages."""
    one = {"parallelism": {"pp_size": 1}}
    assert build(workload={"tokens_per_rank": 32}, **one).workload.tokens_per_rank == 32
    with pytest.raises(ScenarioError, match="does not divide workload.tokens_per_rank = 32") as err:
        build(workload={"tokens_per_rank": 32}, parallelism={"pp_size": 1, "sequence_parallel": False})
    assert err.value.field == "transformer.seq_len"
    with pytest.raises(ScenarioError, match="does not divide the tensor-parallel group's tokens"):
        build(workload={"tokens_per_rank": 16}, **one)  # 2 x 16 is half a sequence
    with pytest.raises(ScenarioError, match="does not divide workload.tokens_per_rank = 32"):
        build(workload={"tokens_per_rank": 32}, parallelism={"pp_size": 1, "tp_size": 1})


def test_micro_batches_of_the_group_are_whole_sequences():
    """2 micro-batches: 64 tokens a GPU is 32 a micro-batch, 2 x 32 = one sequence for the
    group; 32 tokens would be half a sequence a micro-batch for the group."""
    assert build(workload={"tokens_per_rank": 64}, transformer={"micro_batches": 2}).transformer.micro_batches == 2
    with pytest.raises(ScenarioError, match="a micro-batch of the tensor-parallel group") as err:
        build(workload={"tokens_per_rank": 32}, transformer={"micro_batches": 2})
    assert err.value.field == "transformer.micro_batches"
    with pytest.raises(ScenarioError, match="is not a multiple of micro_batches x seq_len"):
        build(workload={"tokens_per_rank": 64}, transformer={"micro_batches": 2},
              parallelism={"sequence_parallel": False})


def test_the_sequence_wise_balance_loss_loads_with_split_sequences():
    """Half a sequence per GPU with the sequence-wise balance loss builds (the simulator routes
    counts; the real backend refuses it: tests/real/test_seq_aux_refusal.py)."""
    one = {"pp_size": 1}
    s = build(workload={"tokens_per_rank": 32}, parallelism=one, router={"seq_aux_loss_coef": 1e-4})
    assert s.router.seq_aux_loss_coef == 1e-4 and s.workload.tokens_per_rank == 32


#: MegaScale-MoE's Megatron-LM baseline (arXiv 2505.11432 §6.1): 1,440 GPUs, TP 8 with sequence
#: parallelism, PP 15, DP 12, 720 sequences of 8,192 a step; micro-batches of 1 (assumed: not stated).
#: 15 micro-clusters of 12 nodes so that a stage is a micro-cluster; h200 stands in for the H800.
MEGASCALE_BASELINE = {
    "model": {"preset": "megascale-352b"},
    "cluster": {"gpus_per_node": 8, "nodes_per_microcluster": 12, "microclusters": 15, "profile": "h200"},
    "parallelism": {"tp_size": 8, "sequence_parallel": True, "pp_size": 15, "ep_size": 8},
    "transformer": {"enabled": True, "seq_len": 8192},
    "pager": {"enabled": False},
    "workload": {"global_batch": 720, "micro_batch_size": 1},
}


def test_megascales_megatron_baseline_is_no_longer_refused(tmp_path, capsys):
    """It was refused with "workload.tokens_per_rank = 61440 is not a multiple of
    micro_batches x seq_len": 720 / (12 x 1) = 60 micro-batches, each GPU's 8,192 / 8 =
    1,024 tokens of each, 61,440 a step; the group's 8 x 1,024 are one sequence."""
    s = Scenario.from_dict(MEGASCALE_BASELINE)
    assert (s.world_size, s.workload.tokens_per_rank, s.transformer.micro_batches) == (1440, 61440, 60)
    import tomli_w

    path = tmp_path / "megascale.toml"
    path.write_text(tomli_w.dumps(MEGASCALE_BASELINE))
    assert cli_main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tokens_per_rank = 61440" in out and "micro_batches = 60" in out and "global_batch = 720" in out
