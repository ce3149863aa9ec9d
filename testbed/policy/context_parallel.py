"""Context parallelism (``parallelism.cp_size`` CP > 1, issue 25 item 2): each sequence
split over the CP GPUs of a context-parallel group, attention run as a ring that passes
keys and values around it, as Megatron-Core runs it with Transformer Engine's
``AttnFuncWithCPAndKVP2P`` (``cp_comm_type = "p2p"``, the default). Both backends run what
this module plans; the simulator times it (``sim.hardware.dense_layers``,
``sim.step.context_parallel_ring``), the real backend runs it on CPU ranks
(``real.rank.context_parallel``).

Followed: NVIDIA/TransformerEngine
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`` at
commit d0067d0da6cb01811b8072a7d304f0e00344ce2b (``AttnFuncWithCPAndKVP2P``,
``flash_attn_p2p_communicate``), and NVIDIA/Megatron-LM at
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (``megatron/core/utils.py``
``_get_batch_on_this_cp_rank_per_sequence_balancing``; ``multi_latent_attention.py``).

**Groups.** The CP groups are Megatron-Core's (``testbed.layout.process_groups``, order
tp-cp-ep-dp-pp): the ranks that agree on every axis but cp, ``rank = tp + TP (cp + CP dp)``;
member j of a group is its CP index j.

**The chunk split.** Each sequence of s tokens is cut into 2 CP chunks of c = s / (2 CP);
the GPU of CP index r holds chunks r and 2 CP - 1 - r, in that order (``local_positions``),
so that under the causal mask every GPU has the same work (load balance). With tensor
parallelism the TP group shares the CP rank's rows: its s / CP rows of each sequence, split
over the TP members in member order (``testbed.scenario.scenario``).

**The ring (forward).** CP steps per attention sublayer. At step i the GPU attends its
queries to the keys and values of CP index r - i (step 0: its own) while it sends the
block it holds to the next member (r + 1) and receives the next block from the previous
(r - 1): CP - 1 sends per GPU, each one *KV block* (``kv_block_bytes``: the K and V of the
CP rank's s / CP tokens of every sequence, this GPU's heads, in the model dtype). The
send of step i runs beside the attention of step i.

**The ring (backward).** The forward keeps only the last block it received (CP index
r + 1); the backward passes the blocks around again, the other way (send to r - 1,
receive from r + 1), and with them the gradients dK, dV each GPU adds to as they pass: at
step i the GPU holds the block of CP index r + i + 1 (the last step its own), computes
its queries' share of dQ and of that block's dK, dV, and adds the partial dK, dV it
received for that block. Sends per GPU: step 0 the block, steps 1 .. CP - 2 the block and
the partial dK, dV (one message of 2 blocks), step CP - 1 the partial dK, dV alone: CP
sends of CP - 1 blocks and CP - 1 gradients in all.

**MLA.** Megatron-Core's MLA hands the core attention the up-projected keys and values:
K of n heads of ``qk_nope_head_dim + qk_rope_head_dim`` (the shared RoPE key expanded
over the heads), V of n heads of ``v_head_dim`` (``multi_latent_attention.py``, the
``torch.split(kv, ...)`` and ``apply_rotary_pos_emb`` of ``k_pos_emb``), and TE's ring
sends K and V concatenated as they come (``torch.cat((k.view(-1), v.view(-1)))``). So an
MLA block is n x (d_nope + d_rope + d_v) elements a token, not the latents.

**FLOPs.** Per sequence, the queries of chunk j attend chunks 0 .. j - 1 whole and chunk j
causally. GPU r's two chunks attend r + 1/2 and 2 CP - 1 - r + 1/2 chunks' worth of keys
(counting half the diagonal block, as ``attention_core_flops`` counts the causal mask):
2 CP c^2 = s^2 / (2 CP) (query, key) pairs on every GPU, 1/CP of the sequence's s^2 / 2.
So each GPU's core FLOPs are ``attention_core_flops(s / CP, s, width)`` per sequence
(``core_flops_per_gpu``): the unsplit formula on its own tokens. Counted exactly, with
the diagonal, every GPU's pairs are s (s + 1) / (2 CP) (``attended_pairs``). Each of the
CP steps takes an equal share, 2 c^2 pairs (step 0 the diagonal blocks and the second
chunk's attention to the first; the others one chunk against two).

Everything outside attention is per token and runs on the GPU's own tokens; its MoE
layers route them (CP is not an expert axis). The dense gradients are summed over DP x CP
(Megatron-Core's ``dp_cp`` group): the planner's ``dense_sync_ops`` over all ranks, or with
tensor parallelism over the ranks of one TP index (``Planner.tp_peer_groups``), which are
DP x CP.
"""

from __future__ import annotations

import numpy as np

from testbed.layout.process_groups import data_parallel_size, orthogonal_groups
from testbed.model.transformer_shape import attention_core_flops
from testbed.model.whole_model import shape_of
from testbed.policy.collectives import CollectiveOp
from testbed.scenario.scenario import Scenario

FORWARD_LABEL = "context parallel, K and V"
BACKWARD_LABEL = "context parallel, K, V and dK, dV"


def cp_groups(scenario: Scenario) -> list[tuple[int, ...]]:
    """The context-parallel groups, Megatron-Core's (module doc), in the order of their
    first rank; member j of a group is its CP index j."""
    p = scenario.parallelism
    dp = data_parallel_size(scenario.cluster.gpus, p.tp_size, p.cp_size, p.pp_size)
    axes = (("tp", p.tp_size), ("cp", p.cp_size), ("ep", 1), ("dp", dp), ("pp", p.pp_size))
    return list(orthogonal_groups(axes, ("cp",)))


