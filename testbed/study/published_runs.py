"""The published figures the simulator is judged on (issue 26), as data: each row of
``docs/published.md``'s sections 1-3 with the scenario in ``configs/published/`` that
reproduces its setup, the figure as published and its unit, and the comparisons of its
section 4. ``docs/published.md`` gives every figure's source; ``tests/testbed/study/
test_published_runs.py`` checks that each row here holds the figure that page prints.

Nothing here is fitted to: the figures are only compared against (docs/published.md, "The
rule: compare, never fit").

Units: ``mfu`` a fraction of ``MFU_PEAK_TFLOPS`` (0.463, not 46.3%); ``tflops`` TFLOP/s per
GPU in Megatron-LM's count (``testbed.model.published_conversion``); ``tokens_per_s``
tokens per second per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the H100's dense bf16 spec (TFLOP/s) the MoE Parallel Folding paper's MFU is a fraction of
#: (docs/published.md section 1; NVIDIA's H100 SXM datasheet halved for dense)
MFU_PEAK_TFLOPS = 989.5
UNITS = ("mfu", "tflops", "tokens_per_s")


@dataclass(frozen=True)
class PublishedRow:
    """One published throughput figure and the scenario of its setup."""

    id: str  # docs/published.md's row id
    config: str  # file under configs/published/
    unit: str  # one of UNITS
    value: float  # as published, in ``unit``
    source: str  # the paper or repository, and where in it
    weak: bool = False  # docs/published.md calls the row a weak check (and says why)


@dataclass(frozen=True)
class Comparison:
    """A published ratio of two rows' per-GPU throughput: ``numerator`` over ``denominator``."""

    id: str
    what: str
    numerator: str  # row id
    denominator: str  # row id
    published: float  # the ratio as published (docs/published.md section 4)


FOLDING = "arXiv 2504.14960"
ROWS: tuple[PublishedRow, ...] = (
    PublishedRow("fold-T3-1", "mixtral-8x22b-128-h100-tpep.toml", "mfu", 0.366, f"{FOLDING} Table 3"),
    PublishedRow("fold-T3-2", "mixtral-8x22b-128-h100-mcore.toml", "mfu", 0.463, f"{FOLDING} Table 3"),
    PublishedRow("fold-T3-3", "mixtral-8x22b-128-h100-folded.toml", "mfu", 0.493, f"{FOLDING} Table 3"),
    PublishedRow("fold-T3-4", "qwen2-57b-64-h100-mcore.toml", "mfu", 0.353, f"{FOLDING} Table 3"),
    PublishedRow("fold-T3-5", "qwen2-57b-64-h100-folded.toml", "mfu", 0.390, f"{FOLDING} Table 3"),
    PublishedRow("fold-T2-1", "mixtral-8x22b-128-h100-mcore.toml", "tflops", 458.3, f"{FOLDING} Table 2"),
    PublishedRow("fold-T2-2", "mixtral-8x22b-128-h100-mcore-fp8.toml", "tflops", 575.1, f"{FOLDING} Table 2"),
    PublishedRow("fold-T2-3", "mixtral-8x22b-128-h100-folded.toml", "tflops", 487.7, f"{FOLDING} Table 2"),
    PublishedRow("fold-T2-4", "mixtral-8x22b-128-h100-folded-fp8.toml", "tflops", 631.7, f"{FOLDING} Table 2"),
    PublishedRow("fold-T4-1", "mixtral-8x22b-128-h100-mcore-gbs1024.toml", "mfu", 0.494, f"{FOLDING} Table 4"),
    PublishedRow("fold-T4-2", "mixtral-8x22b-256-h100-mcore-gbs1024.toml", "mfu", 0.480, f"{FOLDING} Table 4"),
    PublishedRow("fold-T4-3", "mixtral-8x22b-512-h100-mcore-gbs1024.toml", "mfu", 0.455, f"{FOLDING} Table 4"),
    PublishedRow("fold-T4-4", "mixtral-8x22b-1024-h100-mcore-gbs1024.toml", "mfu", 0.423, f"{FOLDING} Table 4"),
    PublishedRow("mlm-readme-1", "mixtral-8x7b-64-h100.toml", "tflops", 468.0,
                 "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md @ c230e0d7", weak=True),
    PublishedRow("bridge-2509-1", "qwen3-30b-16-h100.toml", "tokens_per_s", 10494.0,
                 "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @ df0289c1 (25.09, DGX-H100)", weak=True),
)

