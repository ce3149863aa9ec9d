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


def test_every_feature_is_modelled_by_some_backend():
    """A field that neither backend models would only ever be refused: none is left (the
    issue-25 layout fields were added refused, and each has a backend now)."""
    assert [name for name, f in features.FEATURES.items() if not (f.sim or f.real)] == []


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