def cp_group_of(scenario: Scenario, rank: int) -> tuple[int, ...]:
    """The context-parallel group ``rank`` belongs to."""
    (group,) = [g for g in cp_groups(scenario) if rank in g]
    return group


def chunk_ids(index: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 CP) of every sequence the GPU of CP index ``index`` holds."""
    return index, 2 * cp - 1 - index


def local_positions(index: int, cp: int, seq_len: int) -> np.ndarray:
    """Positions in its sequence of the ``seq_len / cp`` rows of one sequence the GPU of CP
    index ``index`` holds, in the order it holds them (chunk ``index``, then chunk
    ``2 cp - 1 - index``; Megatron-Core's ``index_select`` of ``[cp_rank, 2 cp - cp_rank - 1]``)."""
    c = seq_len // (2 * cp)
    first, second = chunk_ids(index, cp)
    return np.concatenate([np.arange(first * c, (first + 1) * c), np.arange(second * c, (second + 1) * c)])


def attended_pairs(index: int, cp: int, seq_len: int) -> int:
    """(query, key) pairs of one sequence the GPU of CP index ``index`` computes under the
    causal mask, counted exactly (a query attends every key at or before its position):
    s (s + 1) / (2 cp) on every GPU (module doc)."""
    return int((local_positions(index, cp, seq_len) + 1).sum())


def core_flops_per_gpu(seq_len: int, cp: int, width: int, sequences: int = 1) -> float:
    """Forward FLOPs of one attention core on one GPU for ``sequences`` sequences of
    ``seq_len`` split over ``cp`` GPUs, ``width`` = heads x head dim of this GPU: 2 x 2 x
    width x s^2 / (2 cp) per sequence, the same on every GPU (module doc)."""
    return attention_core_flops(sequences * seq_len // cp, seq_len, width)


def kv_width(scenario: Scenario) -> int:
    """Elements of K and V per token this GPU's heads hold (1/TP of them): GQA 2 x
    kv_heads x head_dim, MLA heads x (d_nope + d_rope + d_v) (module doc)."""
    shape, tp = shape_of(scenario), scenario.parallelism.tp_size
    if shape.attention == "mla":
        return shape.heads // tp * (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim)
    return 2 * (shape.kv_heads // tp) * shape.head_dim


def kv_block_bytes(scenario: Scenario) -> int:
    """Bytes of one KV block a GPU sends per ring step, all of a step's tokens together
    (one micro-batch's with ``transformer.micro_batches`` 1; a pipeline's stage scenario
    holds one): K and V of the CP rank's rows, which are its TP group's tp x
    ``workload.tokens_per_rank`` tokens, at this GPU's ``kv_width``."""
    p, m = scenario.parallelism, scenario.model
    return p.tp_size * scenario.workload.tokens_per_rank * kv_width(scenario) * m.dtype_bytes


def attention_sublayers(scenario: Scenario, layer: int) -> int:
    """Attention sublayers in MoE layer ``layer``'s block: ``moe_every``, and with layer 0
    the ``first_dense_layers`` before them."""
    t = scenario.transformer
    return t.moe_every + (t.first_dense_layers if layer == 0 else 0)


def backward_send_blocks(cp: int) -> list[int]:
    """KV blocks each GPU sends at each of the backward's CP steps: 1 (the block), then
    2 (the block and the partial dK, dV) for steps 1 .. cp - 2, then 1 (dK, dV)."""
    return [1] + [2] * (cp - 2) + [1]


def is_ring_batch(ops: list[CollectiveOp]) -> bool:
    """Whether a batch of a layer's dense ops is one step of the ring."""
    return bool(ops) and ops[0].label.startswith("context parallel")


class ContextParallelOps:
    """The ring's sends of every MoE layer's block, as lists of concurrent ops (one batch
    per ring step, every GPU's send in it), in the order they run."""

    def __init__(self, scenario: Scenario):
        self.s = scenario
        self.cp = scenario.parallelism.cp_size
        self.on = self.cp > 1 and scenario.transformer.enabled
        self.groups = cp_groups(scenario) if self.on else []
        self.block_bytes = kv_block_bytes(scenario) if self.on else 0

    def steps(self, backward: bool) -> list[int]:
        """Bytes each GPU sends at each ring step of one attention sublayer that sends:
        forward CP - 1 blocks (steps 0 .. CP - 2), backward ``backward_send_blocks``."""
        if not self.on:
            return []
        if backward:
            return [k * self.block_bytes for k in backward_send_blocks(self.cp)]
        return [self.block_bytes] * (self.cp - 1)

    def block(self, layer: int, backward: bool) -> list[list[CollectiveOp]]:
        """The ring steps of MoE layer ``layer``'s attention sublayers (module doc): forward
        every GPU sends to the next member of its group, backward to the previous."""
        if not self.on:
            return []
        stage = "dense_backward" if backward else "dense"
        label = BACKWARD_LABEL if backward else FORWARD_LABEL
        shift = -1 if backward else 1
        out = []
        for k in range(attention_sublayers(self.s, layer)):
            for i, size in enumerate(self.steps(backward)):
                out.append([CollectiveOp("p2p", (g[j], g[(j + shift) % self.cp]), stage, layer, size=size,
                                         batch=len(out), label=f"{label}, attention {k}, step {i}")
                            for g in self.groups for j in range(self.cp)])
        return out