COMPARISONS: tuple[Comparison, ...] = (
    Comparison("folding-mixtral-bf16", "folding against no folding, Mixtral-8x22B bf16", "fold-T3-3", "fold-T3-2",
               49.3 / 46.3),
    Comparison("folding-qwen2", "folding against no folding, Qwen2-57B-A14B", "fold-T3-5", "fold-T3-4", 39.0 / 35.3),
    Comparison("folding-mixtral-fp8", "folding against no folding, Mixtral-8x22B fp8", "fold-T2-4", "fold-T2-2",
               631.7 / 575.1),
    Comparison("fp8-mcore", "fp8 against bf16, Megatron-Core", "fold-T2-2", "fold-T2-1", 575.1 / 458.3),
    Comparison("fp8-folded", "fp8 against bf16, with folding", "fold-T2-4", "fold-T2-3", 631.7 / 487.7),
    Comparison("strong-scaling", "strong scaling, 128 to 1,024 GPUs", "fold-T4-4", "fold-T4-1", 42.3 / 49.4),
    Comparison("mcore-vs-tpep", "Megatron-Core against TP+EP+DP", "fold-T3-2", "fold-T3-1", 46.3 / 36.6),
)


@dataclass(frozen=True)
class UnstatedSetting:
    """A setting that the source of some rows leaves unstated, at another value than their
    scenarios assume, with the source of that value. The validation also simulates those rows
    at that value and reports the results next to the judged ones. The judged prediction
    remains the scenario's: a scenario takes its unstated settings from the source nearest
    its run (docs/published.md section 1, "The scenarios assume instead"), never from the
    figure it is judged on. ``overrides`` are ``SECTION.KEY=VALUE`` fields, as
    ``testbed run --set`` takes them."""

    id: str
    what: str
    overrides: tuple[str, ...]
    rows: tuple[str, ...]  # row ids
    source: str


MODELZOO = "yanring/Megatron-MoE-ModelZoo runtime_configs/benchmarking/runtime.conf"
UNSTATED: tuple[UnstatedSetting, ...] = (
    # The folding paper (2025-04) gives no VPP. The ModelZoo from its first commit (78fd4d6, 2025-04-03, the
    # scenarios' source) to b06a6d8 has VPP 1 for Mixtral-8x22B (TP 2, PP 8, EP 8); from 7f59386
    # (2025-07-30, "Update Mixtral 8x22B") it has VPP 7, one layer a chunk.
    UnstatedSetting("mixtral-8x22b-vpp7", "a virtual pipeline of 7 chunks a stage (one layer a chunk)",
                    ("parallelism.pp_chunks=7",),
                    ("fold-T3-2", "fold-T3-3", "fold-T2-1", "fold-T2-2", "fold-T2-3", "fold-T2-4",
                     "fold-T4-1", "fold-T4-2", "fold-T4-3", "fold-T4-4"),
                    f"{MODELZOO} from 7f59386 (2025-07-30) on: VPP 7 for Mixtral-8x22B; VPP 1 at 78fd4d6 "
                    "(2025-04-03), the commit the scenarios follow"),
)


def unstated_setting(setting_id: str) -> UnstatedSetting:
    """The setting of ``UNSTATED`` with id ``setting_id`` (KeyError naming it when there is none)."""
    for s in UNSTATED:
        if s.id == setting_id:
            return s
    raise KeyError(setting_id)


