"""Ulysses attention (``parallelism.attention_parallel = "ulysses"``): the sequence
parallelism DeepSpeed-Ulysses runs attention with (Jacobs et al. 2023, arXiv 2309.14509,
§3.1; ``deepspeed/sequence/layer.py`` DistributedAttention) and MegaScale-MoE runs inside a
node (arXiv 2505.11432 §3: SP 8 beside EP 8), which both backends would plan the same way
and the simulator times.

The group is the tensor-parallel group (``parallelism.tp_size`` U consecutive GPUs of a
node). Each GPU holds seq_len / U rows of its group's sequences (its own
``workload.tokens_per_rank`` T tokens) between sublayers, and every weight whole
(replicated over the group, no tensor-parallel split): attention's Q, K, V and output
projections, the dense FFNs, the shared experts, the embedding and the output head run on
the GPU's own T rows; the MoE layers route them. Attention's core runs on whole sequences
of 1/U of the heads: before it one all-to-all per tensor turns [T rows, all heads] into
[U T rows of the group's sequences, heads / U], for Q (n heads) and for K and V (k kv
heads each, grouped-query attention); after it one all-to-all turns the core's output
[U T, n / U heads] back into [T, n]. Each GPU sends 1/U of each tensor to each other member
(``a2a_matrix``), keeping its own 1/U. The backward runs the same all-to-alls in reverse
order on the gradients (the output's first, then V's, K's and Q's). Per attention sublayer
and GPU the wire carries (U - 1) / U x T x (2 n + 2 k) x d x dtype bytes forward and the same
backward.

The dense gradients (replicated weights: every GPU of the group computes them on its own
rows) are summed over every GPU that holds the weight: the data-parallel ranks x the group
(the whole world of a stage; ``dense_weight_split`` 1). What it does not model is refused
(``check_ulysses``): heads or kv heads not divisible by U (each GPU takes whole heads), MLA,
context parallelism beside it, and Ulysses without sequence parallelism (its activations are
each GPU's own rows).
"""

from __future__ import annotations

import numpy as np

from testbed.core.errors import ScenarioError
from testbed.model.mtp_layers import mtp_modules
from testbed.model.whole_model import shape_of
from testbed.policy.collectives import CollectiveOp
from testbed.scenario.scenario import Scenario


def check_ulysses(scenario: Scenario) -> None:
    """Raise ``ScenarioError`` naming the field for what Ulysses is not modelled with (module doc)."""
    p, t = scenario.parallelism, scenario.transformer
    if p.attention_parallel != "ulysses":
        return
    u = p.tp_size
    if not t.enabled:
        raise ScenarioError("parallelism.attention_parallel", p.attention_parallel,
                            "Ulysses splits attention's sequences, which the MoE stack alone has none of: set "
                            "transformer.enabled = true")
    if u < 2:
        return
    if p.cp_size > 1:
        raise ScenarioError("parallelism.cp_size", p.cp_size, f"with parallelism.attention_parallel = ulysses "
                            f"(tp_size = {u}): Ulysses beside context parallelism is not modelled")
    if t.attention == "mla":
        raise ScenarioError("transformer.attention", t.attention, "with parallelism.attention_parallel = ulysses: "
                            "MLA's latents under Ulysses are not modelled")
    if not p.sequence_parallel:
        raise ScenarioError("parallelism.sequence_parallel", False, "with parallelism.attention_parallel = ulysses: "
                            "each GPU holds its own rows of the group's sequences (set sequence_parallel = true)")
    for name, heads in (("transformer.num_heads", t.num_heads), ("transformer.num_kv_heads", t.kv_heads)):
        if heads % u:
            raise ScenarioError(name, heads, f"is not divisible by parallelism.tp_size = {u}: Ulysses gives each "
                                "GPU of the group whole heads (DeepSpeed-Ulysses' constraint)")


def a2a_matrix(members: int, per_gpu_bytes: int) -> np.ndarray:
    """The byte matrix of one Ulysses all-to-all: each of ``members`` GPUs sends 1/members of
    its ``per_gpu_bytes`` tensor to every other member (its own share stays: diagonal 0)."""
    share = per_gpu_bytes // members
    matrix = np.full((members, members), share, dtype=np.int64)
    np.fill_diagonal(matrix, 0)
    return matrix


class UlyssesOps:
    """Lists of concurrent ops (one per group), in the order they run, of a block's attentions."""

    def __init__(self, scenario: Scenario, groups: list[tuple[int, ...]]):
        self.s, self.groups = scenario, groups
        m, shape = scenario.model, shape_of(scenario)
        self.u = scenario.parallelism.tp_size
        tokens = scenario.workload.tokens_per_rank
        per_head = tokens * shape.head_dim * m.dtype_bytes  # one head's values of the GPU's own rows, bytes
        #: bytes of each tensor a GPU holds of its own rows, in the forward's order: Q, K, V (kv heads)
        self.qkv = [("Q", shape.heads * per_head), ("K", shape.kv_heads * per_head), ("V", shape.kv_heads * per_head)]
        self.output = ("output", shape.heads * per_head)
        self.model_layers = m.num_layers - mtp_modules(scenario)

    def attentions(self, layer: int) -> int:
        """Attention sublayers of MoE layer ``layer``'s block: ``moe_every`` (with layer 0 the
        dense-first layers' too), an MTP module's one."""
        t = self.s.transformer
        if layer >= self.model_layers:
            return 1
        return t.moe_every + (t.first_dense_layers if layer == 0 else 0)

    def attention_parts(self, backward: bool) -> list[tuple[str, int]]:
        """(tensor, bytes a GPU holds) of one attention's all-to-alls in the order they run."""
        forward = [*self.qkv, self.output]
        return list(reversed(forward)) if backward else forward

    def block(self, layer: int, backward: bool) -> list[list[CollectiveOp]]:
        stage = "dense_backward" if backward else "dense"
        parts = [(k, what, size) for k in range(self.attentions(layer))
                 for what, size in self.attention_parts(backward)]
        return [[CollectiveOp("all_to_all_v", g, stage, layer, matrix=a2a_matrix(self.u, size), batch=b,
                              label=f"ulysses, attention {k} {what}") for g in self.groups]
                for b, (k, what, size) in enumerate(parts)]
