"""Machine profiles: the link, compute, copy and collective figures of one machine.

A profile is one TOML file. The simulator times work with it; the real backend and
``testbed calibrate`` write measured ones. Every key carries its unit in its name:
``GBps`` = 1e9 bytes/s per direction, ``us`` = microseconds, ``ms`` = milliseconds,
``MiB`` = 2**20 bytes, ``tflops`` = 1e12 FLOP/s. Sections (each key is documented in the
dataclasses below; ``field_docs()`` lists them):

- top level: name, description, source, machine, date, ``[versions]`` (free strings);
- ``[links.nvlink|nic|spine|pcie]``: bandwidth per direction and latency per link (M21);
- ``[compute]``: peak FLOP/s per dtype; efficiency curves, one per kind of GEMM (M22):
  expert GEMMs by tokens per expert for the grouped and the per-expert loop kernel, dense
  GEMMs (attention projections, dense FFNs, output head, router gate) by rows, and flash
  attention's core by sequence length; memory bandwidth, launch; optionally ``[compute.gemm]``,
  GEMM efficiency by shape (tiles over the SMs, K depth) beside the curves;
- ``[copy]``: host<->device copy bandwidth by page size, per-copy latency, overlap;
- ``[collectives]``: algorithm per collective kind (or ``auto``: the least predicted
  time, as NCCL's tuner picks), channels, PXN and switch-side reduction capabilities
  (NVLink SHARP, in-network reduction), per-call, per-step and per-peer latency,
  communicator creation (M10), discovery;
- ``[protocol]`` (optional): what the transport adds on the wire (headers, acknowledgements),
  for links whose figures are wire rates (an emulated cluster's shaped links);
- ``[overheads]``: heat-map update and router fixed costs;
- ``[sources]`` (optional): where each figure comes from, by dotted key (an entry for a
  section covers the keys in it); built-in GPU profiles give one for every figure;
- ``[measured]`` and ``[calibration]`` (optional, written by ``testbed calibrate``): what it
  measured, and what it did (device, network, the scenarios whose runs it fitted), so a
  validation can check that it judges only points calibration never saw.

Lookup (``load_profile``): an existing file path, else ``./profiles/NAME.toml`` (user or
calibrated profiles, relative to the current directory), else the built-in
``testbed/scenario/profiles/NAME.toml``. Bad values raise ``ScenarioError`` naming the key
(how a key is declared, read and checked: ``testbed.scenario.profile_fields``).
No simulator or torch import here: both backends share this module.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from testbed.core.checks import efficiency, fraction, non_negative, positive
from testbed.core.errors import ScenarioError
from testbed.scenario.profile_fields import (
    _build,
    _curve,
    _error,
    _flag,
    _num,
    _optional_int,
    _optional_num,
    _optional_text,
    _plain,
    _rows,
    _section,
    _text,
)

BUILTIN_DIR = Path(__file__).parent / "profiles"
BUILTINS = ("local-cpu", "emulated", "a100-seed", "h200", "h100", "h800")
#: algorithms the simulator can time, per collective kind (first = standard); ``auto``
#: picks, per op, the one with the least predicted time alone on the fabric
ALGORITHMS = {
    "all_reduce": ("ring", "tree", "hierarchical", "nvls", "collnet", "auto"),
    "reduce_scatter": ("ring", "all_reduce", "hierarchical", "nvls", "auto"),  # all_reduce: gloo reduces the full tensor
    "all_gather": ("ring", "hierarchical", "nvls", "auto"),
    "all_to_all_v": ("direct",),
}
#: algorithms that need a capability of the profile: algorithm -> collectives flag
NEEDS = {"nvls": "nvls", "collnet": "collnet"}
MiB = 2**20
#: the kinds of GEMM a profile gives an efficiency curve for (``compute.efficiency``)
GEMM_KINDS = ("grouped", "loop", "dense", "attention")
#: what ``testbed calibrate`` writes as ``calibration.tool``
CALIBRATE_TOOL = "testbed calibrate"


def _log_interp(x, points: tuple[tuple[float, float], ...]):
    """Piecewise-linear interpolation in log(x), clamped to the end values."""
    xs = np.log([p[0] for p in points])
    ys = np.array([p[1] for p in points])
    out = np.interp(np.log(np.maximum(np.asarray(x, dtype=np.float64), 1e-300)), xs, ys)
    return float(out) if np.ndim(out) == 0 else out


# ---- sections ------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkFigures:
    """One link class. Bandwidth is per direction; latency is per link crossed."""

    bandwidth_GBps: float = _num("bandwidth per direction, 1e9 bytes/s")
    latency_us: float = _num("latency of one link (a path adds those of its links), us", non_negative)

    @property
    def bandwidth(self) -> float:
        """bytes/s"""
        return self.bandwidth_GBps * 1e9

    @property
    def latency(self) -> float:
        """seconds"""
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class Links:
    """The link classes of the three-level topology (M21) plus PCIe."""

    nvlink: LinkFigures = _section(LinkFigures, "GPU <-> NVLink switch of its node (usable, per direction)")
    nic: LinkFigures = _section(LinkFigures, "GPU NIC <-> InfiniBand leaf of its micro-cluster (achieved)")
    spine: LinkFigures = _section(LinkFigures, "leaf <-> spine, per GPU-equivalent share before leaf_spine_oversubscription")
    pcie: LinkFigures = _section(LinkFigures, "GPU <-> host memory of its node (pinned copies)")


@dataclass(frozen=True)
class PeakTflops:
    """Dense matmul ceiling per dtype, 1e12 FLOP/s."""

    fp32: float = _num("fp32 ceiling, TFLOP/s")
    bf16: float = _num("bf16 ceiling, TFLOP/s")
    fp16: float = _num("fp16 ceiling, TFLOP/s")
    fp8: float = _optional_num("fp8 ceiling (model.gemm_dtype = fp8's GEMMs), TFLOP/s; 0 = no fp8 matmul "
                               "(fp8 GEMMs are refused on such a machine); default 0", 0.0)


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak reached by each kind of GEMM (M22), one curve per kind, each named
    where it is used (``sim.hardware.compute``): points are (x, efficiency), interpolated in log(x)
    and clamped at both ends. No curve has a default: a profile states every one (and its
    source in ``[sources]``)."""

    grouped: tuple[tuple[float, float], ...] = _curve(
        "expert GEMMs as one grouped GEMM: (tokens per expert, fraction of peak)", efficiency)
    loop: tuple[tuple[float, float], ...] = _curve(
        "expert GEMMs as one GEMM per expert: (tokens per expert, fraction of peak)", efficiency)
    dense: tuple[tuple[float, float], ...] = _curve(
        "dense GEMMs (attention's Q, K, V and O projections, dense FFNs, the output head, the router's gate): "
        "(rows, i.e. tokens of the rank, fraction of peak)", efficiency)
    attention: tuple[tuple[float, float], ...] = _curve(
        "flash attention's core (scores and weighted values, forward and backward): (sequence length, "
        "fraction of peak)", efficiency)


