"""One entry point, two launches: ``testbed run --backend real`` spawns the ranks
itself, and the same command under ``torchrun`` runs one rank per process (only rank 0
writes the run folder). Options only the simulator models fail fast."""

import json
import subprocess
import sys

import pytest

from real.backend import RealBackend
from testbed.core.errors import ScenarioError
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario


@pytest.mark.slow
def test_torchrun_runs_the_same_entry_point(tmp_path, repo_root, two_ranks):
    overrides = [f"{section}.{k}={json.dumps(v)}" for section, kv in two_ranks.items() for k, v in kv.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "testbed.cli", "run", "--backend", "real", "--json", "--no-progress",
           "--set", f"run.output_dir={tmp_path / 'torchrun'}"]
    for o in overrides:
        cmd += ["--set", o]
    out = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 prints, rank 1 does not
    launched = json.loads(lines[0])
    assert launched["launcher"] == "torchrun"
    runs = [p for p in (tmp_path / "torchrun").iterdir() if p.is_dir()]
    assert len(runs) == 1 and len((runs[0] / "steps.jsonl").read_text().splitlines()) == 3
    spawn = Scenario.from_dict({**two_ranks, "run": {**two_ranks["run"], "output_dir": str(tmp_path / "spawn")}})
    spawned = run_scenario(spawn, "real")
    assert spawned["launcher"] == "spawn"
    assert spawned["bytes_by_stage"] == launched["bytes_by_stage"]
    assert spawned["loss_last"] == launched["loss_last"]


def test_torchrun_world_size_must_match_the_cluster(monkeypatch, tmp_path, two_ranks):
    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    s = Scenario.from_dict({**two_ranks, "run": {**two_ranks["run"], "output_dir": str(tmp_path)}})
    with pytest.raises(ScenarioError, match="cluster.gpus_per_node .*WORLD_SIZE = 3.* 2 GPUs"):
        RealBackend().run(s)
    monkeypatch.setenv("RANK", "1")
    assert not RealBackend().writes_run_folder()


@pytest.mark.parametrize("section, fields, name", [
    ("faults", [{"at_step": 1, "kind": "gpu_lost", "target": "gpu:1"}], "faults[0].kind"),
])
def test_simulated_only_options_fail_fast(section, fields, name, tmp_path, two_ranks):
    s = Scenario.from_dict({**two_ranks, section: fields})
    with pytest.raises(ScenarioError, match=rf"{name.replace('[', '.').replace(']', '.')} .*simulated only"):
        RealBackend().run(s)


@pytest.mark.slow
@pytest.mark.parametrize("progress", [True, False])
def test_starting_ranks_is_shown_where_progress_is(tmp_path, two_ranks, capfd, progress):
    """The several seconds the ranks take to start (each imports torch, joins the group
    and builds its model) are not silent where the CLI shows progress: a line when they
    start and one when every rank is up, on stderr, before any step; nothing without."""
    s = Scenario.from_dict({**two_ranks, "run": {**two_ranks["run"], "output_dir": str(tmp_path)}})
    RealBackend().run(s, progress=progress)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("real: ")]
    if progress:
        assert lines[0] == "real: starting 2 ranks (gloo)..."
        assert lines[1].startswith("real: 2 ranks up (") and lines[1].endswith(" s)")
        assert err.index("ranks up") < err.index("real x2: 1/3")  # before the first step's progress
    else:
        assert lines == [] and "real x2" not in err
