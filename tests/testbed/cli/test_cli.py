"""The ``testbed`` command as a user meets it: summaries, JSON, one-line errors, exit codes."""

import json
import subprocess
import sys


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "testbed.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_run_prints_one_json_object_with_the_summary_fields(tmp_path, repo_root):
    out = run_cli("run", str(repo_root / "configs/quickstart.toml"), "--json", "--no-progress",
                  "--set", "run.steps=3", "--set", f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    for key in ("backend", "run_dir", "step_time_s", "stage_time_s", "bytes_by_stage", "bytes_by_level",
                "peak_memory_bytes", "dropped_token_fraction", "page_moves_per_step", "group_cache_hit_rate"):
        assert key in summary
    assert set(summary["bytes_by_level"]) == {"nvlink", "leaf", "spine", "pcie"}
    run_dir = tmp_path / summary["run_dir"].split("/")[-1]
    for name in ("scenario.toml", "summary.json", "steps.jsonl", "trace.json", "routing.npz"):
        assert (run_dir / name).is_file(), name
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == 3
    assert (tmp_path / "index.jsonl").is_file()


def test_human_summary(tmp_path):
    out = run_cli("run", "--no-progress", "--set", "run.steps=2", "--set", "run.warmup_steps=0",
                  "--set", f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "step time" in out.stdout and "levels" in out.stdout


def test_bad_config_is_one_line_and_exit_code_2(tmp_path, repo_root):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\ntop_k = 20\n")
    for args in (("run", str(bad)), ("run", str(tmp_path / "missing.toml")),
                 ("run", "--set", "router.capacity_factor=-1"), ("run", "--backend", "gpu"),
                 ("run", "--set", "workload.trace=/nowhere", "--set", f"run.output_dir={tmp_path}")):
        out = run_cli(*args, cwd=tmp_path)
        assert out.returncode == 2, (args, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("testbed: error: "), out.stderr
        assert "Traceback" not in out.stderr
    out = run_cli("run", str(bad), cwd=tmp_path)
    assert "model.top_k = 20: exceeds model.num_experts = 8" in out.stderr


def test_report_is_self_contained(tmp_path):
    out = run_cli("run", "--json", "--no-progress", "--set", "run.steps=2", "--set", "run.warmup_steps=0",
                  "--set", f"run.output_dir={tmp_path}", cwd=tmp_path)
    run_dir = json.loads(out.stdout)["run_dir"]
    rep = run_cli("report", run_dir, "-o", str(tmp_path / "r.html"), cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    html = (tmp_path / "r.html").read_text()
    assert "<script src=" not in html and "Plotly" in html and run_dir in html


def test_fields_lists_every_field_by_section_wrapped(tmp_path):
    out = run_cli("fields", "--width", "90", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 90
    heads = [line.split()[0] for line in lines if line.startswith("[")]
    assert heads[:3] == ["[model]", "[cluster]", "[parallelism]"] and "[router]" in heads and "[pager]" in heads
    router = lines.index(next(line for line in lines if line.startswith("[router]")))
    assert "  capacity_factor = 1.25" in lines[router:router + 30]
    assert "  page_size_bytes = 16777216" in lines
    one = run_cli("fields", "router", cwd=tmp_path)
    assert one.stdout.startswith("[router]") and "[pager]" not in one.stdout
    bad = run_cli("fields", "routr", cwd=tmp_path)
    assert bad.returncode == 2 and "SECTION = 'routr'" in bad.stderr


def test_collective_prints_an_nccl_tests_table_and_one_line_errors(tmp_path):
    out = run_cli("collective", "allreduce", "--gpus", "8", "--sizes", "1M:4M", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if not line.startswith("#")]
    assert len(rows) == 3 and "busbw" in out.stdout and out.stdout.splitlines()[-1].startswith("# Avg bus bandwidth")
    bad = run_cli("collective", "all_reduce", "--gpus", "8", "--sizes", "1M:1X", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "testbed: error: --sizes = '1X': expected a positive size in bytes, e.g. 8, 64K, 1M, 1G (powers of 2, as "
        "nccl-tests' -b and -e) or 16MiB"]