@dataclass(frozen=True)
class GemmShapes:
    """GEMM efficiency by shape (``sim.hardware.gemm_efficiency``, issue 26): a GEMM of
    another shape than a curve's measured one runs at the curve's efficiency times the
    ratio of the two shapes' tile-and-wave and K-depth terms. Optional: without tiles
    (``tile_m = 0``) the curves alone time every GEMM, by rows or tokens per expert."""

    tile_m: int = _optional_int("output tile rows of the GPU's GEMM kernels (Hopper cuBLAS / CUTLASS: 128), "
                                "elements; 0 = no shape model; default 0", 0)
    tile_n: int = _optional_int("output tile columns (Hopper cuBLAS / CUTLASS: 256), elements; default 0", 0)
    k_fixed: float = _optional_num("a tile's fixed time (pipeline fill, epilogue) as elements of k at the bf16 / "
                                   "fp16 rate: a GEMM of depth k runs its tiles at k / (k + k_fixed); default 0", 0.0)
    k_fixed_fp8: float = _optional_num("k_fixed of fp8 GEMMs (the fixed time over a main loop twice as fast), "
                                       "elements; default 0", 0.0)
    dense_reference: int = _optional_int("m = n = k of the shape compute.efficiency.dense was measured at, "
                                         "elements; default 8192", 8192, positive)
    expert_reference: tuple = _rows(
        "the shapes compute.efficiency.grouped and loop were measured at, one a curve point: tokens per expert "
        "(the curve's x), experts in the launch, hidden and ffn (two GEMMs forward: T x H times H x F and "
        "T x F times F x H)", tokens=int, experts=int, hidden=int, ffn=int)
    multistream_call_us: float = _optional_num(
        "sim.expert_kernel = multistream (Transformer Engine's GroupedLinear: one cuBLAS GEMM per expert over "
        "four streams): the fixed time of one such call beyond its GEMMs, us; default 0", 0.0)