@dataclass(frozen=True)
class DeepEPRow:
    """DeepEP's normal kernels on H800 (docs/published.md section 5): GB/s of the bottleneck link."""

    id: str
    kind: str  # intranode or internode
    ep: int
    dispatch_GBps: float
    combine_GBps: float
    link: str


DEEPEP_SOURCE = "deepseek-ai/DeepEP README.md @ 3b1045db"
DEEPEP_ROWS: tuple[DeepEPRow, ...] = (
    DeepEPRow("deepep-1", "intranode", 8, 153.0, 158.0, "NVLink"),
    DeepEPRow("deepep-2", "internode", 16, 43.0, 43.0, "RDMA"),
    DeepEPRow("deepep-3", "internode", 32, 58.0, 57.0, "RDMA"),
    DeepEPRow("deepep-4", "internode", 64, 51.0, 50.0, "RDMA"),
)

#: DeepEP's published ratios between EP sizes (docs/published.md section 4): (id, what,
#: numerator row, denominator row); the ratio is taken of dispatch and of combine
DEEPEP_COMPARISONS = (
    ("deepep-16-to-32", "DeepEP internode, EP 16 to 32", "deepep-3", "deepep-2"),
    ("deepep-32-to-64", "DeepEP internode, EP 32 to 64", "deepep-4", "deepep-3"),
)


@dataclass(frozen=True)
class GroupedGemmFigure:
    """A published grouped-GEMM kernel figure on an H100 in bf16 (docs/published.md section 9):
    ``groups`` GEMMs of (``m``, ``n``, ``k``) elements in one call, TFLOP/s. A kernel figure,
    not a training run: ``te-2.2`` calibrates the h100 profile's
    ``compute.gemm.multistream_call_us``; the others are compared against."""

    id: str
    implementation: str  # te-2.2 / te-2.7: Transformer Engine's multi-stream cuBLAS; cutlass: its CUTLASS kernel
    groups: int
    m: int
    n: int
    k: int
    tflops: float


TE_GROUPED_GEMM_SOURCE = ("NVIDIA/TransformerEngine#2045, its description (2025-08-08; the TE v2.7 and CUTLASS "
                          "rows as updated by a maintainer, CUDA 12.9)")
TE_GROUPED_GEMM_FIGURES: tuple[GroupedGemmFigure, ...] = (
    GroupedGemmFigure("te2045-1", "te-2.2", 8, 4096, 768, 2048, 508.77),
    GroupedGemmFigure("te2045-2", "te-2.2", 16, 2048, 768, 2048, 398.81),
    GroupedGemmFigure("te2045-3", "te-2.7", 8, 4096, 768, 2048, 627.903),
    GroupedGemmFigure("te2045-4", "te-2.7", 16, 2048, 768, 2048, 553.945),
    GroupedGemmFigure("te2045-5", "cutlass", 8, 4096, 768, 2048, 650.574),
    GroupedGemmFigure("te2045-6", "cutlass", 16, 2048, 768, 2048, 636.927),
)


def row(row_id: str) -> PublishedRow:
    """The row of ``ROWS`` with id ``row_id`` (KeyError naming it when there is none)."""
    for r in ROWS:
        if r.id == row_id:
            return r
    raise KeyError(row_id)


def throughput(unit: str, *, tflops_per_gpu: float, tokens_per_s_per_gpu: float) -> float:
    """A simulated run's throughput in a published row's ``unit`` (module doc) from its
    Megatron TFLOP/s and its tokens/s per GPU."""
    if unit == "mfu":
        return tflops_per_gpu / MFU_PEAK_TFLOPS
    if unit == "tflops":
        return tflops_per_gpu
    if unit == "tokens_per_s":
        return tokens_per_s_per_gpu
    raise ValueError(f"unknown unit {unit!r} (one of {', '.join(UNITS)})")
