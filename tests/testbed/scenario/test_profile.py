"""Machine profiles: built-ins, lookup order, validation naming the key, round trip."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from testbed.core.errors import ScenarioError
from testbed.scenario.profile import (
    BUILTINS,
    MiB,
    field_docs,
    find_profile,
    load_profile,
    profile_from_dict,
    save_profile,
)


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_load_and_document_their_source(name):
    p = load_profile(name)
    assert p.name == name
    assert len(p.source) > 100 and p.description and p.machine


def test_h200_is_seeded_from_the_ceilings():
    p = load_profile("h200")
    assert p.compute.peak_tflops.bf16 == pytest.approx(771.18)
    # grouped_E64_T512: 595.23 TFLOP/s at 512 tokens per expert; loop_E8_T4096: 686.97
    assert p.compute.efficiency_at("grouped", 512) * 771.18 == pytest.approx(595.23, rel=1e-3)
    assert p.compute.efficiency_at("loop", 4096) * 771.18 == pytest.approx(686.97, rel=1e-3)
    assert p.links.nvlink.bandwidth_GBps == 370 and p.links.nic.bandwidth_GBps == 48
    assert p.copy.overlap == 0.864
    assert p.copy.GBps(16 * MiB) == pytest.approx(54.71)
    # the fitted copy latency reproduces the measured single-page copies
    assert p.copy.time(16 * MiB) == pytest.approx(326.3e-6, rel=0.05)
    assert p.copy.time(1 * MiB) == pytest.approx(29.0e-6, rel=0.05)


def test_a100_seed_and_local_cpu_figures():
    a = load_profile("a100-seed")
    assert (a.links.nvlink.bandwidth_GBps, a.links.nic.bandwidth_GBps, a.compute.peak_tflops.bf16) == (240, 23, 312)
    assert "ssumption" in a.source
    c = load_profile("local-cpu")
    assert c.collectives.algorithm.reduce_scatter == "all_reduce"
    assert c.compute.peak("fp32") == pytest.approx(50e9)
    assert "calibrate" in c.source and "rough" in c.source.lower()


def test_interpolation_is_linear_in_log_tokens_and_clamped():
    e = load_profile("h200").compute
    lo, hi = e.efficiency_at("grouped", 512), e.efficiency_at("grouped", 1024)
    assert e.efficiency_at("grouped", math.sqrt(512 * 1024)) == pytest.approx((lo + hi) / 2)
    assert e.efficiency_at("grouped", 1) == lo
    assert e.efficiency_at("grouped", 10**6) == e.efficiency_at("grouped", 4096)
    assert np.allclose(e.efficiency_at("loop", np.array([512, 4096])), [0.4571, 0.8908])
    with pytest.raises(ValueError):
        e.efficiency_at("bmm", 10)


def test_every_key_is_documented():
    docs = dict(field_docs())
    assert "links.nvlink.bandwidth_GBps" in docs and "copy.overlap" in docs
    assert all(doc for doc in docs.values())


def test_lookup_order(tmp_path, monkeypatch):
    builtin = find_profile("h200")
    assert builtin.parent.name == "profiles" and builtin.parent.parent.name == "scenario"
    monkeypatch.chdir(tmp_path)
    data = load_profile("h200").to_dict()
    data["description"] = "calibrated"
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "h200.toml").write_text(tomli_w.dumps(data))
    assert load_profile("h200").description == "calibrated"  # ./profiles wins
    other = tmp_path / "mine.toml"
    other.write_text(tomli_w.dumps(data))
    assert load_profile(str(other)).description == "calibrated"  # a path
    assert load_profile("h200", search_dirs=[builtin.parent]).description != "calibrated"


def test_missing_profile_names_the_scenario_field():
    with pytest.raises(ScenarioError) as e:
        load_profile("no-such-machine")
    assert e.value.field == "cluster.profile" and "h200" in e.value.reason


def _broken(tmp_path, edit):
    data = load_profile("h200").to_dict()
    edit(data)
    path = tmp_path / "h200.toml"
    path.write_text(tomli_w.dumps(data))
    with pytest.raises(ScenarioError) as e:
        load_profile(str(path))
    return e.value


def test_bad_values_name_the_profile_key(tmp_path):
    err = _broken(tmp_path, lambda d: d["links"]["nvlink"].update(bandwidth_GBps=-1))
    assert err.field == "profile h200: links.nvlink.bandwidth_GBps" and "> 0" in err.reason
    err = _broken(tmp_path, lambda d: d["links"]["nic"].update(latency_us="fast"))
    assert err.field == "profile h200: links.nic.latency_us"
    err = _broken(tmp_path, lambda d: d["collectives"]["algorithm"].update(all_reduce="butterfly"))
    assert err.field.endswith("collectives.algorithm.all_reduce") and "ring" in err.reason and "auto" in err.reason
    err = _broken(tmp_path, lambda d: d["compute"]["efficiency"].update(grouped=[[512, 0.5], [256, 0.6]]))
    assert err.field.endswith("compute.efficiency.grouped") and "increasing" in err.reason
    err = _broken(tmp_path, lambda d: d["compute"]["efficiency"].update(loop=[[512, 1.5]]))
    assert "(0, 1]" in err.reason
    err = _broken(tmp_path, lambda d: d["copy"].update(overlapp=0.5))
    assert err.field == "profile h200: copy.overlapp" and "overlap" in err.reason
    err = _broken(tmp_path, lambda d: d["overheads"].pop("router_us"))
    assert err.field == "profile h200: overheads.router_us" and "missing" in err.reason


def test_collective_capabilities_and_channels_are_checked(tmp_path):
    err = _broken(tmp_path, lambda d: d["collectives"].update(channels=2.5))
    assert err.field == "profile h200: collectives.channels" and "whole" in err.reason
    err = _broken(tmp_path, lambda d: d["collectives"].update(channels=-1))
    assert err.field == "profile h200: collectives.channels"
    err = _broken(tmp_path, lambda d: d["collectives"].update(all_to_all_peer_us=-1.0))
    assert err.field == "profile h200: collectives.all_to_all_peer_us"
    err = _broken(tmp_path, lambda d: d["collectives"].update(pxn="yes"))
    assert err.field == "profile h200: collectives.pxn" and "true or false" in err.reason
    # an algorithm that needs a switch capability the profile does not claim
    err = _broken(tmp_path, lambda d: d["collectives"]["algorithm"].update(all_reduce="nvls"))
    assert err.field == "profile h200: collectives.algorithm.all_reduce" and "collectives.nvls" in err.reason
    err = _broken(tmp_path, lambda d: d["collectives"]["algorithm"].update(all_reduce="collnet"))
    assert "collectives.collnet" in err.reason
    d = load_profile("h200").to_dict()
    d["collectives"].update(nvls=True, channels=4)
    d["collectives"]["algorithm"].update(all_reduce="nvls", all_gather="nvls")
    p = profile_from_dict(d, "ok")
    assert p.collectives.nvls is True and p.collectives.channels == 4 and p.collectives.algorithm.all_gather == "nvls"


def test_collective_defaults_keep_older_profiles_loading():
    d = load_profile("h200").to_dict()
    for key in ("channels", "all_to_all_peer_us", "pxn", "nvls", "collnet"):
        del d["collectives"][key]
    c = profile_from_dict(d, "old").collectives
    assert (c.channels, c.all_to_all_peer_us, c.pxn, c.nvls, c.collnet) == (1, 0.0, False, False, False)  # an older file meant one ring in rank order
    assert load_profile("h200").collectives.algorithm.all_reduce == "auto"
    assert load_profile("a100-seed").collectives.algorithm.all_reduce == "auto"
    for gloo in ("local-cpu", "emulated"):  # gloo: one ring in rank order, its reduce-scatter an all-reduce
        g = load_profile(gloo).collectives
        assert (g.channels, g.algorithm.all_reduce, g.algorithm.reduce_scatter) == (1, "ring", "all_reduce")
    docs = dict(field_docs())
    for key in ("channels", "all_to_all_peer_us", "pxn", "nvls", "collnet"):
        assert docs[f"collectives.{key}"]
    assert "us per message" in docs["collectives.all_to_all_peer_us"]


def test_unreadable_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("links = [")
    with pytest.raises(ScenarioError) as e:
        load_profile(str(path))
    assert e.value.field == "cluster.profile"


@pytest.mark.parametrize("name", BUILTINS)
def test_save_round_trips_exactly(tmp_path, name):
    p = load_profile(name)
    path = save_profile(p, tmp_path / f"{name}.toml")
    q = load_profile(str(path))
    assert q == p and q.to_dict() == p.to_dict()
    assert profile_from_dict(p.to_dict(), name) == p


def test_profile_module_needs_no_simulator():
    code = "import sys, testbed.scenario.profile; assert 'simpy' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])


# ---- every figure in the file, with its source (issue 22, item 14) ---------------------
#: keys a profile need not state: its labels, what calibration measured and did, a retired key
NOT_FIGURES = ("name", "description", "source", "machine", "date", "versions", "sources", "measured.", "calibration.",
               "collectives.discovery_us")
#: words an entry of [sources] cites a source with, else it says "assumed"
CITES = ("measured", "spec", "h200-ceilings.json", "docs/", "nccl")


def test_no_gemm_curve_has_a_hidden_default(tmp_path):
    """Every kind of GEMM names its curve, and a profile must state each one."""
    for kind in ("attention", "dense", "grouped", "loop"):
        err = _broken(tmp_path, lambda d: d["compute"]["efficiency"].pop(kind))
        assert err.field == f"profile h200: compute.efficiency.{kind}" and "missing" in err.reason


@pytest.mark.parametrize("name", ["h200", "a100-seed"])
def test_every_figure_of_a_builtin_gpu_profile_is_in_its_file_with_a_source(name):
    import tomllib

    raw = tomllib.loads(find_profile(name).read_text())
    p = load_profile(name)

    def stated(key):
        node = raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    keys = [k for k, _ in field_docs() if not any(k == n or k.startswith(n) for n in NOT_FIGURES)]
    assert "compute.efficiency.attention" in keys and "compute.block_half_width" in keys
    missing = [k for k in keys if not stated(k)]
    assert not missing, f"{name} leaves these to a default: {missing}"
    unsourced = [k for k in keys if not p.source_of(k)]
    assert not unsourced, f"{name} gives no source for {unsourced}"
    vague = [k for k in keys if "assumed" not in p.source_of(k) and not any(w in p.source_of(k).lower() for w in CITES)]
    assert not vague, f"{name}: neither a source nor 'assumed' for {vague}"


def test_h200_dense_gemms_are_the_measured_matmuls(repo_root):
    import json

    ceilings = json.loads((repo_root / "benchmarks" / "h200-ceilings.json").read_text())
    c = load_profile("h200").compute
    for rows in (8192, 16384):
        tflops = c.efficiency_at("dense", rows) * c.peak_tflops.bf16
        assert tflops == pytest.approx(ceilings[f"mm_bf16_{rows}_tflops"], rel=1e-3)
    cited = load_profile("h200").source_of("compute.efficiency.dense")
    assert "mm_bf16_8192_tflops" in cited and "mm_bf16_16384_tflops" in cited
    assert c.efficiency_at("dense", 1024) == c.efficiency_at("dense", 8192)  # clamped below, and the source says so
    assert "assumed" in cited


def test_a100_seed_is_one_part_the_40gb_sxm4():
    """Capacity, memory bandwidth and labels of the A100 SXM4 40GB (NVIDIA's datasheet:
    40 GB HBM2 at 1,555 GB/s; the 80 GB part has 2,039 GB/s)."""
    a = load_profile("a100-seed")
    assert a.compute.device_memory_GB == 40.0
    assert a.compute.memory_GBps <= 1555.0  # achieved, below the 40GB part's spec
    for text in (a.description, a.machine):
        assert "40GB" in text and "80GB" not in text
    assert "2,039" not in a.source_of("compute.memory_GBps") and "1,555" in a.source_of("compute.memory_GBps")
    assert "80GB" not in a.source and "A100 SXM4 40GB" in a.source_of("compute.device_memory_GB")


def test_the_calibration_record_round_trips_and_builtins_have_none(tmp_path):
    from dataclasses import replace

    from testbed.scenario.profile import CALIBRATE_TOOL, Calibration

    for name in BUILTINS:
        cal = load_profile(name).calibration
        assert not cal.made_by_calibrate and cal.scenarios == ()
    row = {"name": "a", "world": 2, "gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1,
           "ep_size": 2, "hidden": 96, "ffn_hidden": 192, "num_experts": 12, "top_k": 2, "num_layers": 2,
           "dtype": "fp32", "tokens_per_rank": 256, "seq_len": 0, "token_strategy": "alltoall",
           "expert_sync": "allreduce"}
    p = replace(load_profile("local-cpu"), calibration=Calibration(tool=CALIBRATE_TOOL, device="cpu",
                                                                   fabric="loopback", quick=True, scenarios=(row,)))
    q = load_profile(save_profile(p, tmp_path / "cal.toml"))
    assert q == p and q.calibration.made_by_calibrate and q.calibration.scenarios == (row,)
    docs = dict(field_docs())
    assert "calibration.scenarios" in docs and "sources" in docs
    err = _broken(tmp_path, lambda d: d.update(calibration={"tool": CALIBRATE_TOOL, "device": "tpu"}))
    assert err.field == "profile h200: calibration.device" and "cuda" in err.reason
    err = _broken(tmp_path, lambda d: d.update(calibration={"scenarios": [{"name": "a", "world": 2}]}))
    assert err.field == "profile h200: calibration.scenarios[0]" and "tokens_per_rank" in err.reason
