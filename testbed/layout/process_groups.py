"""Megatron-Core's process groups: which ranks share each kind of group (issue 25, item 1).

Followed: NVIDIA/Megatron-LM ``megatron/core/parallel_state.py``, ``initialize_model_parallel``
with its ``RankGenerator`` and ``generate_masked_orthogonal_rank_groups``, at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (current, with MoE parallel folding) and at
bbaa03a097dc0bb3f1641b2dcbfcb410015a496c (the last before folding, PR !1940, commit
7f22e210). Notes: /work/notes/research/megatron_groups.md.

**The rank grid.** The axes are laid out in the order ``tp-cp-ep-dp-pp``, fastest-varying
first (Megatron's default ``order``): ``rank = tp + TP*(cp + CP*(ep + EP*(dp + DP*pp)))``.
A group of kind X holds the ranks that agree on every axis outside X and take every value of
the axes in X, listed with X's first axis varying fastest; groups of a kind come in the order
of their first rank, which is the order Megatron creates them in.

**Two layouts of the MoE layers** (``parallelism.moe_layout``):

- ``folded`` (current Megatron-Core): two grids over the same ranks. The attention and dense
  layers' grid is TP x CP x DP x PP with ``DP = world / (TP*CP*PP)``; the MoE layers' grid is
  ETP x EP x EDP x PP with ``EDP = world / (ETP*EP*PP)`` and no CP axis (the CP ranks' tokens
  are just more tokens for the router). EP may so span ranks that are TP, CP or DP peers on
  the attention side (arXiv 2504.14960, "MoE parallel folding").
- ``nested`` (before folding): one grid; EP is the inner part of DP (the DP axis split into
  EP x DP/EP), expert TP is TP, and EP must divide DP. The expert gradients are summed over
  Megatron's "data modulo expert" group with CP (``_DATA_MODULO_EXPERT_PARALLEL_GROUP_WITH_CP``,
  what its ``DistributedDataParallel`` used for expert parameters at bbaa03a), of
  ``CP * DP / EP = world / (TP*EP*PP)`` ranks: that is this module's ``edp`` in this layout.

With the order ending in ``pp``, both grids give the same PP groups (stride ``world / PP``)
and Megatron's ``EDP == DP`` assertion for other orders never applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from testbed.core.errors import ScenarioError

Group = tuple[int, ...]

MOE_LAYOUTS = ("folded", "nested")

# the kinds of group each rank belongs to, in the order a summary lists them
GROUP_KINDS = ("tp", "cp", "dp", "dp_cp", "pp", "ep", "etp", "edp", "tp_ep", "embedding")

_AXES = ("tp", "cp", "ep", "dp", "pp")  # Megatron's default order, fastest-varying first


@dataclass(frozen=True)
class RankGroups:
    """The groups of one rank, each a tuple of global ranks in Megatron's order.

    ``tp`` the attention and dense layers' tensor parallelism, ``cp`` context parallelism,
    ``dp`` data parallelism, ``dp_cp`` DP x CP (over which the dense gradients are summed),
    ``pp`` the pipeline (stage s of the group is its s-th rank), ``ep`` the MoE layers'
    expert parallelism (their token all-to-all), ``etp`` expert tensor parallelism, ``edp``
    expert data parallelism (over which the expert gradients are summed), ``tp_ep`` expert
    TP x EP (the token dispatcher's ``tp_ep`` group), ``embedding`` the first and last rank
    of the PP group (the word embedding and the output head, summed when tied), ``()`` on a
    rank of the stages between."""

    rank: int
    tp: Group
    cp: Group
    dp: Group
    dp_cp: Group
    pp: Group
    ep: Group
    etp: Group
    edp: Group
    tp_ep: Group
    embedding: Group

    def of_kind(self, kind: str) -> Group:
        """This rank's group of ``kind`` (one of ``GROUP_KINDS``)."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; one of {', '.join(GROUP_KINDS)}")
        return getattr(self, kind)


@dataclass(frozen=True)
class ProcessGroups:
    """Every rank's groups for one layout. ``dp`` = world / (TP*CP*PP) ranks of data
    parallelism on the attention side, ``edp`` = world / (ETP*EP*PP) on the MoE side;
    ``ranks[r]`` holds rank r's groups."""

    world: int
    tp: int
    cp: int
    pp: int
    ep: int
    etp: int
    moe_layout: str
    dp: int
    edp: int
    ranks: tuple[RankGroups, ...]

    def of(self, rank: int) -> RankGroups:
        """Rank ``rank``'s groups."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a world of {self.world}")
        return self.ranks[rank]


def orthogonal_groups(axes: tuple[tuple[str, int], ...], inside: tuple[str, ...]) -> tuple[Group, ...]:
    """All groups over the named axes of a rank grid, as ``generate_masked_orthogonal_rank_groups``
    forms them: ``axes`` are (name, size) fastest-varying first, ``inside`` the axes a group
    spans. Each group fixes the other axes' coordinates; its ranks and the groups themselves
    are listed with the first axis varying fastest."""
    stride, strides = 1, {}
    for name, size in axes:
        strides[name] = stride
        stride *= size

    def offsets(part):
        # every combination of the part's coordinates, its first axis varying fastest
        result = [0]
        for name, size in part:
            result = [base + i * strides[name] for i in range(size) for base in result]
        return result

    spanned = offsets([(n, s) for n, s in axes if n in inside])
    starts = offsets([(n, s) for n, s in axes if n not in inside])
    return tuple(tuple(start + r for r in spanned) for start in starts)


def _positive(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScenarioError(field, value, "must be a positive whole number")
    return value


def data_parallel_size(world: int, tp: int, cp: int, pp: int) -> int:
    """The attention side's DP, ``world / (TP*CP*PP)``; a ScenarioError naming the fields
    where that is not whole (Megatron: "world_size ... is not divisible by" TP*PP*CP)."""
    _positive("cluster.gpus", world)
    for field, value in (("parallelism.tp_size", tp), ("parallelism.cp_size", cp), ("parallelism.pp_size", pp)):
        _positive(field, value)
    if world % (tp * cp * pp):
        raise ScenarioError("parallelism.pp_size", pp,
                            f"with tp_size = {tp} and cp_size = {cp}: tp x cp x pp = {tp * cp * pp} "
                            f"does not divide the {world} GPUs of the cluster (world % (tp*cp*pp) != 0)")
    return world // (tp * cp * pp)


def _check_layout(world, tp, cp, pp, ep, etp, moe_layout) -> tuple[int, int, int]:
    """(dp, edp, etp) of a valid layout; a ScenarioError naming the fields otherwise."""
    _positive("parallelism.ep_size", ep)
    if moe_layout not in MOE_LAYOUTS:
        raise ScenarioError("parallelism.moe_layout", moe_layout, f"must be one of {', '.join(MOE_LAYOUTS)}")
    etp = tp if etp is None else _positive("parallelism.etp_size", etp)  # Megatron: ETP defaults to TP
    dp = data_parallel_size(world, tp, cp, pp)
    if moe_layout == "folded":
        if world % (etp * ep * pp):
            # parallel_state.py: world_size not divisible by expert_tensor_model_pipeline_parallel size
            raise ScenarioError("parallelism.ep_size", ep,
                                f"with etp_size = {etp} and pp_size = {pp}: etp x ep x pp = {etp * ep * pp} "
                                f"does not divide the {world} GPUs of the cluster (world % (etp*ep*pp) != 0)")
    else:
        if etp != tp:
            raise ScenarioError("parallelism.etp_size", etp,
                                f"moe_layout = 'nested' keeps expert TP = tp_size = {tp}; "
                                "a different etp_size needs moe_layout = 'folded'")
        if dp % ep:
            # bbaa03a parallel_state.py: "data_parallel_size ... is not divisible by expert_model_parallel_size"
            raise ScenarioError("parallelism.ep_size", ep,
                                f"moe_layout = 'nested' carves EP out of DP: ep_size does not divide "
                                f"DP = {world} GPUs / (tp {tp} x cp {cp} x pp {pp}) = {dp}")
    return dp, world // (etp * ep * pp), etp


def build_process_groups(world: int, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                         etp: int | None = None, moe_layout: str = "folded") -> ProcessGroups:
    """Every rank's groups as Megatron-Core's ``initialize_model_parallel`` builds them for
    ``world`` GPUs (``cluster.gpus``) and the ``parallelism`` sizes; ``etp = None`` is
    Megatron's default, expert TP = TP. A combination Megatron refuses, or ``nested`` with EP
    not dividing DP or ETP != TP, raises a ScenarioError naming the fields."""
    dp, edp, etp = _check_layout(world, tp, cp, pp, ep, etp, moe_layout)
    dense = (("tp", tp), ("cp", cp), ("ep", 1), ("dp", dp), ("pp", pp))
    if moe_layout == "folded":
        # the expert RankGenerator: tp = ETP, ep = EP, dp = EDP, cp = 1
        expert = (("tp", etp), ("cp", 1), ("ep", ep), ("dp", edp), ("pp", pp))
        edp_axes = ("dp",)
    else:
        # bbaa03a RankGenerator(independent_ep=True): the DP axis as EP (inner) x DP/EP (outer)
        expert = (("tp", tp), ("cp", cp), ("ep", ep), ("dp", dp // ep), ("pp", pp))
        edp_axes = ("dp", "cp")  # data modulo expert, with context parallel
    by_kind = {
        "tp": orthogonal_groups(dense, ("tp",)),
        "cp": orthogonal_groups(dense, ("cp",)),
        "dp": orthogonal_groups(dense, ("dp",)),
        "dp_cp": orthogonal_groups(dense, ("dp", "cp")),
        "pp": orthogonal_groups(dense, ("pp",)),
        "ep": orthogonal_groups(expert, ("ep",)),
        "etp": orthogonal_groups(expert, ("tp",)),
        "edp": orthogonal_groups(expert, edp_axes),
        "tp_ep": orthogonal_groups(expert, ("tp", "ep")),
    }
    # default_embedding_ranks: the first and last stage of each PP group (the first alone with PP 1)
    by_kind["embedding"] = tuple(tuple(dict.fromkeys((g[0], g[-1]))) for g in by_kind["pp"])
    member: dict[str, list[Group]] = {kind: [()] * world for kind in GROUP_KINDS}
    for kind, groups in by_kind.items():
        for group in groups:
            for r in group:
                member[kind][r] = group
    ranks = tuple(RankGroups(rank=r, **{kind: member[kind][r] for kind in GROUP_KINDS}) for r in range(world))
    return ProcessGroups(world=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, moe_layout=moe_layout,
                         dp=dp, edp=edp, ranks=ranks)


def groups_of_kind(groups: ProcessGroups, kind: str) -> tuple[Group, ...]:
    """Every group of ``kind`` (one of ``GROUP_KINDS``) in the layout, in Megatron's order
    (by first rank); the embedding groups are those of the PP groups' end ranks only."""
    seen: dict[Group, None] = {}
    for rank_groups in groups.ranks:
        group = rank_groups.of_kind(kind)
        if group:
            seen.setdefault(group)
    # ranks in ascending order meet each group first at its lowest rank, its first: Megatron's order
    return tuple(seen)


def _ranks_text(group: Group) -> str:
    # an arithmetic run of more than 4 ranks as [first,second..last], so a 128-rank group fits a line
    if len(group) > 4:
        step = group[1] - group[0]
        if all(b - a == step for a, b in pairwise(group)):
            return f"[{group[0]}..{group[-1]}]" if step == 1 else f"[{group[0]},{group[1]}..{group[-1]}]"
    return "[" + ",".join(str(r) for r in group) + "]"


def describe_groups(groups: ProcessGroups, rank: int) -> str:
    """One line for a run's summary: ``rank 5: tp [4,5] cp [5] dp [1,3,5,7] ...``, every kind
    of ``GROUP_KINDS``; a group of more than 4 ranks in steps of one size is written
    ``[first,second..last]`` (``[0..63]`` in steps of 1), and ``embedding -`` on a rank of a
    middle stage."""
    rank_groups = groups.of(rank)
    parts = []
    for kind in GROUP_KINDS:
        group = rank_groups.of_kind(kind)
        parts.append(f"{kind} {_ranks_text(group) if group else '-'}")
    return f"rank {rank}: " + " ".join(parts)


def groups_table(groups: ProcessGroups) -> dict:
    """The layout as plain data (a run's ``groups.json``): its sizes; ``groups``, every
    group of each kind of ``GROUP_KINDS`` once, in Megatron's order; ``member``, for each
    kind, the index in ``groups[kind]`` of rank r's group at position r (-1: none, the
    embedding group of a middle stage). Rank r's group of a kind is
    ``groups[kind][member[kind][r]]``."""
    by_kind = {kind: groups_of_kind(groups, kind) for kind in GROUP_KINDS}
    member = {}
    for kind, listed in by_kind.items():
        index = {group: i for i, group in enumerate(listed)}
        member[kind] = [index[g] if (g := groups.of(r).of_kind(kind)) else -1 for r in range(groups.world)]
    sizes = {k: getattr(groups, k) for k in ("world", "tp", "cp", "pp", "ep", "etp", "moe_layout", "dp", "edp")}
    return {**sizes, "groups": {k: [list(g) for g in v] for k, v in by_kind.items()}, "member": member}
