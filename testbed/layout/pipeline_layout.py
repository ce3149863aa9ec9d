"""Which layers each pipeline stage holds: Megatron-Core's ``pipeline_model_parallel_layout`` strings, and the
split Megatron-Core makes without one (issue 25, item 4).

A layout is a list of **stages in model order**; stage ``i`` runs on pipeline rank ``i % pp_size`` as its virtual
chunk ``i // pp_size`` (the interleaved schedule's round robin), so ``pp_size * vpp_size`` stages in all. Each
stage holds items in model order: the input embedding, transformer (decoder) layers, multi-token-prediction (MTP)
layers, the output head with the loss. A layer's id counts the layers of its kind in every earlier stage.

String syntax, as ``PipelineParallelLayerLayout.parse_str_to_list`` reads it (Megatron-LM
``megatron/core/transformer/pipeline_parallel_layer_layout.py`` at d98e8a64ddf34856e74b24714e3bedb2f5a39553):
``E`` embedding, ``t`` transformer layer, ``m`` MTP layer, ``L`` loss (output layer and loss), ``|`` ends a stage
(an empty stage is allowed), commas are ignored. Repeats are textual, in two passes: ``(...)*n`` repeats the
bracketed text n times, ``|`` included (``(tt|)*2`` is ``tt|tt|``), then ``x*n`` repeats one character.
DeepSeek-V3 on 1,024 H100 with PP 8: ``Et*3|(tt|)*29m|L`` is 32 stages, so 4 virtual chunks per rank.

Checks, in the order of ``PipelineParallelLayerLayout.__init__`` and ``validate_layer_layout``: the stages are a
multiple of pp_size; the first item is E and the last L, one of each; as many ``t`` as the model's transformer
layers and ``m`` as its MTP layers; no ``t`` after an ``m``; the MTP layers all in one stage, the last virtual
chunk of its rank. Megatron's separate check that rank 0 holds no MTP before its last chunk follows from the last
one. Where it fails: a ``ScenarioError`` on ``parallelism.pipeline_layout``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from testbed.core.errors import ScenarioError

LAYOUT_FIELD = "parallelism.pipeline_layout"
KINDS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
#: longest expanded layout accepted: a guard against ``t*999999999``, far above any real model's
MAX_EXPANDED_CHARS = 1_000_000

_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")  # Megatron's r'\(([^)]+)\)\*(\d+)', nesting refused here
_CHAR = re.compile(r"(.)\*(\d+)")


@dataclass(frozen=True)
class LayoutItem:
    """One piece of the model on a stage: ``kind`` is embedding, decoder, mtp or loss; ``index`` its id among the
    items of that kind in model order (decoder layer 0 .. num_layers-1, MTP layer 0 .., 0 for embedding and loss)."""

    kind: str
    index: int


@dataclass(frozen=True)
class PipelineLayout:
    """The model's pieces on ``pp_size`` pipeline ranks of ``vpp_size`` virtual chunks each. ``stages`` lists the
    ``pp_size * vpp_size`` stages in model order; ``source`` is the layout string, or how the split was made."""

    pp_size: int
    vpp_size: int
    stages: tuple[tuple[LayoutItem, ...], ...]
    source: str

    def stage_index(self, pp_rank: int, chunk: int) -> int:
        """Model-order index of rank ``pp_rank``'s virtual chunk ``chunk``."""
        if not (0 <= pp_rank < self.pp_size and 0 <= chunk < self.vpp_size):
            raise IndexError(f"(pp_rank, chunk) = ({pp_rank}, {chunk}) outside {self.pp_size} x {self.vpp_size}")
        return chunk * self.pp_size + pp_rank

    def placement(self, stage: int) -> tuple[int, int]:
        """(pp_rank, chunk) that runs model-order stage ``stage``."""
        return stage % self.pp_size, stage // self.pp_size

    def items(self, pp_rank: int, chunk: int) -> tuple[LayoutItem, ...]:
        """What rank ``pp_rank`` holds in its virtual chunk ``chunk``, in model order."""
        return self.stages[self.stage_index(pp_rank, chunk)]

    def layer_ids(self, pp_rank: int, chunk: int, kind: str = "decoder") -> tuple[int, ...]:
        """Global ids of the ``kind`` layers of rank ``pp_rank``'s chunk ``chunk`` (Megatron's
        ``get_layer_id_list``)."""
        return tuple(it.index for it in self.items(pp_rank, chunk) if it.kind == kind)

    def layers_per_stage(self, kind: str = "decoder") -> tuple[tuple[int, ...], ...]:
        """[pp_rank][chunk] count of ``kind`` layers (Megatron's ``get_num_layers_to_build``)."""
        return tuple(tuple(len(self.layer_ids(r, c, kind)) for c in range(self.vpp_size))
                     for r in range(self.pp_size))

    def stages_with(self, kind: str) -> tuple[tuple[int, int], ...]:
        """(pp_rank, chunk) of every stage holding a ``kind`` item, in model order."""
        return tuple(self.placement(i) for i, st in enumerate(self.stages) if any(it.kind == kind for it in st))

    @property
    def embedding_stage(self) -> tuple[int, int]:
        """(pp_rank, chunk) holding the input embedding."""
        return self.stages_with("embedding")[0]

    @property
    def loss_stage(self) -> tuple[int, int]:
        """(pp_rank, chunk) holding the output head and the loss."""
        return self.stages_with("loss")[0]

    @property
    def mtp_stage(self) -> tuple[int, int] | None:
        """(pp_rank, chunk) holding the MTP layers (all in one stage), None without MTP."""
        found = self.stages_with("mtp")
        return found[0] if found else None

    @property
    def mtp_standalone(self) -> bool:
        """The MTP layers sit on a rank other than the last (Megatron's ``validate_layer_layout`` return value)."""
        return self.mtp_stage is not None and self.mtp_stage[0] != self.pp_size - 1