@dataclass(frozen=True)
class ComputeFigures:
    """Roofline figures of one GPU (or one CPU rank)."""

    peak_tflops: PeakTflops = _section(PeakTflops, "matmul ceilings per dtype")
    efficiency: Efficiency = _section(Efficiency, "GEMM efficiency curves, one per kind of GEMM")
    memory_GBps: float = _num("device memory bandwidth, bytes read + written per s / 1e9")
    device_memory_GB: float = _num("device memory of one GPU (one CPU rank's share on CPU), 1e9 bytes")
    launch_us: float = _num("fixed cost of one kernel launch (one op on CPU), us", non_negative)
    block_half_width: float = _optional_num("M14 page pipelining: the contraction width (elements) at which a GEMM "
                                            "on one page's block of rows runs at half the efficiency it has at full "
                                            "width; an assumption (256) unless measured", 256.0, positive)
    sm_count: int = _optional_int(
        "streaming multiprocessors (SMs) of one GPU, count: comm.token_strategy = deepep's kernels hold "
        "comm.deepep_sms of them while they run, and compute that overlaps them runs on the others; 0 = no SMs to "
        "take (CPU ranks: the exchange runs on the rank's own thread, beside no kernel), deepep then slows no "
        "compute; default 0", 0)
    host_cores: float = field(default=0.0, metadata={
        "doc": "CPU backends: cores the ranks of the machine share, rank r pinned to core r % host_cores (the "
               "simulator's flow model shares each core between the ranks computing on it); 0 = every device "
               "computes alone", "kind": "float", "check": non_negative, "optional": True})
    gemm: GemmShapes = field(default_factory=GemmShapes, metadata={
        "doc": "GEMM efficiency by shape beside the curves (optional; absent: the curves alone)", "kind": "section",
        "cls": GemmShapes, "optional": True})

    def peak(self, dtype: str) -> float:
        """FLOP/s of ``dtype`` (fp32, bf16, fp16, fp8; 0 where the machine has none)."""
        return getattr(self.peak_tflops, dtype) * 1e12

    def efficiency_at(self, kernel: str, tokens):
        """Fraction of peak of ``kernel`` (``GEMM_KINDS``): grouped or loop at ``tokens``
        per expert, dense at ``tokens`` rows, attention at a sequence of ``tokens``."""
        if kernel not in GEMM_KINDS:
            raise ValueError(f"unknown kernel {kernel!r} ({', '.join(GEMM_KINDS)})")
        return _log_interp(tokens, getattr(self.efficiency, kernel))


