"""The routing trace: token slots routed per step x layer x rank x expert.

Both backends write it into their run folder (``routing.npz``); the simulator replays a
trace given as ``workload.trace = RUN_DIR``, so a real run's routing can be timed by the
simulator. Counts are *routed* (before capacity); each backend applies the scenario's
capacity (M2) to them, so a replay may also change the capacity factor.

The file is compact: counts are stored in the smallest unsigned integer type that holds
the largest (uint8 for paper-1440, whose ~17.7 M counts are all below 256) and deflated
at the fastest level, since dense counts compress little more at higher levels but take
several times longer (paper-1440's 3 steps: 14 MB, written in well under a second,
where int32 at numpy's default level took 20 MB and about 5 s). Any integer dtype reads
back (traces written before this as int32 too); ``load`` returns int32 counts.

Micro-batches (issue 25): a real run of pipeline stages with ``transformer.micro_batches``
m > 1 also keeps each micro-batch's counts, ``micro_routed[s, i, l, w, e]``, stored beside
``routed`` (which stays their sum, so a reader that knows nothing of them, or a one-stage
replay, reads the step's routing as before); a run of one micro-batch writes no such array,
the same file as before. A pipelined run's ranks ``w`` are a stage's (its data-parallel
streams) and its layers the whole model's, stage after stage (``real.rank.worker``): the
simulator replays each micro-batch on its pipeline rank (``sim.backend.trace_routing``).
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.core.errors import ScenarioError
from testbed.core.files import write_atomic
from testbed.scenario.scenario import Scenario

FILE = "routing.npz"
COMPRESS_LEVEL = 1  # zlib's fastest: dense counts gain little from higher levels


def compact_counts(routed: np.ndarray) -> np.ndarray:
    """``routed`` in the smallest unsigned integer dtype that holds its largest value."""
    routed = np.asarray(routed)
    if routed.size and routed.min() < 0:
        raise ValueError("routed counts must be non-negative")
    top = int(routed.max()) if routed.size else 0
    for dtype in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dtype).max:
            return routed.astype(dtype, copy=False)
    return routed.astype(np.uint64, copy=False)


@dataclass
class RoutingTrace:
    """routed[s, l, w, e]: slots rank w routed to expert e in layer l at step s (int32)."""

    routed: np.ndarray
    tokens_per_rank: int
    top_k: int
    #: deepep (comm.token_strategy): fanout[s, l, w] = rank w's kept tokens per destination EP
    #: member and node (``testbed.policy.deepep``; its bytes depend on tokens, not slots); None otherwise
    fanout: np.ndarray | None = None
    #: pipelined runs of m > 1 micro-batches: micro_routed[s, i, l, w, e], micro-batch i's share of
    #: routed[s, l, w, e] (their sum); None for a run of one micro-batch (module doc). ``routed``
    #: may be given with that axis ([S, m, L, W, E]): it is kept here and ``routed`` is its sum.
    micro_routed: np.ndarray | None = None

    def __post_init__(self):
        routed = np.asarray(self.routed)
        if routed.ndim == 5:
            if routed.shape[1] > 1:
                self.micro_routed = routed
            routed = routed.sum(axis=1, dtype=routed.dtype)
        self.routed = routed
        if self.micro_routed is not None and self.micro_routed.shape[1] == 1:  # one micro-batch: the step's
            self.micro_routed = None

    @property
    def steps(self) -> int:
        return self.routed.shape[0]

    @property
    def micro_batches(self) -> int:
        """Micro-batches a step whose counts the trace holds one by one (1: only the step's)."""
        return 1 if self.micro_routed is None else self.micro_routed.shape[1]

    def save(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / FILE
        meta = {"tokens_per_rank": self.tokens_per_rank, "top_k": self.top_k,
                "shape": ["steps", "layers", "ranks", "experts"]}
        if self.micro_routed is not None:
            meta["micro_shape"] = ["steps", "micro_batches", "layers", "ranks", "experts"]
        buf = io.BytesIO()  # an .npz as np.savez_compressed writes it, at our compression level
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=COMPRESS_LEVEL) as z:
            arrays = [("routed", compact_counts(self.routed)), ("meta", np.array(json.dumps(meta)))]
            if self.fanout is not None:
                arrays.append(("fanout", compact_counts(self.fanout)))
            if self.micro_routed is not None:
                arrays.append(("micro_routed", compact_counts(self.micro_routed)))
            for name, value in arrays:
                with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, value, allow_pickle=False)
        return write_atomic(path, buf.getvalue())

    @classmethod
    def load(cls, run_dir: str | Path) -> "RoutingTrace":
        """Read ``RUN_DIR/routing.npz``; a missing or unreadable file is a ScenarioError."""
        path = Path(run_dir) / FILE
        if not path.is_file():
            raise ScenarioError("workload.trace", str(run_dir), f"no routing trace {FILE} in that folder")
        try:
            with np.load(path) as data:
                meta = json.loads(str(data["meta"]))
                routed = data["routed"].astype(np.int32, copy=False)
                fanout = data["fanout"].astype(np.int64) if "fanout" in data.files else None
                micro = data["micro_routed"].astype(np.int32, copy=False) if "micro_routed" in data.files else None
        except (OSError, ValueError, KeyError) as e:
            raise ScenarioError("workload.trace", str(run_dir), f"unreadable routing trace: {e}") from None
        if micro is not None and (micro.ndim != 5 or micro.shape[:1] + micro.shape[2:] != routed.shape):
            raise ScenarioError("workload.trace", str(run_dir),
                                f"its micro_routed {list(micro.shape)} [steps, micro-batches, layers, ranks, "
                                f"experts] does not match its routed {list(routed.shape)}")
        return cls(routed=routed, tokens_per_rank=meta["tokens_per_rank"], top_k=meta["top_k"], fanout=fanout,
                   micro_routed=micro)

    def check_fits(self, scenario: Scenario, where: str) -> None:
        """Raise ScenarioError unless the trace covers the scenario's steps, layers, ranks,
        experts and, with ``transformer.micro_batches`` m > 1, holds m micro-batches' counts
        one by one. A pipelined scenario's ranks are a stage's (module doc)."""
        s, l, w, e = self.routed.shape
        m = scenario.model
        p, mb = scenario.parallelism.pp_size, scenario.transformer.micro_batches
        ranks = ("cluster (GPUs)", scenario.world_size) if p == 1 else \
            (f"cluster (GPUs) / parallelism.pp_size {p} (a stage's)", scenario.world_size // p)
        want = {"run.steps": (scenario.run.steps, s, "steps"),
                "model.num_layers": (m.num_layers, l, "layers"),
                ranks[0]: (ranks[1], w, "ranks"),
                "model.num_experts": (m.num_experts, e, "experts"),
                "workload.tokens_per_rank": (scenario.workload.tokens_per_rank, self.tokens_per_rank, "tokens per rank"),
                "model.top_k": (m.top_k, self.top_k, "top-k")}
        for fld, (asked, has, what) in want.items():
            too_few = asked > has if fld == "run.steps" else asked != has
            if too_few:
                raise ScenarioError("workload.trace", where,
                                    f"the trace has {has} {what} but {fld} = {asked}")
        if mb > 1 and self.micro_batches != mb:
            held = ("only each step's counts [steps, layers, ranks, experts] = "
                    f"{list(self.routed.shape)}, no micro_routed" if self.micro_routed is None else
                    f"micro_routed {list(self.micro_routed.shape)} of {self.micro_batches} micro-batches")
            raise ScenarioError("workload.trace", where,
                                f"transformer.micro_batches = {mb} replays each micro-batch's counts, "
                                f"micro_routed [steps, {mb}, layers, ranks, experts] (a pipelined real run's); "
                                f"the trace holds {held}")
