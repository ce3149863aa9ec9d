"""A model feature a backend does not model is refused with its field named, never run as
if the field were absent (testbed/run/features.py)."""

import pytest

from testbed.core.errors import ScenarioError
from testbed.run import features
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario


def test_every_feature_is_off_by_default():
    assert features.used_features(Scenario()) == []


def test_an_unmodelled_feature_is_refused_naming_its_field(tmp_path, monkeypatch):
    s = Scenario().replace(router={"score": "sigmoid"}, run={"output_dir": str(tmp_path)})
    assert features.used_features(s) == ["router.score"]
    monkeypatch.setitem(features.FEATURES, "router.score", features.Feature(features.FEATURES["router.score"].used))
    with pytest.raises(ScenarioError, match=r"router.score = 'sigmoid': the sim backend does not model this yet"):
        run_scenario(s, "sim")
    assert not list(tmp_path.iterdir())  # refused before any run folder
    monkeypatch.setitem(features.FEATURES, "router.score",
                        features.Feature(features.FEATURES["router.score"].used, sim=True))
    features.check_features(s, "sim")  # modelled: no error
    with pytest.raises(ScenarioError, match="the real backend does not model this yet"):
        features.check_features(s, "real")


#: issue 25's layout fields, each with a value that uses it; refused until a backend models it
LAYOUT_VALUES = {
    "parallelism": {"attention_parallel": "ulysses"},
}


@pytest.mark.parametrize("section, key, value", [(s, k, v) for s, kv in LAYOUT_VALUES.items() for k, v in kv.items()])
def test_a_layout_field_no_backend_models_yet_is_refused_on_both(section, key, value):
    tables = {section: {key: value}}
    if section == "transformer":
        tables[section]["enabled"] = True
    s = Scenario.from_dict(tables)
    field = f"{section}.{key}"
    assert features.used_features(s) == [field]
    for backend in ("sim", "real"):
        with pytest.raises(ScenarioError, match=rf"{field} = .*the {backend} backend does not model this yet"):
            features.check_features(s, backend)


def test_context_parallelism_is_modelled_on_both_backends():
    """parallelism.cp_size (issue 25, item 2): the simulator and the real backend run it."""
    s = Scenario.from_dict({"cluster": {"gpus_per_node": 4}, "parallelism": {"cp_size": 2},
                            "workload": {"tokens_per_rank": 128},
                            "transformer": {"enabled": True, "seq_len": 256}})
    assert features.used_features(s) == ["parallelism.cp_size"]
    for backend in ("sim", "real"):
        features.check_features(s, backend)  # modelled: no error


def test_an_unknown_recompute_module_is_named():
    with pytest.raises(ScenarioError, match=r"transformer.recompute_modules = 'mlp,attn': unknown module 'attn'"):
        Scenario.from_dict({"transformer": {"recompute_modules": "mlp,attn"}})
