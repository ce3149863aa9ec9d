"""The GPU profiles h100, h800 and h200 (issue 26, item 1): every figure with a source of a
named kind, the published link rates they take, what they carry over from the H200's
measurements and why that holds, and the collective bandwidths they give against NCCL's
published ones. And docs/published.md, which their published sources point to."""

import dataclasses
import fnmatch
import json
import re
import tomllib

import pytest

from testbed.cli.collective import bus_factor, cluster_scenario, sim_rows
from testbed.scenario.profile import field_docs, find_profile, load_profile, save_profile

GPU_PROFILES = ("h100", "h800", "h200")
#: the kinds a [sources] entry starts with (the profiles' header comment defines them)
KINDS = ("spec:", "published:", "measured on H200:", "measured:", "derived:", "assumed:")
#: keys a profile need not state: labels, what calibration measured and did, a retired key
NOT_FIGURES = ("name", "description", "source", "machine", "date", "versions", "sources", "measured.", "calibration.",
               "collectives.discovery_us")
#: names of entries of benchmarks/h200-ceilings.json (possibly a glob: h2d_single_page*MB_us)
CEILING_NAME = re.compile(r"\b(?:mm|bmm|loop|grouped|h2d|d2h|d2d|overlap)_[A-Za-z0-9_*]+")
#: how a published entry names its publication: an arXiv id or an issue / pull request
PUBLICATION = re.compile(r"arXiv \d{4}\.\d{4,5}|[\w./-]*#\d+")
#: the spec sheets' figures (docs/published.md, section 7), TFLOP/s and TB/s
SPEC_BF16, SPEC_FP8, H100_TBPS, H200_TBPS = 989.5, 1979.0, 3.35, 4.8
GiB = 2**30


@pytest.fixture
def ceilings(repo_root):
    return json.loads((repo_root / "benchmarks" / "h200-ceilings.json").read_text())


def figure_keys() -> list[str]:
    return [k for k, _ in field_docs() if not any(k == n or k.startswith(n) for n in NOT_FIGURES)]


def kind_of(entry: str) -> str:
    return next((k for k in KINDS if entry.startswith(k)), "")


# ---- every figure, its source and the source's kind -----------------------------------
@pytest.mark.parametrize("name", GPU_PROFILES)
def test_every_figure_is_stated_with_a_source_of_a_named_kind(name):
    raw = tomllib.loads(find_profile(name).read_text())
    p = load_profile(name)
    assert p.name == name

    def stated(key):
        node = raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    keys = figure_keys()
    assert "compute.peak_tflops.fp8" in keys and "collectives.nvls" in keys
    assert [k for k in keys if not stated(k)] == [], f"{name} leaves figures to a default"
    assert [k for k in keys if not kind_of(p.source_of(k))] == [], f"{name}: a source of no kind in {KINDS}"
    assert [k for k in p.sources if not kind_of(p.sources[k])] == []


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_each_kind_of_source_names_what_it_rests_on(name, ceilings, repo_root):
    """measured / measured on H200 / derived: entries of h200-ceilings.json that exist;
    carried over: why; derived: the spec ratio; published: a publication that
    docs/published.md lists; spec: the document; assumed: a reason."""
    published_doc = (repo_root / "docs" / "published.md").read_text()
    p = load_profile(name)
    for key, entry in p.sources.items():
        kind = kind_of(entry)
        body = entry[len(kind):].strip()
        assert len(body) > 20, f"{name} {key}: no reason given"
        named = CEILING_NAME.findall(entry)
        for n in named:
            # a GEMM shape names its entry without the unit: grouped_E64_T512_H4096_F1408(_tflops)
            assert any(fnmatch.fnmatch(k, n) or k == n + "_tflops" for k in ceilings), \
                f"{name} {key}: {n} is not in h200-ceilings.json"
        if kind in ("measured:", "measured on H200:", "derived:"):
            assert named, f"{name} {key}: names no entry of h200-ceilings.json"
        if kind == "measured:":
            assert name == "h200", f"{name} {key}: only the H200 is measured"
        if kind == "measured on H200:":
            assert "carried over" in entry, f"{name} {key}: does not say why it carries over"
        if kind == "derived:":
            assert f"{H100_TBPS} / {H200_TBPS}" in entry
        if kind == "published:":
            pubs = PUBLICATION.findall(entry)
            assert pubs, f"{name} {key}: names no publication"
            for pub in pubs:
                assert pub.split("/")[-1] in published_doc, f"{name} {key}: {pub} is not in docs/published.md"
        if kind == "spec:":
            assert any(w in entry for w in ("datasheet", "whitepaper", "docs/published.md", "NCCL's API")), key


# ---- the published link rates -------------------------------------------------------------
@pytest.mark.parametrize("name", ["h100", "h200"])
def test_nvlink_4_and_ndr_take_the_nccl_maintainers_rates(name):
    p = load_profile(name)
    assert p.links.nvlink.bandwidth_GBps == 370.0  # nccl-tests#212
    assert "nccl-tests#212" in p.source_of("links.nvlink.bandwidth_GBps")
    assert 46.0 <= p.links.nic.bandwidth_GBps <= 49.0  # 46-48 (nccl-tests#290), 48-49 (#267)
    assert p.links.nic.bandwidth_GBps == 48.0
    nic = p.source_of("links.nic.bandwidth_GBps")
    assert "nccl-tests#290" in nic and "#267" in nic