@dataclass(frozen=True)
class CopyFigures:
    """Host <-> device copies of pages (M12-M16)."""

    table: tuple[tuple[float, float], ...] = _curve("(page size MiB, GBps) of streamed pinned copies", positive)
    latency_us: float = _num("fixed cost per copy, us", non_negative)
    overlap: float = _num("fraction of copy time hidden behind concurrent compute", fraction)
    # a CPU rank reads and updates an expert's weights page by page (real/paging/paged_store.py):
    # each page costs the host a fixed time, whatever its size (0: GPU profiles)
    read_page_us: float = _optional_num("host cost, us, of reading one page of an expert's weights to compute "
                                        "(measured by testbed calibrate)", 0.0)
    update_page_us: float = _optional_num("host cost, us, of updating one page of an expert's weights in the "
                                          "optimizer step (measured by testbed calibrate)", 0.0)

    def GBps(self, page_bytes):
        """Copy bandwidth (1e9 bytes/s) for pages of ``page_bytes``, interpolated in log size."""
        return _log_interp(np.asarray(page_bytes, dtype=np.float64) / MiB, self.table)

    def time(self, page_bytes):
        """Seconds to copy one page of ``page_bytes``: latency + bytes / bandwidth."""
        b = np.asarray(page_bytes, dtype=np.float64)
        out = self.latency_us * 1e-6 + b / (np.asarray(self.GBps(b)) * 1e9)
        return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True)
class Algorithms:
    """Algorithm the communication library runs for each collective kind (M21; the
    simulator's decomposition of each is in ``sim.network.collective_algorithms``). ``auto`` picks, per
    op, the algorithm with the least predicted time alone on the fabric (alpha-beta: fixed
    latency + bytes of the busiest link / its bandwidth), as NCCL's tuner does, among ring,
    tree (all_reduce) and those the profile's capabilities allow (nvls, collnet)."""

    all_reduce: str = _text("ring (one ring per channel across nodes), tree (double binary trees across nodes, a "
                            "chain in each node: latency ~ log2 nodes), hierarchical (reduce-scatter in each node, "
                            "all-reduce across nodes, all-gather in each node, one after the other), nvls (NVLink "
                            "SHARP in each node; needs collectives.nvls), collnet (in-network reduction across "
                            "nodes; needs collectives.collnet) or auto", ALGORITHMS["all_reduce"])
    reduce_scatter: str = _text("ring, all_reduce (the library all-reduces the full tensor: gloo), hierarchical (in "
                                "each node, then across), nvls (in one node; needs collectives.nvls) or auto",
                                ALGORITHMS["reduce_scatter"])
    all_gather: str = _text("ring, hierarchical (across nodes, then in each node), nvls (in one node; needs "
                            "collectives.nvls) or auto", ALGORITHMS["all_gather"])
    all_to_all_v: str = _text("direct (one message per pair)", ALGORITHMS["all_to_all_v"])


