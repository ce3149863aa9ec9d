"""Every run's process groups (issue 25, item 1; ``testbed.run.runner``): the run folder's
``groups.json`` holds every GPU's groups as Megatron-Core forms them, the summary one line
for GPU 0 and where the file is, and its batch in sequences. The EP and expert-DP groups
the backends form (``Layout``, each pipeline stage laid out alone) are Megatron-Core's
folded ones with expert TP 1 under placement = topology, on layouts with and without TP
and PP; strided and random placements form others, and the summary line says so."""

import json
from pathlib import Path

import pytest

from testbed.cli.main import format_summary
from testbed.layout.process_groups import GROUP_KINDS, build_process_groups, describe_groups, groups_of_kind
from testbed.run.runner import backend_expert_groups, batch_summary, process_groups_file, run_scenario
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout


def build(gpus_per_node=4, nodes=2, microclusters=1, tp=1, pp=1, ep=2, placement="topology", **over) -> Scenario:
    data = {
        "model": {"num_layers": 6, "num_experts": 16},
        "cluster": {"gpus_per_node": gpus_per_node, "nodes_per_microcluster": nodes, "microclusters": microclusters},
        "parallelism": {"ep_size": ep, "tp_size": tp, "pp_size": pp, "placement": placement},
        "transformer": {"enabled": tp > 1 or pp > 1, "seq_len": 64},
        "pager": {"enabled": pp == 1},
        "workload": {"tokens_per_rank": 128},
        "run": {"steps": 2, "warmup_steps": 1},
    }
    for section, fields in over.items():
        data.setdefault(section, {}).update(fields)
    return Scenario.from_dict(data)


LAYOUTS = [
    dict(ep=2), dict(ep=8), dict(gpus_per_node=8, ep=4, tp=2), dict(gpus_per_node=8, ep=8, tp=4),
    dict(nodes=4, ep=4, pp=2), dict(gpus_per_node=8, nodes=2, microclusters=3, ep=4, tp=2, pp=3),
    dict(gpus_per_node=8, nodes=4, ep=16, tp=8, pp=2),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_backends_ep_groups_are_megatrons_folded_ones_under_topology(layout):
    s = build(**layout)
    p = s.parallelism
    megatron = build_process_groups(s.world_size, p.tp_size, 1, p.pp_size, p.ep_size, etp=1, moe_layout="folded")
    ep, edp = backend_expert_groups(s)
    assert ep == list(groups_of_kind(megatron, "ep"))  # the same groups, each in EP-index order
    assert sorted(edp) == list(groups_of_kind(megatron, "edp"))
    if p.pp_size == 1:  # the scenario's own layout, whole
        layout = Layout(s)
        assert ep == [layout.ep_group(g) for g in range(layout.replicas)]
    table, entry = process_groups_file(s)
    assert entry["ep_as_megatron"] and table["ep_as_megatron"] and entry["note"] == ""
    assert entry["rank0"] == describe_groups(megatron, 0)
    if p.pp_size > 2:  # a middle stage's ranks hold neither the embedding nor the head
        assert table["member"]["embedding"][s.world_size // p.pp_size] == -1


@pytest.mark.parametrize("placement", ["strided", "random"])
def test_other_placements_are_not_megatrons_and_the_line_says_so(placement):
    s = build(ep=4, placement=placement)  # 8 GPUs, 2 EP groups of 4
    layout = Layout(s)
    table, entry = process_groups_file(s)
    assert not entry["ep_as_megatron"] and not table["ep_as_megatron"]
    assert f"parallelism.placement = {placement}" in entry["note"]
    ep0 = next(layout.ep_group(g) for g in range(layout.replicas) if 0 in layout.ep_group(g))
    assert f" ep [{','.join(map(str, ep0))}] " in entry["rank0"]
    assert table["backend"]["ep"] == [list(layout.ep_group(g)) for g in range(layout.replicas)]
    if placement == "strided":
        assert ep0 == (0, 2, 4, 6)  # Megatron-Core's would be 0-3


def test_a_layout_megatron_cannot_form_is_named():
    s = build(gpus_per_node=8, ep=4, tp=2, parallelism={"moe_layout": "nested"})  # nested keeps expert TP = TP
    table, entry = process_groups_file(s)
    assert "parallelism.etp_size" in table["error"] and entry["rank0"] is None
    assert entry["note"].startswith("not a layout Megatron-Core forms")


def test_a_run_writes_every_gpus_groups_and_the_summary_line(tmp_path):
    """TP 2 x PP 2 on 16 GPUs: each rank's group of every kind read back from groups.json
    is Megatron-Core's; the printed summary has rank 0's line and the file's path, and the
    batch converted to sequences (each GPU's 128 tokens in 2 micro-batches: the group's 2 x
    64 = 2 sequences of 64 a micro-batch, DP 4 x 2 micro-batches x 2 = 16 sequences a step)."""
    s = build(gpus_per_node=8, ep=4, tp=2, pp=2, transformer={"micro_batches": 2, "num_heads": 4},
              run={"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path)})
    summary = run_scenario(s, "sim")
    path = Path(summary["run_dir"]) / "groups.json"
    table = json.loads(path.read_text())
    megatron = build_process_groups(16, tp=2, pp=2, ep=4, etp=1)
    assert (table["world"], table["tp"], table["pp"], table["ep"], table["dp"]) == (16, 2, 2, 4, 4)
    for rank in range(16):
        for kind in GROUP_KINDS:
            index = table["member"][kind][rank]
            got = tuple(table["groups"][kind][index]) if index >= 0 else ()
            assert got == megatron.of(rank).of_kind(kind), (rank, kind)
    lines = format_summary(summary).splitlines()
    groups = [line for line in lines if line.startswith("groups     ")]
    assert groups == [f"groups     {describe_groups(megatron, 0)}  (every GPU's in {path})"]
    batch = next(line for line in lines if line.startswith("batch      "))
    assert "workload.global_batch = 16 and workload.micro_batch_size = 2" in batch
    assert summary["batch"] == batch_summary(s) and summary["batch"]["dp"] == 4


def test_a_run_from_the_global_batch_says_what_it_derived(tmp_path):
    s = build(gpus_per_node=8, ep=4, tp=2, pp=2, transformer={"num_heads": 4},
              workload={"global_batch": 32, "micro_batch_size": 2, "tokens_per_rank": 256},
              run={"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path)})
    text = batch_summary(s)["text"]
    assert text == ("workload.global_batch = 32 sequences of 64 tokens, micro-batches of 2 on each of DP 4: "
                    "transformer.micro_batches = 4, workload.tokens_per_rank = 256 (64 a micro-batch on each GPU)")
    summary = run_scenario(s, "sim")
    assert f"batch      {text}" in format_summary(summary).splitlines()


def test_the_moe_stack_has_groups_and_no_batch_line(tmp_path):
    s = build(run={"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path)})
    summary = run_scenario(s, "sim")
    assert summary["batch"] is None and summary["groups"]["rank0"].startswith("rank 0: tp [0] cp [0] dp [0..7]")
    assert not any(line.startswith("batch ") for line in format_summary(summary).splitlines())