def test_h800_takes_deepseeks_nvlink_and_the_same_nic():
    p = load_profile("h800")
    assert p.links.nvlink.bandwidth_GBps == 160.0
    cited = p.source_of("links.nvlink.bandwidth_GBps")
    assert "arXiv 2412.19437" in cited and "DeepEP" in cited and "DeepSeek-V3#28" in cited
    assert p.links.nvlink.bandwidth_GBps < 200.0  # the H800's NVLink: 400 GB/s bidirectional
    assert p.links.nic.bandwidth_GBps == load_profile("h100").links.nic.bandwidth_GBps == 48.0


def test_h800_is_the_h100_but_its_nvlink():
    """The H800 SXM is the H100 SXM with NVLink (and fp64, not modelled) cut: every other
    figure is the same."""
    labels = ("name", "description", "source", "machine", "sources")
    a, b = load_profile("h100").to_dict(), load_profile("h800").to_dict()
    for d in (a, b):
        for k in labels:
            d.pop(k)
        d["links"].pop("nvlink")
    assert a == b
    assert load_profile("h800").links.nvlink.latency_us == load_profile("h100").links.nvlink.latency_us


# ---- what the H100 and H800 carry over from the H200, and why it holds -----------------------
@pytest.mark.parametrize("name", ["h100", "h800"])
def test_compute_bound_figures_are_the_h200_measurements(name, ceilings):
    p, h200 = load_profile(name), load_profile("h200")
    assert p.compute.peak_tflops.bf16 == pytest.approx(ceilings["mm_bf16_8192_tflops"], abs=0.005)
    assert p.compute.peak_tflops == h200.compute.peak_tflops
    assert p.compute.efficiency == h200.compute.efficiency
    assert p.compute.sm_count == h200.compute.sm_count == 132
    assert p.copy == h200.copy and p.links.pcie == h200.links.pcie
    # each measured expert GEMM at its point's tokens, as the h200 profile reproduces it
    for kind, e, t, h, f in (("grouped", 64, 512, 4096, 1408), ("loop", 8, 4096, 4096, 14336)):
        tflops = p.compute.efficiency_at(kind, t) * p.compute.peak_tflops.bf16
        assert tflops == pytest.approx(ceilings[f"{kind}_E{e}_T{t}_H{h}_F{f}_tflops"], rel=1e-3)


@pytest.mark.parametrize("name", ["h100", "h800"])
def test_every_measured_gemm_shape_is_compute_bound_on_the_slower_memory(name, ceilings):
    """The premise of carrying the efficiencies over: each GEMM measured on the H200 does
    more FLOPs per byte of its operands (bf16: 2 bytes an element) than the ridge of the
    H100's roofline, its ceiling over its memory bandwidth."""
    c = load_profile(name).compute
    ridge = c.peak_tflops.bf16 * 1e12 / (c.memory_GBps * 1e9)  # FLOP per byte
    assert 255 < ridge < 265  # 771.18 TFLOP/s / 2,968.9 GB/s, as the sources say (260)
    shapes = [(int(m[1]), int(m[2]), int(m[3])) for k in ceilings
              if (m := re.fullmatch(r"(?:grouped|loop|bmm)_E\d+_T(\d+)_H(\d+)_F(\d+)_tflops", k))]
    shapes += [(int(m[1]),) * 3 for k in ceilings if (m := re.fullmatch(r"mm_bf16_(\d+)_tflops", k))]
    assert len(shapes) == 11
    intensity = [2 * t * h * f / (2 * (h * f + t * h + t * f)) for t, h, f in shapes]
    assert min(intensity) == pytest.approx(343.94, rel=1e-4)  # the sources' 344: E64 T512 H4096 F1408
    assert min(intensity) > ridge


@pytest.mark.parametrize("name", ["h100", "h800"])
def test_memory_bandwidth_is_the_measured_copy_scaled_by_the_spec_ratio(name, ceilings):
    c = load_profile(name).compute
    assert c.memory_GBps == pytest.approx(ceilings["d2d_GBps_rw"] * H100_TBPS / H200_TBPS, abs=0.05)
    assert load_profile(name).source_of("compute.memory_GBps").startswith("derived:")
    assert c.device_memory_GB == 80.0
    assert load_profile("h200").compute.memory_GBps == pytest.approx(ceilings["d2d_GBps_rw"], abs=0.05)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_fp8_is_the_published_kernel_figure(name, ceilings):
    """No fp8 GEMM is measured here, so the fp8 ceiling is a published kernel figure
    (DeepGEMM's H800 fp8 GEMMs, docs/published.md section 9: the rate its shape model fits
    there, at the 8192^3 shape), below the spec's 1,979."""
    assert not [k for k in ceilings if "fp8" in k]  # a measured fp8 GEMM would replace the published one
    peak = load_profile(name).compute.peak_tflops
    assert peak.fp8 == pytest.approx(1390.9, abs=0.05)
    assert peak.fp8 < SPEC_FP8
    cited = load_profile(name).source_of("compute.peak_tflops.fp8")
    assert cited.startswith("published: a kernel figure") and "DeepGEMM" in cited


