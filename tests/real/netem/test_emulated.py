"""The real backend on an emulated cluster (real.network = emulated): a run measures the
bytes on every link, the simulator's network carries the same bytes, and whatever way a
run ends -- normally, on Ctrl-C, or killed -- no namespace is left behind.

These tests make network namespaces: they need root (CI runs as root) and skip otherwise,
with the reason."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from real.netem import privileges_missing
from real.netem.nsenter import existing_namespaces
from testbed.cli.main import main as cli_main
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

REASON = privileges_missing()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster: {REASON}")

#: 8 ranks, 2 per node, 2 nodes per micro-cluster, 2 micro-clusters: every level carries traffic
EMULATED = {
    "model": {"hidden_size": 64, "ffn_hidden_size": 64, "num_layers": 2, "num_experts": 8},
    "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 2, "profile": "emulated"},
    "parallelism": {"ep_size": 4},
    "pager": {"page_size_bytes": "16KiB", "gpu_budget_bytes": "96KiB"},
    "workload": {"tokens_per_rank": 128},
    "real": {"network": "emulated"},
    "run": {"steps": 3, "warmup_steps": 1},
}


def scenario(tmp_path, **changes) -> Scenario:
    data = json.loads(json.dumps(EMULATED))
    data["run"]["output_dir"] = str(tmp_path / "runs")
    for section, fields in changes.items():
        data.setdefault(section, {}).update(fields)
    return Scenario.from_dict(data)


def overrides(tmp_path, **changes) -> list[str]:
    s = scenario(tmp_path, **changes).to_dict()
    return [f"{section}.{k}={json.dumps(v)}" for section in EMULATED for k, v in s[section].items()
            if k in EMULATED[section] or k in changes.get(section, {})] + [f"run.output_dir={tmp_path / 'runs'}"]


@pytest.fixture
def no_new_namespaces():
    """Whatever the test does, it must leave no namespace of its own behind."""
    before = set(existing_namespaces())
    yield
    left = set(existing_namespaces()) - before
    assert not left, f"left behind: {sorted(left)}"


@pytest.mark.slow
@needs_root
def test_an_emulated_run_measures_wire_bytes_that_the_simulator_predicts(tmp_path, no_new_namespaces):
    # messages of tens of KB, as in a training step: the simulator counts payload, headers
    # and acknowledgements, not the library's few control packets per message
    sized = {"model": {"hidden_size": 128}, "workload": {"tokens_per_rank": 512}}
    real = run_scenario(scenario(tmp_path, **sized), "real")
    assert set(real["wire_bytes_by_level"]) == {"nvlink", "leaf", "spine"}
    steps = [json.loads(line) for line in open(os.path.join(real["run_dir"], "steps.jsonl"))]
    assert all(r["wire_bytes_by_level"]["spine"] > 0 for r in steps)  # every step, every level
    # the headers and acknowledgements are on the wire: more than the payload the planner counts
    # (a leaf-level transfer crosses two NIC links, a spine-level one two NICs and two spine links)
    payload = real["bytes_by_level"]
    assert real["wire_bytes_by_level"]["spine"] > 2 * payload["spine"]
    sim = run_scenario(scenario(tmp_path, model=sized["model"],
                                workload={"tokens_per_rank": 512, "trace": real["run_dir"]}), "sim")
    assert sim["bytes_by_level"] == real["bytes_by_level"]  # the same plan
    for level, measured in real["wire_bytes_by_level"].items():
        # the simulator's network carries what the kernel counted, within 5% (ARP, TCP
        # handshakes of new groups and gloo's control messages are not modelled)
        assert sim["wire_bytes_by_level"][level] == pytest.approx(measured, rel=0.05), level


def test_without_privileges_an_emulated_run_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    import real.netem.nsenter as nsenter

    monkeypatch.setattr(nsenter, "_effective_caps", lambda: 0)
    code = cli_main(["run", "--backend", "real", "--no-progress"] + sum((["--set", o] for o in overrides(tmp_path)), []))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "real.network = 'emulated'" in err[0] and "CAP_NET_ADMIN" in err[0]


def _testbed(args, tmp_path):
    """``testbed ARGS`` in the background, its output in files (ranks it leaves behind must
    not hold a pipe of ours open)."""
    cmd = [sys.executable, "-m", "testbed.cli"] + args
    out, err = open(tmp_path / "stdout.txt", "w"), open(tmp_path / "stderr.txt", "w")
    # as from a terminal: a shell starts background jobs (a CI script's, nohup's) with
    # SIGINT ignored, and Python then never turns Ctrl-C into KeyboardInterrupt
    return subprocess.Popen(cmd, stdout=out, stderr=err, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _stderr(tmp_path) -> str:
    return (tmp_path / "stderr.txt").read_text()


def _wait_for_a_step(tmp_path, proc, timeout_s=120):
    """Wait until the run in tmp_path/runs has written a step (the ranks are up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = list((tmp_path / "runs").glob("*/steps.jsonl"))
        if steps and steps[0].read_text().strip():
            return
        assert proc.poll() is None, _stderr(tmp_path)[-2000:]
        time.sleep(0.2)
    raise AssertionError("no step within the time limit")


@pytest.mark.slow
@needs_root
def test_ctrl_c_during_an_emulated_run_leaves_nothing_behind(tmp_path, no_new_namespaces):
    args = ["run", "--backend", "real", "--no-progress"] + sum(
        (["--set", o] for o in overrides(tmp_path, run={"steps": 200})), [])
    proc = _testbed(args, tmp_path)
    _wait_for_a_step(tmp_path, proc)
    mine = set(existing_namespaces())
    assert any(ns.endswith("-spine") for ns in mine)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    err = _stderr(tmp_path)
    assert proc.returncode == 130, err[-2000:]
    assert "stopped" in err.strip().splitlines()[-1]


@pytest.mark.slow
@needs_root
def test_testbed_net_clean_clears_up_after_a_killed_run(tmp_path, no_new_namespaces):
    before = set(existing_namespaces())
    args = ["run", "--backend", "real", "--no-progress"] + sum(
        (["--set", o] for o in overrides(tmp_path, run={"steps": 200})), [])
    proc = _testbed(args, tmp_path)
    _wait_for_a_step(tmp_path, proc)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    host = os.readlink("/proc/self/ns/net")
    # the ranks: spawned Python processes in namespaces of their own (the launcher also
    # runs short-lived ip / tc commands inside namespaces, e.g. to read the link counters)
    ranks = [int(pid) for pid in children if _netns(int(pid)) not in (None, host) and _is_spawned(int(pid))]
    assert len(ranks) == 8
    proc.kill()  # SIGKILL: no teardown can run
    proc.wait(timeout=30)
    left = set(existing_namespaces()) - before
    assert len(left) == 15  # 8 ranks, 4 nodes, 2 leaves, a spine
    listed = subprocess.run([sys.executable, "-m", "testbed.cli", "net", "list"], capture_output=True, text=True)
    assert "(gone)" in listed.stdout
    cleaned = subprocess.run([sys.executable, "-m", "testbed.cli", "net", "clean"], capture_output=True, text=True)
    assert cleaned.returncode == 0 and "removed 15 namespaces" in cleaned.stdout
    assert not (set(existing_namespaces()) - before)
    # the orphaned ranks were inside those namespaces: they were ended too
    time.sleep(0.5)
    assert not [pid for pid in ranks if _alive(pid)]


def _is_spawned(pid: int) -> bool:
    """A process multiprocessing started with spawn (a rank), not a command."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped is not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@needs_root
def test_a_rank_that_dies_stops_the_run_and_the_cluster_goes_with_it(tmp_path, no_new_namespaces):
    from real.backend import RealBackend
    from testbed.core.errors import RunError

    with pytest.raises(RunError, match="rank 5 died"):
        RealBackend().run(scenario(tmp_path, run={"steps": 6}), debug={"fail_at": {"rank": 5, "after_steps": 2}})
