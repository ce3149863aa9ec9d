"""Guards before work starts: sizes this machine cannot hold, too many ranks per core, and
bad inputs each get one line and exit 2, never a traceback; a fuzz test over scenarios and
command lines holds the testbed to that."""

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from testbed.cli.main import main as cli_main
from testbed.core.errors import ScenarioError
from testbed.run.guards import check_size, estimate
from testbed.scenario.scenario import Scenario


def one_line_exit_2(argv, capsys):
    code = cli_main(argv)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("testbed: error: "), out.err
    return lines[0]


def test_a_million_gpus_is_refused_before_any_work(tmp_path, capsys):
    line = one_line_exit_2(["run", "--no-progress", "--set", "cluster.gpus_per_node=1000",
                            "--set", "cluster.nodes_per_microcluster=100", "--set", "cluster.microclusters=10",
                            "--set", f"run.output_dir={tmp_path}"], capsys)
    assert "1,000,000 GPUs" in line and "GiB" in line and "--force" in line
    assert not list(tmp_path.iterdir())  # nothing was written
    s = Scenario.from_dict({"cluster": {"gpus_per_node": 1000, "nodes_per_microcluster": 100, "microclusters": 10}})
    assert check_size(s, "sim", force=True)["largest_allocation"] >= 1e12  # --force skips the refusal


@pytest.mark.parametrize("field, value, named, backend", [
    ("model.hidden_size", 10**12, "model.hidden_size", "sim"),
    ("model.ffn_hidden_size", 10**13, "model.ffn_hidden_size", "sim"),
    # the real ranks hold their tokens' hidden states; the simulator routes counts only
    ("workload.tokens_per_rank", 10**13, "workload.tokens_per_rank", "real"),
    ("run.steps", 10**12, "run.steps", "sim"),
])
def test_a_value_that_would_overflow_an_allocation_is_one_line(field, value, named, backend, tmp_path, capsys):
    line = one_line_exit_2(["run", "--no-progress", "--backend", backend, "--set", f"{field}={value}",
                            "--set", f"run.output_dir={tmp_path}"], capsys)
    assert named in line and "this machine can give" in line


def test_the_simulator_is_not_charged_for_tokens_it_never_holds():
    s = Scenario.from_dict({"workload": {"tokens_per_rank": 10**9}})
    assert "routed tokens" not in str(estimate(s, "sim")["largest"])
    assert estimate(s, "real")["largest"][2] == "a rank's routed tokens"


def test_a_simulation_that_would_take_hours_is_refused():
    s = Scenario.from_dict({"cluster": {"gpus_per_node": 8, "nodes_per_microcluster": 16, "microclusters": 8},
                            "parallelism": {"ep_size": 8}, "model": {"num_layers": 32},
                            "sim": {"network_model": "flow"}, "run": {"steps": 100}})
    assert estimate(s, "sim")["wall_s"] > 3600
    with pytest.raises(ScenarioError, match="h limit"):
        check_size(s, "sim")


def test_more_cpu_ranks_per_core_than_the_limit_need_force(tmp_path, capsys):
    line = one_line_exit_2(["run", "--backend", "real", "--no-progress", "--set", "cluster.gpus_per_node=64",
                            "--set", "cluster.nodes_per_microcluster=1", "--set", "cluster.microclusters=1",
                            "--set", f"run.output_dir={tmp_path}"], capsys)
    assert "real.max_ranks_per_core" in line and "64 CPU ranks" in line and "--force" in line
    assert not list(tmp_path.iterdir())


def test_a_directory_an_empty_file_and_a_missing_file_each_say_what_they_are(tmp_path, capsys):
    assert "is a directory" in one_line_exit_2(["run", str(tmp_path)], capsys)
    (tmp_path / "empty.toml").write_text("")
    assert "is empty" in one_line_exit_2(["run", str(tmp_path / "empty.toml")], capsys)
    assert "no such file" in one_line_exit_2(["run", str(tmp_path / "none.toml")], capsys)


def test_a_closed_pipe_is_one_line_not_a_traceback(repo_root):
    cmd = f"{sys.executable} -m testbed.cli fields | true"
    out = subprocess.run(["bash", "-c", f"{cmd}; echo ${{PIPESTATUS[0]}}"], capture_output=True, text=True,
                         cwd=repo_root)
    assert out.stdout.strip() == "141"
    assert out.stderr.strip() == "testbed: output pipe closed by its reader"


# ---- fuzz: every scenario and command line ends in a run or in one line and exit 2 ---------
SMALL_OR_WILD = st.one_of(st.integers(1, 4), st.integers(-3, 0), st.sampled_from([10**9, 10**15]),
                          st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.booleans())
FIELDS = ["model.hidden_size", "model.ffn_hidden_size", "model.num_layers", "model.num_experts", "model.top_k",
          "cluster.gpus_per_node", "cluster.nodes_per_microcluster", "cluster.microclusters",
          "parallelism.ep_size", "router.capacity_factor", "pager.page_size_bytes", "pager.gpu_budget_bytes",
          "workload.tokens_per_rank", "workload.skew", "run.steps", "run.warmup_steps", "comm.token_strategy",
          "sim.network_model", "heat.alpha", "nosuch.field", "model.nosuchkey"]


@settings(max_examples=100, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(FIELDS), SMALL_OR_WILD), max_size=4),
       st.sampled_from([[], ["--json"], ["--backend", "nosuch"], ["--set", "garbage"], ["--resume", "/nowhere"]]))
def test_fuzzed_scenarios_run_or_are_refused_in_one_line(tmp_path_factory, capsys, sets, extra):
    out_dir = tmp_path_factory.mktemp("fuzz")
    argv = ["run", "--no-progress", "--set", f"run.output_dir={out_dir}", "--set", "run.steps=2",
            "--set", "run.warmup_steps=1"]
    for field, value in sets:
        argv += ["--set", f"{field}={json.dumps(value) if not isinstance(value, str) else value}"]
    argv += extra
    try:
        code = cli_main(argv)
    except SystemExit as e:  # argparse refuses an unknown option itself: one usage line and exit 2
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    event("ran" if code == 0 else "refused")
    if code == 0:
        return
    assert code == 2, (argv, err)
    assert len([line for line in err if line.startswith("testbed: error")]) == 1, (argv, err)
    assert not any("Traceback" in line for line in err), (argv, err)


def test_the_real_backends_task_is_counted(monkeypatch):
    """Every real rank holds its training task's teacher matrices (E x H x H fp32,
    ``real.kernels.task``): at H 2048 and 64 experts 1 GiB a rank, which alone outgrows a 2 GiB
    machine on 2 ranks while the experts (F 8) are small; the guard refuses the run and
    names what does not fit."""
    monkeypatch.setattr("testbed.run.guards.available_memory", lambda: 2 * 2**30)
    s = Scenario.from_dict({"model": {"hidden_size": 2048, "ffn_hidden_size": 8, "num_experts": 64, "num_layers": 1},
                            "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
                            "parallelism": {"ep_size": 2}, "workload": {"tokens_per_rank": 16}})
    est = estimate(s, "real")
    assert est["memory"] >= 2 * 64 * 2048 * 2048 * 4
    assert est["largest_allocation"] == 64 * 2048 * 2048 * 4 and "teacher" in est["largest"][2]
    with pytest.raises(ScenarioError, match="would need about"):
        check_size(s, "real")
    assert estimate(s, "sim")["memory"] < 2**30  # the simulator holds no task
