"""``testbed collective KIND``: one collective by size, as an nccl-tests table, simulated or measured.

So that a user can hold the simulator against their own nccl-tests logs (or against
real ranks on this machine), the table has nccl-tests' columns and meanings
(nccl-tests' doc/PERFORMANCE.md):

- KIND: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, or as the
  nccl-tests binaries spell them, ``allreduce``, ``allgather``, ``reducescatter``,
  ``alltoall``;
- sizes: ``--sizes BEGIN:END`` with ``-f FACTOR`` (nccl-tests' ``-b BEGIN -e END -f
  FACTOR``), or one size; K, M, G, T are powers of 2 as in nccl-tests (``1M`` = 2**20
  bytes), and ``parse_bytes``' units (``64KiB``, ``1MB``) are accepted too;
- ``size`` is the buffer nccl-tests counts, in bytes of float32 elements (``count``):
  all_reduce the buffer on each rank; all_gather the *output* buffer on each rank (each
  contributes size / n); reduce_scatter the *input* buffer on each rank (each receives
  size / n); all_to_all each rank's send buffer (size / n to every rank, itself
  included). As nccl-tests does, a size is rounded down to whole floats, and to a
  multiple of n floats where it is split between ranks;
- ``time``: microseconds per call; ``algbw`` = size / time; ``busbw`` = algbw x the
  kind's bus factor: 2(n-1)/n for all_reduce, (n-1)/n for the others. GB = 1e9 bytes.

``--backend sim`` times each size alone on a fabric of ``--gpus`` GPUs on ``--nodes``
nodes (``--nodes-per-leaf`` of them under one leaf; all by default) with the
simulator's collective model and the flow network model (exact for one op alone:
``sim.network.collective_model.seconds_alone``), and names the algorithm the model runs.
``--backend real`` spawns ``--gpus`` ranks on this machine (``real.calibrate.bench``): gloo CPU
ranks over the loopback, or each in its namespace of an emulated cluster of that shape
(``--fabric emulated``, root), or NCCL with one GPU per rank where the GPUs are there;
each size is called ``--warmup`` times, then ``--iters`` times back to back, and the
time per call is averaged over the ranks (nccl-tests' default ``-a 1``).
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np

from testbed.core.errors import ScenarioError
from testbed.core.units import format_bytes, parse_bytes
from testbed.policy.collectives import CollectiveOp
from testbed.run.backend import get_tool
from testbed.run.guards import MEMORY_SHARE, available_memory
from testbed.scenario.profile import load_profile
from testbed.scenario.scenario import Scenario

#: the spellings of each kind: ours, nccl-tests' binaries'; -> the planner's kind
KINDS = {"all_reduce": "all_reduce", "allreduce": "all_reduce", "all_gather": "all_gather",
         "allgather": "all_gather", "reduce_scatter": "reduce_scatter", "reducescatter": "reduce_scatter",
         "all_to_all": "all_to_all_v", "alltoall": "all_to_all_v", "all_to_all_v": "all_to_all_v"}
#: nccl-tests' name (as its tables and binaries print it) and reduction of each kind
NCCL_NAMES = {"all_reduce": ("all_reduce", "sum"), "all_gather": ("all_gather", "none"),
              "reduce_scatter": ("reduce_scatter", "sum"), "all_to_all_v": ("alltoall", "none")}
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}  # nccl-tests' -b / -e suffixes
FLOAT_BYTES = 4
#: where the real backend's table comes from (``testbed.run.backend.TOOLS`` style: found by name)
DEFAULT_PROFILE = {"sim": "h200", "real": "emulated"}


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw of ``kind`` on ``n`` ranks (PERFORMANCE.md)."""
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def parse_kind(text: str) -> str:
    """The planner's kind for a KIND as the user spells it (module doc)."""
    kind = KINDS.get(text.strip().lower().replace("-", "_"))
    if kind is None:
        raise ScenarioError("KIND", text, "expected all_reduce, all_gather, reduce_scatter or all_to_all "
                            "(or nccl-tests' allreduce, allgather, reducescatter, alltoall)")
    return kind