def _expand(text: str) -> str:
    """The layout string with commas dropped and both kinds of repeat unrolled, or a ScenarioError."""
    original, text = text, text.replace(",", "")
    for pattern in (_GROUP, _CHAR):
        size = len(text) + sum(len(m.group(1)) * int(m.group(2)) for m in pattern.finditer(text))
        if size > MAX_EXPANDED_CHARS:
            raise ScenarioError(LAYOUT_FIELD, original, f"expands to more than {MAX_EXPANDED_CHARS:,} characters")
        text = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
        if pattern is _GROUP and ("(" in text or ")" in text):
            raise ScenarioError(LAYOUT_FIELD, original, "parentheses must close, not nest, and be followed by *n")
    if "*" in text:
        raise ScenarioError(LAYOUT_FIELD, original, "a * must follow one character or a (...) and precede a count")
    bad = sorted(set(text) - set(KINDS) - {"|"})
    if bad:
        raise ScenarioError(LAYOUT_FIELD, original, f"unknown character(s) {''.join(bad)!r}: known are E (embedding), "
                            f"t (transformer layer), m (MTP layer), L (loss), | (stage end), commas, ( ) *")
    return text


def _number(stages: list[str]) -> tuple[tuple[LayoutItem, ...], ...]:
    """Stages of layer characters as items with global ids, counted per kind in model order."""
    seen = dict.fromkeys(KINDS.values(), 0)
    out = []
    for stage in stages:
        row = []
        for ch in stage:
            kind = KINDS[ch]
            row.append(LayoutItem(kind, seen[kind]))
            seen[kind] += 1
        out.append(tuple(row))
    return tuple(out)