@dataclass(frozen=True)
class CollectiveFigures:
    """Communication library costs and capabilities."""

    algorithm: Algorithms = _section(Algorithms, "algorithm per collective kind")
    latency_us: float = _num("fixed software cost of one collective call, us", non_negative)
    group_create_ms: float = _num("creating a new communicator for an uncached group (M10), ms", non_negative)
    group_create_scope: str = _text("who pays for a new communicator: members (NCCL) or all ranks (torch new_group on gloo)", ("members", "all"))
    communicator_MiB: float = _num("device memory one communicator holds on each member (M10), MiB", non_negative)
    discovery_us: float = _optional_num("retired: discovery (M10) is the all-gather of every rank's kept-expert bit "
                                        "masks, timed as any collective (StepRecord.discovery_s); older profiles "
                                        "that still give a figure load, and it is not used", 0.0)
    step_latency_us: float = _optional_num(
        "software cost of each sequential step of an algorithm (a message arrives, the rank wakes and sends the "
        "next one; on CPU ranks that share cores, mostly the scheduler's wake-up), us; default 0", 0.0)
    channels: int = _optional_int(
        "channels (count) a ring or tree collective whose members span two or more nodes runs as, its bytes split "
        "evenly over them; channel c's node crossings go through the NIC of rail c (M21), so a node's NICs carry "
        "the crossings together; at most the fewest members on one node are used; 0 = one per GPU of a node (one "
        "per NIC: NCCL), 1 = one ring in rank order, each crossing through the sending GPU's own NIC (gloo); "
        "default 1 (what profiles written before the key existed meant)", 1)
    all_to_all_peer_us: float = _optional_num(
        "cost of each peer message of an all-to-all: a member posts a send to each member it sends to and a "
        "receive from each it receives from, one after another (a uniform all-to-all: 2 (p-1)), and the call "
        "waits for the member with the most, us per message; default 0", 0.0)
    kernel_sms: int = _optional_int(
        "SMs (count) a collective kernel of the library holds while it runs, one CTA a channel, each on an SM of "
        "its own that compute does not share (NCCL, nccl#689); compute beside the token exchange and the "
        "gradient sync runs on the rest (sim.step.kernel_sms); 0 = none (CPU ranks); default 0", 0)
    deepep_dispatch_GBps: float = _optional_num(
        "the rate at which DeepEP's internode kernels move token rows through a node's forwarding GPUs, source -> "
        "expert (the dispatch, the combine's backward): GB/s of the rows a GPU receives over NVLink, its own "
        "forwarded rows included (DeepEP's 'NVL' figure), at 24 SMs (DeepEP's tests' default) and in proportion to "
        "comm.deepep_sms. The kernel's SMs bound it below the NVLink rate (sim.network.deepep_forward); 0 = no "
        "bound beside the links; default 0", 0.0)
    deepep_combine_GBps: float = _optional_num(
        "the same for DeepEP's internode combine (and the dispatch's backward), expert -> source: GB/s of the rows "
        "a GPU sends its forwarding GPUs; default 0", 0.0)
    pxn: bool = _flag(
        "PXN (NCCL's PCI x NVLink, M21): an inter-node all-to-all or p2p message first crosses NVLink to the GPU "
        "of its node on the destination's rail and leaves through that GPU's NIC, so it stays on one rail (extra "
        "NVLink bytes, no cross-rail spine traffic with cluster.rail_optimized); default false")
    nvls: bool = _flag(
        "NVLink SHARP (NVLS): the node's NVLink switch reduces and multicasts. All-reduce in a node puts "
        "S (1 + 1/g) bytes up and down each member's NVLink (ring: 2 (g-1)/g S), reduce-scatter S up and S/g "
        "down, all-gather n up and g n down (S tensor or input bytes, n per-member bytes, g members); across "
        "nodes NVLS runs in each node, pipelined with a tree (or collnet) across nodes. Makes algorithm nvls "
        "available (and a candidate of auto); default false")
    collnet: bool = _flag(
        "in-network reduction across nodes (InfiniBand SHARP, NCCL CollNet): a reduce-scatter in each node, each "
        "member's S/g shard up its NIC once and the reduced shard down once (the leaf, or the spine when the "
        "shard's members hang off several leaves, reduces; each such leaf's uplink carries one S/g per shard "
        "each way), then an all-gather in each node, pipelined. Ring across nodes puts about 2 S/g on each NIC "
        "each way. Makes algorithm collnet available (and a candidate of auto); default false")


@dataclass(frozen=True)
class Protocol:
    """What the transport puts on the wire besides the payload (an emulated cluster's TCP).

    With ``payload_fraction`` < 1 the link figures are wire rates (what the links are
    shaped to): a flow gets ``payload_fraction`` of a link's bandwidth for its payload, and
    a link carries ``payload / payload_fraction`` bytes forward plus ``ack_fraction x
    payload`` bytes of acknowledgements back, plus ``message_bytes`` for every message
    (``testbed.policy.collectives.algorithm_messages``) that crosses it.
    """

    payload_fraction: float = _optional_num("payload bytes per byte on the wire (headers), 0 < f <= 1", 1.0, efficiency)
    ack_fraction: float = _optional_num("acknowledgement bytes sent back per payload byte", 0.0)
    message_bytes: float = _optional_num(
        "wire bytes every message of the library adds on each link it crosses, whatever its size (its rendezvous "
        "notices, their headers and acknowledgements)", 0.0)