def parse_size(text: str, option: str = "--sizes") -> int:
    """Bytes of one size: a number with K, M, G or T (powers of 2, as nccl-tests), or any
    unit of ``testbed.core.units.parse_bytes``."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kmgtKMGT]?)\s*", text)
    try:
        n = int(m.group(1)) * UNITS[m.group(2).upper()] if m else parse_bytes(text.strip())
    except ValueError:
        n = None
    if n is None or n <= 0:
        raise ScenarioError(option, text, "expected a positive size in bytes, e.g. 8, 64K, 1M, 1G (powers of 2, "
                            "as nccl-tests' -b and -e) or 16MiB")
    return n


def parse_sizes(text: str, factor: str | int = 2) -> list[int]:
    """Sizes in bytes of ``BEGIN:END`` (every BEGIN x FACTOR**i up to END, as nccl-tests'
    ``-b -e -f``) or of a single size."""
    try:
        f = int(factor)
    except (TypeError, ValueError):
        f = 0
    if f < 2:
        raise ScenarioError("-f", factor, "expected a whole factor of at least 2 between sizes (nccl-tests' -f)")
    parts = text.split(":")
    if len(parts) > 2:
        raise ScenarioError("--sizes", text, "expected BEGIN:END (e.g. 1M:1G) or one size")
    begin = parse_size(parts[0])
    end = parse_size(parts[-1])
    if end < begin:
        raise ScenarioError("--sizes", text, "the end is smaller than the beginning")
    sizes = [begin]
    while sizes[-1] * f <= end:
        sizes.append(sizes[-1] * f)
    return sizes


def _count(text: str, option: str, least: int = 1) -> int:
    try:
        n = int(text)
    except (TypeError, ValueError):
        n = None
    if n is None or n < least:
        raise ScenarioError(option, text, f"expected a whole number of at least {least}")
    return n


def op_size(kind: str, nbytes: int, n: int) -> int:
    """``nbytes`` rounded down as nccl-tests rounds it: whole floats, a multiple of ``n``
    floats where the buffer is split between ranks; 0 when less than that is left."""
    count = nbytes // FLOAT_BYTES
    if kind != "all_reduce":
        count = count // n * n
    return count * FLOAT_BYTES


def collective_op(kind: str, nbytes: int, n: int) -> CollectiveOp:
    """The simulator's op for nccl-tests' ``nbytes`` of ``kind`` on ranks 0..n-1 (module
    doc; ``CollectiveOp.size`` is per member: the buffer of all_reduce and reduce_scatter,
    each rank's share of all_gather; all_to_all: nbytes / n to every member)."""
    members = tuple(range(n))
    if kind == "all_to_all_v":
        return CollectiveOp(kind, members, "dispatch", matrix=np.full((n, n), nbytes // n, dtype=np.int64))
    return CollectiveOp(kind, members, "dispatch", size=nbytes // n if kind == "all_gather" else nbytes)


def cluster_scenario(gpus: int, nodes: int, nodes_per_leaf: int | None, profile: str, network: str = "loopback",
                     device: str = "auto") -> Scenario:
    """A scenario of ``gpus`` GPUs on ``nodes`` nodes, ``nodes_per_leaf`` nodes under a leaf
    (all: one leaf), on ``profile``; errors name the command's options."""
    if gpus % nodes:
        raise ScenarioError("--nodes", nodes, f"does not divide --gpus = {gpus} into whole nodes")
    leaf = nodes if nodes_per_leaf is None else nodes_per_leaf
    if nodes % leaf:
        raise ScenarioError("--nodes-per-leaf", leaf, f"does not divide --nodes = {nodes}")
    try:
        load_profile(profile)
    except ScenarioError as e:
        raise ScenarioError("--profile", profile, e.reason) from None
    return Scenario.from_dict({
        "cluster": {"gpus_per_node": gpus // nodes, "nodes_per_microcluster": leaf, "microclusters": nodes // leaf,
                    "profile": profile},
        "parallelism": {"ep_size": 1}, "real": {"network": network, "device": device}})


# ---- the two sources of rows ------------------------------------------------------------------
def sim_rows(scenario: Scenario, kind: str, sizes: list[int], on_row=None) -> list[dict]:
    """One row per size: the op alone on the fabric, by the flow model (exact for one op)."""
    alone = get_tool("sim-collective-alone")
    profile = load_profile(scenario.cluster.profile)
    rows = []
    for nbytes in sizes:
        got = alone(scenario, profile, collective_op(kind, nbytes, scenario.world_size))
        rows.append({"size": nbytes, "seconds": got.seconds, "algorithm": got.algorithm})
        if on_row is not None:
            on_row(rows[-1])
    return rows


def check_memory(kind: str, sizes: list[int], gpus: int) -> None:
    """Refuse a real run whose buffers (input and output of the largest size on every rank)
    do not fit this machine's memory."""
    need = gpus * (2 if kind != "all_reduce" else 1) * max(sizes)
    limit = int(MEMORY_SHARE * available_memory())
    if need > limit:
        raise ScenarioError("--sizes", f"{format_bytes(max(sizes))} on {gpus} ranks",
                            f"the buffers would take {format_bytes(need)}, more than the {format_bytes(limit)} "
                            "this machine can give")


# ---- the table -----------------------------------------------------------------------------
def format_row(kind: str, n: int, row: dict) -> str:
    """One line of the table, in nccl-tests' columns."""
    redop = NCCL_NAMES[kind][1]
    algbw = row["size"] / row["seconds"] / 1e9 if row["seconds"] > 0 else 0.0
    return (f"{row['size']:12d}  {row['size'] // FLOAT_BYTES:12d}  {'float':>8s}  {redop:>6s}  {-1:6d}  "
            f"{row['seconds'] * 1e6:9.2f}  {algbw:7.2f}  {algbw * bus_factor(kind, n):7.2f}  {row['algorithm']}")


HEADER = "\n".join("#" + f"{a:>11s}  {b:>12s}  {c:>8s}  {d:>6s}  {e:>6s}  {f:>9s}  {g:>7s}  {h:>7s}  {i}".rstrip()
                    for a, b, c, d, e, f, g, h, i in (("size", "count", "type", "redop", "root", "time", "algbw",
                                                       "busbw", "algorithm"),
                                                      ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)",
                                                       "")))


def run(args, out=None) -> int:
    """``testbed collective`` (``args``: its subparser in ``testbed.cli.main``); prints to
    ``out`` (default stdout)."""
    out = out or sys.stdout
    kind = parse_kind(args.kind)
    if args.backend not in ("sim", "real"):
        raise ScenarioError("--backend", args.backend, "expected sim or real")
    if args.fabric not in ("loopback", "emulated"):
        raise ScenarioError("--fabric", args.fabric, "expected loopback or emulated")
    gpus = _count(args.gpus, "--gpus", least=2)
    nodes = _count(args.nodes, "--nodes")
    leaf = None if args.nodes_per_leaf is None else _count(args.nodes_per_leaf, "--nodes-per-leaf")
    iters, warmup = _count(args.iters, "--iters"), _count(args.warmup, "--warmup", least=0)
    asked = parse_sizes(args.sizes, args.factor)
    sizes = list(dict.fromkeys(s for s in (op_size(kind, n, gpus) for n in asked) if s > 0))
    too_small = [n for n in asked if op_size(kind, n, gpus) == 0]
    if not sizes:
        raise ScenarioError("--sizes", args.sizes, f"every size is less than one float per rank for "
                            f"{NCCL_NAMES[kind][0]} on {gpus} ranks")
    profile = args.profile or DEFAULT_PROFILE[args.backend]
    scenario = cluster_scenario(gpus, nodes, leaf, profile, args.fabric, "auto")
    c = scenario.cluster
    shape = (f"{gpus} GPUs on {nodes} node{'s' if nodes > 1 else ''} ({c.gpus_per_node} per node"
             f"{f', {c.microclusters} leaves' if c.microclusters > 1 else ''})")
    lines = []
    skipped = (f"# skipped {', '.join(map(str, too_small))} B: less than one float per rank" if too_small else None)

    def emit(row: dict) -> None:
        lines.append(row)
        if not args.json:
            print(format_row(kind, gpus, row), file=out, flush=True)

    if args.backend == "sim":
        title = f"# testbed collective {NCCL_NAMES[kind][0]}: simulator (flow network model), profile {profile}, {shape}"
        if not args.json:
            print("\n".join(filter(None, (title, skipped, HEADER))), file=out, flush=True)
        sim_rows(scenario, kind, sizes, on_row=emit)
        source = {"backend": "sim", "network_model": "flow", "profile": profile}
    else:
        if args.fabric == "emulated":
            try:
                get_tool("net-check")()
            except ScenarioError as e:
                raise ScenarioError("--fabric", "emulated", e.reason) from None
        check_memory(kind, sizes, gpus)
        where = (f"an emulated cluster of {shape}, profile {profile}" if args.fabric == "emulated"
                 else f"{gpus} ranks on this machine (loopback)")
        if not args.json:
            print(f"# testbed collective {NCCL_NAMES[kind][0]}: real ranks, {where}, "
                  f"{warmup} warm-up and {iters} timed calls a size, time averaged over ranks", file=out)
            print("\n".join(filter(None, (skipped, HEADER))), file=out, flush=True)
        got = get_tool("real-collective-table")(scenario, kind, sizes, iters=iters, warmup=warmup, on_row=emit)
        source = {"backend": "real", "library": got["library"], "device": got["device"], "fabric": args.fabric,
                  "iters": iters, "warmup": warmup}
    busbw = [r["size"] / r["seconds"] / 1e9 * bus_factor(kind, gpus) for r in lines if r["seconds"] > 0]
    avg = float(np.mean(busbw)) if busbw else 0.0
    if args.json:
        for r in lines:
            r["algbw_GBps"] = r["size"] / r["seconds"] / 1e9 if r["seconds"] > 0 else 0.0
            r["busbw_GBps"] = r["algbw_GBps"] * bus_factor(kind, gpus)
        print(json.dumps({"kind": NCCL_NAMES[kind][0], "gpus": gpus, "nodes": nodes, **source, "rows": lines,
                          "avg_busbw_GBps": avg}), file=out)
    else:
        print(f"# Avg bus bandwidth    : {avg:g}", file=out)
    return 0