# ---- the bandwidths `testbed collective` prints -----------------------------------------------
def _busbw(profile: str, gpus: int, nodes: int, kind: str = "all_reduce", size: int = GiB) -> tuple[float, str]:
    """GB/s and algorithm of the CLI's row for ``size``: ``sim_rows``, what ``testbed
    collective KIND --gpus --nodes --profile`` prints."""
    [row] = sim_rows(cluster_scenario(gpus, nodes, None, profile), kind, [size])
    return size / row["seconds"] / 1e9 * bus_factor(kind, gpus), row["algorithm"]


def _with(tmp_path, name: str, **algorithm) -> str:
    p = load_profile(name)
    c = p.collectives
    c = dataclasses.replace(c, algorithm=dataclasses.replace(c.algorithm, **algorithm), nvls=c.nvls or "nvls" in
                            algorithm.values())
    return str(save_profile(dataclasses.replace(p, collectives=c), tmp_path / f"{name}-{'-'.join(algorithm.values())}.toml"))


# At 1 GiB the fixed costs (15 us a call, 2 (p-1) link latencies of 1-3 us) are under 2% of
# the transfer (5.4 ms at 370 GB/s); the flow model's bandwidth term is exact, so each
# busbw lies within 2% under its bound.
def test_h100_all_reduce_on_two_nodes_is_bound_by_nvlinks_370(tmp_path):
    """16 GPUs on 2 nodes: NCCL's 8 rings cross on 8 rails, so busbw = min(NVLink, 8 x NIC)
    = min(370, 384): the published 370. The printed (auto) row is the tree, which puts
    2 (g-1)/g S on each NVLink port against the ring's 2 (p-1)/p S: 370 x (15/8) / (7/4)."""
    ring, alg = _busbw(_with(tmp_path, "h100", all_reduce="ring"), 16, 2)
    assert alg == "ring" and 0.98 * 370 < ring <= 370
    printed, alg = _busbw("h100", 16, 2)
    assert alg == "tree" and printed > ring
    assert 0.98 * 370 * 15 / 14 < printed <= 370 * 15 / 14


def test_h100_all_reduce_across_nodes_of_one_gpu_is_bound_by_the_nics_48():
    busbw, alg = _busbw("h100", 16, 16)
    assert alg == "ring" and 0.98 * 48 < busbw <= 48


def test_h800_all_reduce_in_a_node_is_bound_by_its_160():
    busbw, alg = _busbw("h800", 8, 1)
    assert alg == "ring" and 0.98 * 160 < busbw <= 160


@pytest.mark.parametrize("name, published", [("h100", 480.0), ("h200", 480.0), ("h800", 215.0)])
def test_nvls_stays_off_while_the_model_would_overstate_it(tmp_path, name, published):
    """At the profile's NVLink rate the simulator's NVLS all-reduce (S (1 + 1/g) each way a
    port) gives 2 (g-1)/(g+1) x the link rate, more than 15% over what NCCL reaches with NVLS
    (nccl-tests#212 on H100, NVIDIA/nccl#1374 on H800): the profiles keep it off, and say so.
    When NVLS is modelled at its own rate, this fails and the flag can be turned on."""
    p = load_profile(name)
    assert p.collectives.nvls is False
    busbw, alg = _busbw(_with(tmp_path, name, all_reduce="nvls"), 8, 1)
    link = p.links.nvlink.bandwidth_GBps
    assert alg == "nvls" and 0.98 * link * 14 / 9 < busbw <= link * 14 / 9
    assert busbw > 1.15 * published
    cited = p.source_of("collectives.nvls")
    assert cited.startswith("assumed: off") and f"{published:.0f}" in cited and f"{link * 14 / 9:.0f}" in cited


# ---- docs/published.md ------------------------------------------------------------------------
def test_published_doc_states_the_rule_and_its_arithmetic_holds(repo_root):
    doc = (repo_root / "docs" / "published.md").read_text()
    assert "Nothing is fitted to these figures" in doc and "`fitted_share` is 0" in doc
    ratios = re.findall(r"(\d+(?:\.\d+)?) / (\d+(?:\.\d+)?) = (\d\.\d{3})\b", doc)
    assert len(ratios) >= 11
    for a, b, c in ratios:
        assert round(float(a) / float(b), 3) == pytest.approx(float(c), abs=1e-9), f"{a} / {b} = {c}"
    # Table 3: TFLOP/s per GPU = MFU x 989.5, to the 0.1 printed
    rows = re.findall(r"^\| fold-T3-\d .*\| (\d+\.\d)% \| (\d+\.\d) \|$", doc, re.MULTILINE)
    assert len(rows) == 5
    for mfu, tflops in rows:
        assert float(tflops) == pytest.approx(float(mfu) / 100 * SPEC_BF16, abs=0.051)