@dataclass(frozen=True)
class Overheads:
    """Fixed costs of the testbed's own bookkeeping."""

    heat_update_us_per_expert: float = _num("heat-map update (M18), us per expert", non_negative)
    router_us: float = _num("router call beyond its GEMM (softmax, top-k, capacity), us per layer", non_negative)


@dataclass(frozen=True)
class Measured:
    """What ``testbed calibrate`` measured on this machine (all optional). Where an entry
    fits a scenario, the simulator uses it instead of the link and roofline models."""

    collective_latency: tuple = _rows(
        "software latency of the communication library with `world` ranks on this machine's cores, fitted to "
        "tiny collectives of every kind: call_us per call plus step_us per sequential step of the algorithm "
        "(replaces collectives.latency_us and step_latency_us; the network model still times the bytes)",
        world=int, call_us=float, step_us=float)
    compute_scale: tuple = _rows(
        "compute time of one rank with `world` ranks busy, relative to the compute figures",
        world=int, factor=float)
    stage_us: tuple = _rows(
        "cost of one call of a stage on the host (Python, autograd, bookkeeping): us fixed plus "
        "us_per_MB of the data the stage handles on the rank; calls are per layer for layer "
        "stages (paging: per layer forward and backward, and once at the step's end), per step "
        "for the others; variant = the token strategy (token stages) or expert sync "
        "(expert_sync) the entry was measured with, empty for any",
        world=int, stage=str, variant=str, us=float, us_per_MB=float)


@dataclass(frozen=True)
class Calibration:
    """What ``testbed calibrate`` did to make this profile (absent in built-in profiles):
    enough for a validation to refuse a profile made otherwise, one measured on another
    kind of device or network, and points that share a shape with what was fitted."""

    tool: str = _optional_text(f"the program that made the profile: {CALIBRATE_TOOL!r}; empty: not calibrated")
    device: str = _optional_text("where the compute figures were measured: cpu (CPU ranks) or cuda (a GPU); "
                                 "empty: not calibrated", "", ("", "cpu", "cuda"))
    fabric: str = _optional_text("the network the ranks measured over: loopback or emulated (CPU ranks over gloo), "
                                 "device (GPU ranks over the machine's own interconnect, NCCL); empty: not "
                                 "calibrated", "", ("", "loopback", "emulated", "device"))
    gpu: str = _optional_text("the GPU the figures were measured on (torch.cuda.get_device_name); empty on CPU")
    quick: bool = _flag("measured with --quick (fewer sizes and repetitions)")
    scenarios: tuple = _rows(
        "every scenario whose real runs calibration fitted (the host cost per stage): its name, cluster (world, "
        "gpus_per_node x nodes_per_microcluster x microclusters, ep_size), model shape (hidden, ffn_hidden, "
        "num_experts, top_k, num_layers, dtype), tokens_per_rank, seq_len (0: the MoE stack alone) and strategies",
        name=str, world=int, gpus_per_node=int, nodes_per_microcluster=int, microclusters=int, ep_size=int,
        hidden=int, ffn_hidden=int, num_experts=int, top_k=int, num_layers=int, dtype=str, tokens_per_rank=int,
        seq_len=int, token_strategy=str, expert_sync=str)

    @property
    def made_by_calibrate(self) -> bool:
        """The profile says it was written by ``testbed calibrate``."""
        return self.tool == CALIBRATE_TOOL


