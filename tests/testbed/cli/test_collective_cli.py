"""``testbed collective``: nccl-tests tables from the simulator and from real ranks."""

import dataclasses
import json
import subprocess
import sys

import pytest

from testbed.cli.collective import bus_factor, cluster_scenario, collective_op, op_size, parse_kind, parse_sizes
from testbed.cli.main import main
from testbed.core.errors import ScenarioError
from testbed.scenario.profile import load_profile, save_profile


def table(capsys, *args) -> dict:
    assert main(["collective", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def ring_h200(tmp_path):
    """h200 with every collective on its standard algorithm (ring; direct all-to-all)."""
    p = load_profile("h200")
    algs = dataclasses.replace(p.collectives.algorithm, all_reduce="ring", all_gather="ring", reduce_scatter="ring")
    return str(save_profile(dataclasses.replace(p, collectives=dataclasses.replace(p.collectives, algorithm=algs)),
                            tmp_path / "ring-h200.toml"))


def test_single_node_ring_busbw_is_the_nvlink_figure(capsys, ring_h200):
    """nccl-tests' closed form: on one link class of bandwidth B, the busbw of a large ring
    all-reduce (and all-gather, reduce-scatter, all-to-all on a switch) is B. It holds only
    when ``size`` means what nccl-tests means by it for every kind."""
    nvlink = load_profile(ring_h200).links.nvlink.bandwidth_GBps
    for kind in ("all_reduce", "allgather", "reduce_scatter", "alltoall"):
        got = table(capsys, kind, "--sizes", "1G", "--gpus", "8", "--profile", ring_h200)
        (row,) = got["rows"]
        assert row["size"] == 2**30 and row["seconds"] > 0
        assert row["busbw_GBps"] == pytest.approx(nvlink, rel=0.02), kind
        assert row["algbw_GBps"] == pytest.approx(row["size"] / row["seconds"] / 1e9)
    assert got["kind"] == "alltoall" and row["algorithm"] == "direct"


def test_the_table_has_nccl_tests_columns(capsys):
    assert main(["collective", "all_reduce", "--sizes", "1M:4M", "--gpus", "16", "--nodes", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "16 GPUs on 2 nodes (8 per node)" in out[0]
    assert out[1].split()[1:] == ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "algorithm"]
    rows = [line.split() for line in out if not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [2**20, 2**21, 2**22]
    assert [int(r[1]) for r in rows] == [2**18, 2**19, 2**20]  # float32 elements
    for r in rows:
        time_us, algbw, busbw = map(float, r[5:8])
        assert time_us > 0 and algbw == pytest.approx(int(r[0]) / time_us / 1e3, abs=0.01)
        assert busbw == pytest.approx(algbw * 2 * 15 / 16, abs=0.02)
    assert out[-1].startswith("# Avg bus bandwidth")


def test_sizes_parse_as_nccl_tests_does():
    assert parse_sizes("1M:1G", 2) == [2**k for k in range(20, 31)]
    assert parse_sizes("1M:1G", "4") == [2**k for k in range(20, 31, 2)]
    assert parse_sizes("8:128M", 2) == [2**k for k in range(3, 28)]  # -b 8 -e 128M -f 2
    assert parse_sizes("64K", 2) == [65536]
    assert parse_sizes("64KiB:1MB", 2) == [65536, 131072, 262144, 524288]  # testbed's units too
    assert parse_sizes("3k:20k", 3) == [3072, 9216]


def test_size_means_what_nccl_tests_means():
    """all_gather's size is the output (each rank gives size / n), reduce_scatter's the
    input, all_to_all's each rank's send buffer (size / n to every rank); rounded down to
    whole floats, and to n floats where split."""
    n, size = 8, 2**20
    assert collective_op("all_reduce", size, n).size == size
    assert collective_op("all_gather", size, n).size == size // n
    assert collective_op("reduce_scatter", size, n).size == size
    m = collective_op("all_to_all_v", size, n).matrix
    assert m.shape == (n, n) and int(m[0].sum()) == size
    assert op_size("all_reduce", 1001, n) == 1000 and op_size("all_gather", 1001, n) == 992
    assert op_size("all_gather", 16, 8) == 0
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == bus_factor("all_to_all_v", 4) == 0.75
    assert {parse_kind(k) for k in ("allreduce", "all_reduce", "ALLREDUCE")} == {"all_reduce"}
    assert parse_kind("alltoall") == parse_kind("all_to_all") == "all_to_all_v"
    assert parse_kind("reducescatter") == "reduce_scatter" and parse_kind("allgather") == "all_gather"


@pytest.mark.parametrize("args, named", [
    (("allreduc", "--gpus", "8"), "KIND = 'allreduc'"),
    (("all_reduce", "--gpus", "0"), "--gpus = '0'"),
    (("all_reduce", "--gpus", "eight"), "--gpus = 'eight'"),
    (("all_reduce", "--gpus", "16", "--nodes", "3"), "--nodes = 3: does not divide --gpus = 16"),
    (("all_reduce", "--gpus", "8", "--sizes", "1X"), "--sizes = '1X'"),
    (("all_reduce", "--gpus", "8", "--sizes", "1G:1M"), "--sizes = '1G:1M'"),
    (("all_reduce", "--gpus", "8", "-f", "1"), "-f = '1'"),
    (("all_gather", "--gpus", "8", "--sizes", "4:16"), "--sizes = '4:16'"),
    (("all_reduce", "--gpus", "8", "--profile", "nowhere"), "--profile = 'nowhere'"),
    (("all_reduce", "--gpus", "8", "--backend", "gpu"), "--backend = 'gpu'"),
    (("all_reduce", "--gpus", "8", "--backend", "real", "--fabric", "wifi"), "--fabric = 'wifi'"),
    (("all_reduce", "--gpus", "8", "--backend", "real", "--iters", "0"), "--iters = '0'"),
])
def test_bad_input_is_one_line_naming_the_option(capsys, args, named):
    assert main(["collective", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("testbed: error: ") and named in err[0], err


def test_bad_kind_from_the_command_line_has_no_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "collective", "allreduc", "--gpus", "8"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == ("testbed: error: KIND = 'allreduc': expected all_reduce, all_gather, reduce_scatter "
                                  "or all_to_all (or nccl-tests' allreduce, allgather, reducescatter, alltoall)")


@pytest.mark.slow
def test_a_small_real_run_prints_a_table_with_positive_times(tmp_path):
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "collective", "allreduce", "--backend", "real",
                          "--gpus", "2", "--sizes", "4K:64K", "-f", "4", "--iters", "3", "--warmup", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "real ranks" in lines[0] and "2 ranks" in lines[0]
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [4096, 16384, 65536]
    for r in rows:
        time_us, algbw, busbw = map(float, r[5:8])
        assert time_us > 0 and algbw == pytest.approx(int(r[0]) / time_us / 1e3, abs=0.006)
        assert busbw == algbw  # 2 ranks: all-reduce's bus factor 2(n-1)/n = 1
        assert r[8] in ("gloo", "nccl")


def test_cluster_shape_errors_name_the_options():
    s = cluster_scenario(32, 4, 2, "h200")
    assert (s.cluster.gpus_per_node, s.cluster.nodes_per_microcluster, s.cluster.microclusters) == (8, 2, 2)
    with pytest.raises(ScenarioError, match="--nodes-per-leaf"):
        cluster_scenario(32, 4, 3, "h200")
