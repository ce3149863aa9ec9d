"""Scenario loading, defaults, overrides and the one-line errors for bad input."""

import pytest

from testbed.core.errors import ScenarioError
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario, field_docs


def test_every_field_has_a_default_and_a_doc():
    rows = field_docs()
    assert len(rows) > 50
    for name, default, text in rows:
        assert default is not None and text, name


def test_defaults_validate_and_derive_sizes():
    s = Scenario.from_dict({})
    assert s.world_size == 8 and s.replicas == 2 and s.experts_per_rank == 2
    assert s.model.expert_bytes == 2 * 64 * 128 * 4


def test_shipped_configs_load(repo_root):
    for name in ("quickstart", "local-cpu", "paper-1440"):
        s = load_scenario(repo_root / "configs" / f"{name}.toml")
        assert s.notes
    assert load_scenario(repo_root / "configs" / "paper-1440.toml").world_size == 1440
    assert load_scenario(repo_root / "configs" / "local-cpu.toml").world_size == 4


@pytest.mark.parametrize("data, field, value", [
    ({"model": {"top_k": 9}}, "model.top_k", 9),
    ({"pager": {"page_size_bytes": 0}}, "pager.page_size_bytes", 0),
    ({"pager": {"page_size_bytes": "-3MiB"}}, "pager.page_size_bytes", "-3MiB"),
    ({"parallelism": {"ep_size": 3}}, "parallelism.ep_size", 3),
    ({"heat": {"alpha": -0.1}}, "heat.alpha", -0.1),
    ({"heat": {"alpha": 0, "beta": 0, "gamma": 0}}, "heat.alpha", 0.0),
    ({"model": {"top_k": "2"}}, "model.top_k", "2"),
    ({"model": {"top_k": True}}, "model.top_k", True),
    ({"router": {"capacty_factor": 1.0}}, "router.capacty_factor", 1.0),
    ({"routr": {}}, "routr", {}),
    ({"comm": {"token_strategy": "ring"}}, "comm.token_strategy", "ring"),
    ({"run": {"steps": 2, "warmup_steps": 2}}, "run.warmup_steps", 2),
])
def test_bad_values_name_the_field_and_value(data, field, value):
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict(data)
    assert err.value.field == field and err.value.value == value
    assert str(err.value).startswith(f"{field} = {value!r}: ")
    assert "\n" not in str(err.value)


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ScenarioError, match="did you mean capacity_factor"):
        Scenario.from_dict({"router": {"capacty_factor": 1.0}})


def test_hierarchical_needs_equal_members_per_node():
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict({"comm": {"token_strategy": "hierarchical"},
                            "parallelism": {"placement": "random", "placement_seed": 3}})
    assert err.value.field == "comm.token_strategy"


def test_overrides_parse_toml_values_and_bare_words(tmp_path):
    s = load_scenario(None, ["comm.token_strategy=allgather", "router.capacity_factor=1.1",
                             "pager.page_size_bytes=\"64KiB\"", "router.pad_capacity_to_ep=true"])
    assert s.comm.token_strategy == "allgather" and s.router.capacity_factor == 1.1
    assert s.pager.page_size_bytes == 65536 and s.router.pad_capacity_to_ep is True
    with pytest.raises(ScenarioError, match="expected section.key=value"):
        load_scenario(None, ["capacity_factor=1"])


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ScenarioError, match="no such file"):
        load_scenario(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nhidden_size = 3")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(bad)


def test_round_trip_and_replace():
    s = Scenario.from_dict({})
    assert Scenario.from_dict(s.to_dict()) == s
    t = s.replace(comm={"expert_sync": "two_stage"})
    assert t.comm.expert_sync == "two_stage" and s.comm.expert_sync == "allreduce"
    assert t.model == s.model