@dataclass(frozen=True)
class MachineProfile:
    """Everything the simulator needs to know about one machine type."""

    name: str = _text("short name, the file stem of built-ins")
    description: str = _text("one line on the machine")
    source: str = _text("where the figures come from, and which are assumptions")
    machine: str = _text("hardware the figures describe")
    date: str = _text("when the figures were taken")
    versions: dict = field(metadata={"doc": "library versions (name = version), free strings", "kind": "strmap"})
    links: Links = _section(Links, "link classes (M21)")
    compute: ComputeFigures = _section(ComputeFigures, "roofline compute figures")
    copy: CopyFigures = _section(CopyFigures, "host <-> device page copies")
    collectives: CollectiveFigures = _section(CollectiveFigures, "communication library")
    overheads: Overheads = _section(Overheads, "testbed bookkeeping")
    protocol: Protocol = field(default_factory=Protocol, metadata={
        "doc": "transport overhead on the wire (optional)", "kind": "section", "cls": Protocol, "optional": True})
    measured: Measured = field(default_factory=Measured, metadata={
        "doc": "what testbed calibrate measured (optional)", "kind": "section", "cls": Measured, "optional": True})
    calibration: Calibration = field(default_factory=Calibration, metadata={
        "doc": "what testbed calibrate did (optional; absent: not calibrated)", "kind": "section",
        "cls": Calibration, "optional": True})
    sources: dict = field(default_factory=dict, metadata={
        "doc": "where each figure comes from: dotted key (or a section, for every key in it) = its source (a "
               "file and entry, a document, a measurement) or 'assumed' and why (optional)", "kind": "strmap",
        "optional": True})

    def source_of(self, key: str) -> str:
        """The ``sources`` entry of dotted ``key``, or of the nearest section holding it;
        empty when there is none."""
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            entry = self.sources.get(".".join(parts[:n]))
            if entry:
                return entry
        return ""

    def to_dict(self) -> dict:
        """Plain TOML-ready mapping (curves as lists of [x, y]); without ``compute.gemm``
        where it is the default (no shape model), as profiles written before it existed."""
        data = _plain(self)
        if self.compute.gemm == GemmShapes():
            del data["compute"]["gemm"]
        return data


# ---- reading and writing -------------------------------------------------------------
def profile_from_dict(data: dict, label: str = "profile") -> MachineProfile:
    """Build a profile from a parsed TOML mapping; errors name ``profile LABEL: key``."""
    profile = _build(MachineProfile, data, "", label)
    c = profile.collectives
    for kind in ALGORITHMS:
        alg = getattr(c.algorithm, kind)
        if alg in NEEDS and not getattr(c, NEEDS[alg]):
            raise _error(label, f"collectives.algorithm.{kind}", alg,
                         f"needs collectives.{NEEDS[alg]} = true (the machine's capability)")
    return profile


def load_profile(name_or_path: str | Path, search_dirs: Iterable[Path] | None = None) -> MachineProfile:
    """Load a profile by file path or by name (see module doc for the lookup order).

    ``search_dirs`` replaces the default ``(./profiles, testbed/profiles)``.
    """
    path = find_profile(name_or_path, search_dirs)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ScenarioError("cluster.profile", str(name_or_path), f"cannot read {path}: {e}") from None
    label = data.get("name") if isinstance(data.get("name"), str) else path.stem
    return profile_from_dict(data, label)


def find_profile(name_or_path: str | Path, search_dirs: Iterable[Path] | None = None) -> Path:
    """Path of the profile file ``name_or_path`` names; ScenarioError when there is none."""
    given = Path(name_or_path)
    if given.is_file():
        return given
    dirs = [Path(d) for d in search_dirs] if search_dirs is not None else [Path("profiles"), BUILTIN_DIR]
    for d in dirs:
        candidate = d / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(d) for d in dirs)
    raise ScenarioError("cluster.profile", str(name_or_path),
                        f"no such file and no {name_or_path}.toml in {looked} (built-ins: {', '.join(BUILTINS)})")


def save_profile(profile: MachineProfile, path: str | Path) -> Path:
    """Write ``profile`` as TOML; ``load_profile(path) == profile``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Machine profile; every key is documented in testbed/scenario/profile.py.\n"
    import tomli_w  # only where TOML is written (the GPU machine's check runs without it)
    path.write_text(header + tomli_w.dumps(profile.to_dict()))
    return path


def field_docs() -> list[tuple[str, str]]:
    """(dotted key, doc) of every profile key, in file order."""
    rows = []

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            if f.metadata["kind"] == "section":
                walk(f.metadata["cls"], key + ".")
            else:
                rows.append((key, f.metadata["doc"]))
    walk(MachineProfile, "")
    return rows