def _whole_counts(num_layers: object, mtp_layers: object) -> None:
    """The model's layer counts come from checked scenario fields: anything else is a caller's bug."""
    for name, n in (("num_layers", num_layers), ("mtp_layers", mtp_layers)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {n!r}")


def _positive(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScenarioError(field, value, "must be a positive integer")
    return value


def _build(text: str, stages: list[str], pp_size: int, num_layers: int, mtp_layers: int,
           source: str) -> PipelineLayout:
    """The layout of ``stages`` (layer characters, model order) after Megatron's checks; errors name ``text``."""
    pp = _positive("parallelism.pp_size", pp_size)
    _whole_counts(num_layers, mtp_layers)
    if len(stages) % pp:
        raise ScenarioError(LAYOUT_FIELD, text, f"{len(stages)} stages are not a multiple of parallelism.pp_size = {pp}")
    flat = "".join(stages)

    def refuse(reason: str):
        raise ScenarioError(LAYOUT_FIELD, text, reason)

    if not flat or flat[0] != "E":
        refuse(f"the first item must be E (the embedding), got {flat[:1] or 'nothing'!r}")
    if flat[-1] != "L":
        refuse(f"the last item must be L (the loss), got {flat[-1]!r}")
    if flat.count("E") != 1 or flat.count("L") != 1:
        refuse(f"E and L must appear once each, got {flat.count('E')} E and {flat.count('L')} L")
    if flat.count("t") != num_layers:
        refuse(f"{flat.count('t')} transformer layers (t), the model has {num_layers}")
    if flat.count("m") != mtp_layers:
        refuse(f"{flat.count('m')} MTP layers (m), the model has {mtp_layers}")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        refuse("transformer layers (t) must all come before the MTP layers (m)")
    vpp = len(stages) // pp
    with_mtp = [i for i, st in enumerate(stages) if "m" in st]
    if any(i // pp != vpp - 1 for i in with_mtp):
        refuse(f"MTP layers (m) must be in the last virtual chunk of their rank (chunk {vpp - 1} of {vpp}: "
               f"model-order stages {(vpp - 1) * pp} .. {vpp * pp - 1})")
    if len(with_mtp) > 1:
        refuse(f"the MTP layers (m) must all be in one stage, found in stages {with_mtp}")
    return PipelineLayout(pp, vpp, _number(stages), source)


def parse_pipeline_layout(text: object, pp_size: int, num_layers: int, mtp_layers: int = 0) -> PipelineLayout:
    """The layout that Megatron-Core's ``--pipeline-model-parallel-layout`` string ``text`` gives on ``pp_size``
    pipeline ranks, checked against the model's ``num_layers`` transformer layers and ``mtp_layers`` MTP layers."""
    if not isinstance(text, str):
        raise ScenarioError(LAYOUT_FIELD, text, "must be a string such as 'Et*3|(tt|)*29m|L'")
    stages = _expand(text).split("|")
    return _build(text, stages, pp_size, num_layers, mtp_layers, text)


def default_pipeline_layout(num_layers: int, pp_size: int, vpp_size: int = 1, mtp_layers: int = 0,
                            first_stage_layers: int | None = None,
                            last_stage_layers: int | None = None) -> PipelineLayout:
    """The layout Megatron-Core builds without a layout string: ``num_layers`` transformer layers split evenly over
    ``pp_size`` ranks, each rank's share evenly over its ``vpp_size`` virtual chunks (model-order stage ``c * pp +
    r``: chunk c of rank r); the embedding on the first stage only, the MTP layers and the loss on the last only.

    ``first_stage_layers`` / ``last_stage_layers`` are Megatron's ``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers``: the first (last) rank takes that many layers, 1/vpp_size of them per
    chunk, and the other ranks share the rest evenly. Follows ``get_num_layers_to_build``
    (``transformer_block.py``) and ``get_transformer_layer_offset`` (``transformer_layer.py``) at Megatron-LM
    d98e8a64ddf34856e74b24714e3bedb2f5a39553. Left out: ``--account-for-embedding/loss-in-pipeline-split``.
    """
    _whole_counts(num_layers, mtp_layers)
    pp = _positive("parallelism.pp_size", pp_size)
    vpp = _positive("parallelism.pp_chunks", vpp_size)
    if vpp > 1 and pp == 1:
        raise ScenarioError("parallelism.pp_chunks", vpp, "virtual chunks need parallelism.pp_size > 1")
    ends = {"parallelism.decoder_first_pipeline_num_layers": first_stage_layers,
            "parallelism.decoder_last_pipeline_num_layers": last_stage_layers}
    for field, n in ends.items():
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0 or n % vpp):
            raise ScenarioError(field, n, f"must be a whole number of layers, a multiple of parallelism.pp_chunks = "
                                          f"{vpp}")
    given = [n for n in (first_stage_layers, last_stage_layers) if n is not None]
    if pp == 1 and given:
        field, n = next((f, n) for f, n in ends.items() if n is not None)
        raise ScenarioError(field, n, "uneven first / last stages need parallelism.pp_size > 1")
    middle_ranks, middle_layers = pp - len(given), num_layers - sum(given)
    per_rank = [0] * pp
    if middle_ranks:
        if middle_layers < 0 or middle_layers % (middle_ranks * vpp):
            what = (f"the {middle_layers} layers left after the first / last stage's" if given
                    else f"{num_layers} transformer layers")
            raise ScenarioError("parallelism.pp_size", pp, f"{what} do not split evenly over {middle_ranks} "
                                f"rank(s) x {vpp} virtual chunk(s)")
        per_rank = [middle_layers // middle_ranks] * pp
    elif middle_layers:
        raise ScenarioError("parallelism.decoder_last_pipeline_num_layers", last_stage_layers,
                            f"first + last stage layers must be the model's {num_layers} with no middle stage")
    if first_stage_layers is not None:
        per_rank[0] = first_stage_layers
    if last_stage_layers is not None:
        per_rank[-1] = last_stage_layers
    stages = ["t" * (per_rank[i % pp] // vpp) for i in range(pp * vpp)]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_layers + "L"
    ends_text = ", ".join(f"{f.split('.')[1]} = {n}" for f, n in ends.items() if n is not None)
    source = f"even split of {num_layers} layers over {pp} x {vpp}" + (f" ({ends_text})" if ends_text else "")
    return _build(source, stages, pp, num_layers, mtp_layers, source)
