"""experiments/local_first_bias.py with the sim backend: the bias moves token bytes off
the spine and, past some strength, costs drops (the source's warning, M22)."""

from __future__ import annotations

import json

from testbed.study.experiments import load_experiment


def test_quick_sweep_on_the_simulator(tmp_path, capsys):
    module = load_experiment("local_first_bias")
    code = module.experiment_main(module.EXPERIMENT, ["--quick", "--json", "--backends", "sim", "--no-progress",
                                                      "--output-dir", str(tmp_path / "runs"),
                                                      "--report", str(tmp_path / "bias.html")])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    head = out["headline"]
    assert head["spine_bytes_change_sim_bias3"] < head["spine_bytes_change_sim_bias1"] < -0.1
    assert head["nvlink_bytes_change_sim_bias1"] > 0.1
    assert head["dropped_sim_bias3"] > head["dropped_sim_bias1"] > head["dropped_sim_bias0"]
    assert (tmp_path / "bias.html").is_file()
