"""The published runs as scenarios (configs/published/, issue 25 item 9).

Every file is one published run (or several rows of one setup), its header naming the source and
every assumption. What each does on the simulator today is written down here, so that this test
fails, and these tables must be edited, when it changes:

- ``REFUSED_AT_LOAD``: the file does not load as a Scenario; the ScenarioError names the field;
- ``REFUSED_BY_SIM``: it loads, and the simulator refuses it before a run starts (the features
  check ``testbed.run.features.check_features``, then the backend's own ``check``: pipeline
  stages, model support), naming the field;
- every other file runs: one simulated step (slow test), whose fullest GPU fits the profile's
  device memory, except the files of ``OVER_MEMORY``, whose simulated peak is above it.

``configs/published/README.md`` carries the same tables (``test_readme_gives_each_files_status``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from testbed.core.errors import ScenarioError
from testbed.run.backend import get_backend
from testbed.run.features import check_features
from testbed.run.runner import run_scenario
from testbed.scenario.file import load_scenario

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "configs" / "published"
FILES = sorted(p.name for p in PUBLISHED.glob("*.toml"))

#: file -> the field it is refused for at load today (none: DeepSeek-V3's sequence-wise balance loss with each
#: sequence split over a TP pair is refused by the real backend only, real/backend.py)
REFUSED_AT_LOAD: dict[str, str] = {}

#: file -> the field the simulator refuses it for today (the first the checks meet); the Megatron-Core
#: layouts without folding (moe_layout = nested, etp_size = tp_size) run where the simulator models expert
#: TP (testbed/run/features.py), else they are refused for parallelism.etp_size
REFUSED_BY_SIM: dict[str, str] = {}

#: files that run, whose simulated fullest GPU holds more than the profile's device memory, where the
#: published runs fit in 80 GB. Issue 25: the micro-batches (chunks) in flight are Megatron's and DualPipe's
#: (tests/sim/pipeline/test_in_flight_activations.py); what was wrong was an MoE layer's activations
#: (testbed/model/whole_model.py: a dense FFN it does not have, its input twice, the rows' outputs instead of
#: their activations), which took DeepSeek-V3 on 1,024 H100 from 87.0 to 57.7 GiB and Qwen3-235B from 85.2 to
#: 61.3 GiB (each figure: `testbed run configs/published/FILE --set run.steps=2`, the fullest GPU's peak). Still
#: over: DeepSeek-V3 on 2,048 H800, 93.3 GiB of 74.5 (activations 74.0 GiB, DualPipe's 17
#: chunks of 4 layers in flight), without DeepSeek's fp8 activation caching (its header); Qwen3-30B, 74.95
#: GiB of 74.51 (activations 46.2 GiB, 47 one-layer chunks in flight on the loss stage), where GQA's K and V
#: are counted at the query heads' width (testbed/model/transformer_shape.py; at the key-value heads' it
#: fits, 69.8 GiB) and the dropout masks the recipe does not have are kept
OVER_MEMORY: set[str] = set()  # every file fits (configs/published/README.md)

RUNS = [name for name in FILES if name not in REFUSED_AT_LOAD and name not in REFUSED_BY_SIM]


def sim_refusal(scenario) -> str | None:
    """The field the simulator refuses ``scenario`` for before a run starts, as the runner
    checks it (features, then the backend's check), or None."""
    try:
        check_features(scenario, "sim")
        get_backend("sim").check(scenario)
    except ScenarioError as e:
        return e.field
    return None


def test_the_tables_name_existing_files_only():
    """The tables above are about files that exist, each in at most one of them, and every
    file runs or is refused for one field (27 files today)."""
    named = [*REFUSED_AT_LOAD, *REFUSED_BY_SIM]
    assert len(named) == len(set(named))
    assert set(named) | OVER_MEMORY <= set(FILES)
    assert OVER_MEMORY <= set(RUNS)
    assert len(FILES) == 27


@pytest.mark.parametrize("name", FILES)
def test_each_file_states_its_source_and_cluster(name):
    """Each header names its source and what it assumes; the GPUs and the profile are the ones
    in the file's name (``MODEL-GPUS-PROFILE...``), 8 GPUs a node."""
    text = (PUBLISHED / name).read_text()
    header = text.split("\n[", 1)[0]
    assert "# Source:" in header and "Assumed" in header
    gpus, profile = re.search(r"-(\d+)-(h100|h800)", name).groups()
    cluster = tomllib.loads(text)["cluster"]
    assert cluster["gpus_per_node"] == 8 and cluster["profile"] == profile
    assert cluster["gpus_per_node"] * cluster["nodes_per_microcluster"] * cluster["microclusters"] == int(gpus)


@pytest.mark.parametrize("name", FILES)
def test_each_file_loads_or_is_refused_naming_its_field(name):
    path = PUBLISHED / name
    if name in REFUSED_AT_LOAD:
        with pytest.raises(ScenarioError) as e:
            load_scenario(path)
        assert e.value.field == REFUSED_AT_LOAD[name]
        return
    s = load_scenario(path)
    gpus = int(re.search(r"-(\d+)-h[18]00", name).group(1))
    assert s.world_size == gpus and s.transformer.enabled and s.workload.global_batch > 0


@pytest.mark.parametrize("name", [n for n in FILES if n not in REFUSED_AT_LOAD])
def test_the_simulator_runs_it_or_names_the_field_it_refuses(name):
    assert sim_refusal(load_scenario(PUBLISHED / name)) == REFUSED_BY_SIM.get(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_one_simulated_step_fits_or_is_known_not_to(name, tmp_path):
    """One step on the simulator (its wall time printed, not asserted); the fullest GPU's peak
    against the profile's device memory; the summary gives the pipeline's bubble and rank 0's
    groups."""
    s = load_scenario(PUBLISHED / name).replace(run={"steps": 1, "warmup_steps": 0, "output_dir": str(tmp_path)})
    start = time.perf_counter()
    # force: past testbed.run.guards' size check, whose "a rank's routed tokens" (tokens_per_rank x H x 4 x
    # top_k: 16 GiB for Qwen3-30B) the simulator never allocates, and which it measures against this
    # machine's free memory (the features and the backend's checks still run)
    summary = run_scenario(s, "sim", force=True)
    wall = time.perf_counter() - start
    print(f"{name}: {wall:.1f} s wall, step {summary['step_time_s'] * 1e3:.1f} ms, "
          f"peak {summary['peak_memory_bytes'] / 2**30:.1f} GiB")
    assert summary["step_time_s"] > 0 and summary["measured_steps"] == 1
    bubble = summary["pipeline"]["bubble_fraction"]  # gradient accumulation alone (pp 1) has none
    assert 0 <= bubble < 1 and (bubble > 0) == (s.parallelism.pp_size > 1)
    assert summary["groups"]["rank0"].startswith("rank 0: tp ")
    fits = summary["peak_memory_bytes"] <= summary["device_memory_bytes"]
    assert fits == summary["fits_in_device_memory"]
    assert fits is (name not in OVER_MEMORY)


def test_testbed_check_prints_the_resolved_scenario_without_a_traceback():
    cli = [sys.executable, "-m", "testbed.cli", "check"]
    ok = subprocess.run([*cli, str(PUBLISHED / "mixtral-8x7b-64-h100.toml")], capture_output=True, text=True,
                        cwd=ROOT, timeout=120)
    assert ok.returncode == 0 and "Traceback" not in ok.stderr
    assert "global_batch = 256" in ok.stdout and "micro_batches = 16" in ok.stdout
    # no file is refused at load today: one made so by an override (the GPU counts have no divisor 3)
    name, override, field = "mixtral-8x7b-64-h100.toml", ["--set", "parallelism.tp_size=3"], "parallelism.pp_size"
    if REFUSED_AT_LOAD:
        name, override = next(iter(REFUSED_AT_LOAD)), []
        field = REFUSED_AT_LOAD[name]
    refused = subprocess.run([*cli, str(PUBLISHED / name), *override], capture_output=True, text=True, cwd=ROOT,
                             timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]  # one line
    assert refused.stderr.startswith(f"testbed: error: {field} = ")


def readme_status() -> dict[str, str]:
    """file -> its status column in configs/published/README.md's table."""
    rows = {}
    for line in (PUBLISHED / "README.md").read_text().splitlines():
        m = re.match(r"\| `([^`]+\.toml)` \|.*\| ([^|]+) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2).strip()
    return rows


def test_readme_gives_each_files_status():
    """The README's table has every file once, with the status of the tables above:
    "runs", "runs, over memory", "load: FIELD" or "sim: FIELD"."""
    expected = {}
    for name in FILES:
        if name in REFUSED_AT_LOAD:
            expected[name] = f"load: `{REFUSED_AT_LOAD[name]}`"
        elif name in REFUSED_BY_SIM:
            expected[name] = f"sim: `{REFUSED_BY_SIM[name]}`"
        else:
            expected[name] = "runs, over memory" if name in OVER_MEMORY else "runs"
    assert readme_status() == expected
