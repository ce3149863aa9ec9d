"""Megatron-Core's recompute by module (``--recompute-granularity selective
--recompute-modules ...``; issue 25 item 6): the tensors one transformer layer keeps from
its forward to its backward, which module's recompute frees each, and what each recompute
runs again in the backward. Per token; sizes in elements of the model dtype unless a
tensor says otherwise (``KeptTensor.fixed_bytes``).

Sources, read at these commits: NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553
(paths under ``megatron/core/``), NVIDIA/TransformerEngine
d0067d0da6cb01811b8072a7d304f0e00344ce2b (``TE:`` paths under ``transformer_engine/pytorch/``).

The names and the combinations Megatron refuses (``transformer/transformer_config.py``):
the seven of ``RECOMPUTE_MODULES`` and four for layers the testbed does not have
(560-583, 1943-1962); ``moe_act`` only with grouped expert GEMMs (1964-1967;
``sim.expert_kernel = grouped``), ``mla_up_proj`` only with MLA (1969-1973), ``shared_experts`` not with
the shared-expert overlap (1991-1998), neither ``moe_act`` nor ``layernorm`` with fp8's
delayed scaling (2000-2006), ``moe`` not with the EP all-to-all overlap of
``overlap_moe_expert_parallel_comm`` (3031-3032). ``moe`` with ``moe_act`` or with
``shared_experts`` is accepted: the inner checkpoint then runs once more (below). Megatron
reads the list only at selective granularity (its default there: ``core_attn``, 1940-1941);
the testbed refuses a list beside ``transformer.recompute = "full"``.

Two ways a recompute frees memory (transformer_config.py:581-583):

- checkpoint (``tensor_parallel/random.py:600-631``): the module runs under ``no_grad``
  and only its inputs are kept; the backward runs it again with grad, then its backward.
  ``core_attn``, ``mlp``, ``moe``, ``shared_experts``. Its output stays: the next module
  keeps it.
- checkpoint without output (random.py:848-1028): as above, and the output's storage is
  released once its consumers have run (993-996), refilled by a hook when their gradient
  arrives. ``layernorm``, ``moe_act``, ``mla_up_proj``.

Megatron-Core's Transformer Engine layer spec (``models/gpt/gpt_layer_specs.py``, every
published run's; ``norms_fused``) fuses a norm into the one linear that reads it
(TELayerNormColumnParallelLinear, which keeps the norm's input and output: TE:
module/layernorm_linear.py:526-536): GQA's input norm into linear_qkv (324; the layer's
input norm is then IdentityOp, transformer_layer.py:278) and a dense layer's pre-MLP norm
into linear_fc1 (543); MLA's input norm (296) and an MoE layer's pre-MLP norm (313, 336)
stay norms of their own (two down projections, or the router, experts and shared
experts, read them); MLA's latent norms are fused into the up projections with
``--qk-layernorm`` (247-253). ``layernorm`` recomputes only a norm of its own
(transformer_layer.py:475-477, 524-527); ``norms_fused=False`` is the local spec, every
norm its own.

The tensors (``LayerRecompute.tensors``; [split]: divided over the tensor-parallel ranks,
by heads or columns; [row]: per expert row, a kept (token, expert) slot; freed by: the
modules whose recompute frees it, none: kept whatever is recomputed):

- ``layer_input`` H: the input norm's input, the residual stream. None (every checkpoint
  keeps what it starts from).
- ``input_norm_output`` H: the first linears' input. ``layernorm`` where the norm is its
  own (MLA; every layer with ``norms_fused=False``), else none (inside linear_qkv).
- MLA: ``latents`` r_q + r_kv + d_rope (the down projections' outputs: the up projections'
  inputs, the checkpoint's inputs under ``mla_up_proj``, multi_latent_attention.py:983-987;
  the RoPE key shares the key-value latent's storage) and ``normed_latents`` r_q + r_kv
  (the fused up projections' norm outputs: ``mla_up_proj``, which runs them under
  ``no_grad``; none with ``norms_fused=False``, where they are the checkpoint's inputs).
- ``query``, ``key``, ``value`` [split]: the core attention's inputs after RoPE, kept by
  it (flash attention keeps q, k, v, its output and the softmax statistics). GQA: n d for Q,
  k d for K and V at the k key-value heads, as ``TransformerShape.attention_activation_elements``
  counts them (Transformer Engine's attention takes them unrepeated); MLA: n (d_nope + d_rope), n (d_nope + d_rope), n d_v.
  ``mla_up_proj`` (MLA: multi_latent_attention.py:455-457 discards them after the core
  attention), else none: ``core_attn``'s checkpoint keeps them as its inputs
  (attention.py:446-496).
- flash: ``softmax_stats`` n, fp32 [split]: ``core_attn``. Without flash (Korthikanti et
  al.'s 5 n s per token): ``attention_probs`` n s, with dropout ``attention_dropout_mask``
  n s bytes and ``attention_dropout_output`` n s [split]: ``core_attn``.
- ``attention_output`` [split] (n d; MLA n d_v): the output projection's input. None
  (``core_attn``'s output, kept by linear_proj).
- with dropout, ``attention_bda_mask`` H bytes (the bias-dropout-add's). None.
- ``pre_mlp_input`` H: the residual stream after attention, the pre-MLP norm's input. None.
- ``pre_mlp_norm_output`` H: the FFN's input. A dense layer: ``mlp`` with fused norms (it
  is linear_fc1's own; the checkpoint, transformer_layer.py:992-1006, keeps the residual),
  ``layernorm`` without. An MoE layer: ``layernorm`` (``moe``'s checkpoint keeps it).
- a dense layer: ``ffn_first_output`` (matrices - 1) F_d and ``ffn_activation`` F_d
  [split] (the activation's input and the second GEMM's: ``ffn_activation_elements``):
  ``mlp`` (transformer_layer.py:537-539: dense layers only).
- an MoE layer: ``router_scores`` E fp32 and ``routing_map`` E bytes (TE's fused top-k,
  TE: router.py:144; the sequence aux loss's pair, router.py:216, is left out): ``moe``;
  [row] ``expert_input`` H (the permuted token, the first grouped GEMM's input),
  ``expert_first_output`` (matrices - 1) F (the activation's input), ``expert_prob``, fp32
  (assumed: the router's dtype; the activation multiplies by it, experts.py:943-1016):
  ``moe``; ``expert_activation`` F (the second GEMM's input): ``moe_act`` or ``moe``
  (experts.py:269-276, 1019-1030). The index maps of the permutation (int32) are left out.
- shared experts (all S in one SharedExpertMLP of S F_s): ``shared_first_output``
  (matrices - 1) S F_s and ``shared_activation`` S F_s [split]; with a gate
  (shared_experts.py:200-207) ``shared_output`` H and ``shared_gate_score`` 1, the
  product's inputs: ``shared_experts`` or ``moe`` (moe_layer.py:517-529, 701-716).
- with dropout, ``mlp_bda_mask`` H bytes. None.
- Left out: the norms' fp32 statistics (1 per token and norm), RNG states.

Against ``testbed.model.whole_model.layer_activation_bytes`` (the simulator's figure): a
dense-FFN layer's tensors are its own, plus ``softmax_stats`` (4 n bytes per token, which
it leaves out). An MoE layer there keeps Korthikanti's standard FFN term (8 H elements,
split) where these keep the router's and shared experts' tensors, and its expert rows
(``expert_row_elements``: input, first GEMM's output and output, 2 H + (matrices - 1) F)
hold here input, first GEMM's output and activation, H + matrices F, and the fp32 prob:
Megatron-Core multiplies by the probability before the second GEMM, so the rows' outputs
are not kept.

What a module runs again in the backward (``LayerRecompute.work``): its forward's GEMMs
(as ``TransformerShape.attention_linears`` and ``ffn_linears`` count them), attention's
core, and the memory-bound kernels' elements read and written. ``core_attn``: the core
(without flash the whole s x s scores, their softmax and dropout); ``mlp``: the dense FFN
(and its fused norm); ``moe_act``: the activation of each row (reads (matrices - 1) F,
writes F); ``moe``: the router, the dispatch and combine once more, the permutation,
the routed and shared experts; ``layernorm``: each norm of its own (reads H, writes H);
``mla_up_proj``: the up projections, their fused latent norms and RoPE; ``shared_experts``:
their FFN and gate. Recomputes add: ``moe`` with ``moe_act`` runs the activation twice
more, the inner checkpoint running again inside the outer's recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from testbed.core.errors import ScenarioError
from testbed.model.memory_bound_kernels import ffn_activation_bytes
from testbed.model.transformer_shape import TransformerShape

FIELD = "transformer.recompute_modules"

#: the recompute modules of Megatron-Core's transformer layers (transformer_config.py:560-583)
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe_act", "moe", "layernorm", "mla_up_proj", "shared_experts")

#: Megatron-Core's other names, for layers the testbed does not model
OTHER_MEGATRON_MODULES = {"gdn_norm_out": "GatedDeltaNet's output norm", "gdp_in_proj": "GatedDeltaProduct's input",
                          "gdp_qkv": "GatedDeltaProduct's QKV", "mhc": "hyper-connections"}


#: the scenario's expert kernels (``sim.expert_kernel``) that are Megatron-Core's grouped GEMM
#: (``--moe-grouped-gemm``): a grouped launch, or Transformer Engine's multi-stream GroupedLinear
GROUPED_EXPERT_KERNELS = ("grouped", "multistream")


def check_recompute_modules(modules, shape: TransformerShape, *, full_recompute: bool = False,
                            shared_expert_overlap: bool = False, moe_a2a_overlap: bool = False,
                            fp8_delayed_scaling: bool = False, grouped_experts: bool = True) -> tuple[str, ...]:
    """The names of ``modules`` (a list), each once, in order; a ScenarioError naming
    ``transformer.recompute_modules`` for a name Megatron-Core does not know or the testbed
    does not model, or a combination Megatron refuses (module doc): ``moe_act`` without
    grouped expert GEMMs (``grouped_experts``), ``mla_up_proj`` without MLA,
    ``shared_experts`` of a model with shared experts under their overlap
    (``overlap.shared_experts``), ``moe`` under the EP all-to-all overlap
    (``moe_a2a_overlap``), ``moe_act`` or ``layernorm`` with fp8's delayed (tensor)
    scaling; any module beside full recompute."""
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
        raise ScenarioError(FIELD, modules, "a list of module names: " + ", ".join(RECOMPUTE_MODULES))
    names = tuple(dict.fromkeys(modules))  # Megatron asks "name in recompute_modules": a name twice is once
    for name in names:
        if name in OTHER_MEGATRON_MODULES:
            raise ScenarioError(FIELD, modules, f"{name} recomputes {OTHER_MEGATRON_MODULES[name]}, "
                                "a layer the testbed does not model")
        if name not in RECOMPUTE_MODULES:
            raise ScenarioError(FIELD, modules, f"{name!r} is not a module: one of " + ", ".join(RECOMPUTE_MODULES))
    refusals = (
        (full_recompute and names, ("with transformer.recompute = 'full' every layer is recomputed whole; "
                                    "modules are selective recompute's (Megatron reads them only there)")),
        ("moe_act" in names and not grouped_experts,
         "moe_act in recompute_modules is only supported with grouped expert GEMMs (sim.expert_kernel = grouped or multistream)"),
        ("mla_up_proj" in names and shape.attention != "mla",
         "mla_up_proj in recompute_modules is only supported with multi_latent_attention (transformer.attention)"),
        ("shared_experts" in names and shape.shared_experts > 0 and shared_expert_overlap,
         "shared_experts recompute cannot work with the shared-expert overlap (overlap.shared_experts)"),
        ("moe" in names and moe_a2a_overlap,
         "moe recompute cannot work with the EP all-to-all overlap (overlap_moe_expert_parallel_comm)"),
        (fp8_delayed_scaling and ("moe_act" in names or "layernorm" in names),
         "fp8's delayed scaling (model.fp8_scaling = tensor) does not support moe_act and layernorm recompute"),
    )
    for refused, reason in refusals:
        if refused:
            raise ScenarioError(FIELD, modules, reason)
    return names


@dataclass(frozen=True)
class KeptTensor:
    """One tensor a layer keeps from its forward to its backward (module doc)."""

    name: str
    elements: int  # per token, or per expert row when ``per_row``
    split: bool  # divided over the tensor-parallel ranks (heads, columns); else whole on each (1/t with SP)
    freed_by: frozenset = frozenset()  # the modules whose recompute frees it; empty: kept whatever is recomputed
    fixed_bytes: int = 0  # bytes per element whatever the model dtype (1: a bool mask, 4: fp32); 0: the model's
    per_row: bool = False  # per expert row, not per token

    def bytes(self, dtype_bytes: int) -> int:
        return self.elements * (self.fixed_bytes or dtype_bytes)


@dataclass(frozen=True)
class RecomputeWork:
    """What a recompute runs again in the backward, per token of the layer (module doc):
    GEMMs over the layer's tokens and over its expert rows, each (inputs, outputs);
    attention's core in FLOPs; elements the memory-bound kernels read and write, per token
    and per row; dispatch-and-combine exchanges of the MoE layer."""

    token_linears: tuple = ()
    row_linears: tuple = ()
    attention_flops: float = 0.0
    token_kernel_elements: int = 0
    row_kernel_elements: int = 0
    dispatches: int = 0

    def __add__(self, other: RecomputeWork) -> RecomputeWork:
        return RecomputeWork(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def flops_per_token(self, rows_per_token: float) -> float:
        """FLOPs per token of the layer: 2 per multiply-add of each GEMM, the expert GEMMs
        on ``rows_per_token`` rows, and attention's core."""
        token = sum(k * n for k, n in self.token_linears)
        row = sum(k * n for k, n in self.row_linears)
        return 2.0 * (token + rows_per_token * row) + self.attention_flops


#: the kept tensors that are a linear layer's input (a GEMM of the model's linears, not the
#: router's or attention's core): under fp8 GEMMs Transformer Engine keeps them quantized for the
#: weight gradient, one byte an element (TE: module/linear.py:600-621, ``saved_inputmat`` the
#: quantized ``inputmat``, column-wise data only; layernorm_linear.py and grouped_linear.py alike).
#: An MoE layer's pre-MLP norm output also feeds the router, a bf16 GEMM, so it stays in the model
#: dtype there (``fp8_cached``).
FP8_CACHED_INPUTS = frozenset({"input_norm_output", "normed_latents", "attention_output", "pre_mlp_norm_output",
                               "ffn_activation", "expert_input", "expert_activation", "shared_activation"})


def fp8_cached(tensor: KeptTensor, moe: bool) -> bool:
    """Whether ``tensor`` is kept in fp8 under fp8 GEMMs (``FP8_CACHED_INPUTS``)."""
    if tensor.fixed_bytes or tensor.name not in FP8_CACHED_INPUTS:
        return False
    return not (moe and tensor.name == "pre_mlp_norm_output")


def _activation(width: int, matrices: int) -> int:
    """Elements an FFN activation's forward reads and writes per token or row: the kernel's
    bytes in ``testbed.model.memory_bound_kernels`` at one byte an element."""
    return int(ffn_activation_bytes(width, matrices, 1)[0])


def _by(*modules: str) -> frozenset:
    return frozenset(modules)


@dataclass(frozen=True)
class LayerRecompute:
    """One layer of ``shape`` (``moe``: its FFN is the MoE one; ``sliding``: it attends a
    window) on sequences of ``seq_len``: what it keeps and what each recompute module
    frees and runs again. ``flash``: flash attention; ``dropout``: attention and hidden
    dropout on (Korthikanti et al.'s layer; Megatron's DeepSeek-V3 and Qwen3 recipes run
    without); ``norms_fused``: Transformer Engine's layer spec (module doc)."""

    shape: TransformerShape
    moe: bool
    seq_len: int
    sliding: bool = False
    flash: bool = True
    dropout: bool = True
    norms_fused: bool = True

    @property
    def tensors(self) -> tuple[KeptTensor, ...]:
        """Every tensor the layer keeps with no recompute, and who frees it (module doc)."""
        s, h, n = self.shape, self.shape.hidden, self.shape.heads
        mla, fused = s.attention == "mla", self.norms_fused
        out = [KeptTensor("layer_input", h, False),
               KeptTensor("input_norm_output", h, False, _by("layernorm") if mla or not fused else _by())]
        if mla:
            qk, up = n * (s.qk_nope_head_dim + s.qk_rope_head_dim), _by("mla_up_proj")
            out += [KeptTensor("latents", s.q_lora_rank + s.kv_lora_rank + s.qk_rope_head_dim, False),
                    KeptTensor("normed_latents", s.q_lora_rank + s.kv_lora_rank, False, up if fused else _by())]
            q, k, v, o = qk, qk, n * s.v_head_dim, n * s.v_head_dim
        else:
            up = _by()
            q = o = n * s.head_dim
            k = v = s.kv_heads * s.head_dim  # at the key-value heads (TransformerShape.attention_activation_elements)
        core = _by("core_attn")
        out += [KeptTensor("query", q, True, up), KeptTensor("key", k, True, up), KeptTensor("value", v, True, up)]
        if self.flash:
            out.append(KeptTensor("softmax_stats", n, True, core, fixed_bytes=4))
        else:
            scores = n * self.seq_len
            out.append(KeptTensor("attention_probs", scores, True, core))
            if self.dropout:
                out += [KeptTensor("attention_dropout_mask", scores, True, core, fixed_bytes=1),
                        KeptTensor("attention_dropout_output", scores, True, core)]
        out.append(KeptTensor("attention_output", o, True))
        if self.dropout:
            out.append(KeptTensor("attention_bda_mask", h, False, fixed_bytes=1))
        out.append(KeptTensor("pre_mlp_input", h, False))
        m = s.ffn_matrices
        if not self.moe:
            mlp = _by("mlp")
            out += [KeptTensor("pre_mlp_norm_output", h, False, mlp if fused else _by("layernorm")),
                    KeptTensor("ffn_first_output", (m - 1) * s.dense_ffn, True, mlp),
                    KeptTensor("ffn_activation", s.dense_ffn, True, mlp)]
        else:
            moe, e, f = _by("moe"), s.experts, s.expert_ffn
            out += [KeptTensor("pre_mlp_norm_output", h, False, _by("layernorm")),
                    KeptTensor("router_scores", e, False, moe, fixed_bytes=4),
                    KeptTensor("routing_map", e, False, moe, fixed_bytes=1),
                    KeptTensor("expert_input", h, False, moe, per_row=True),
                    KeptTensor("expert_first_output", (m - 1) * f, False, moe, per_row=True),
                    KeptTensor("expert_activation", f, False, _by("moe_act", "moe"), per_row=True),
                    KeptTensor("expert_prob", 1, False, moe, fixed_bytes=4, per_row=True)]
            if s.shared_experts:
                shared, width = _by("shared_experts", "moe"), s.shared_experts * s.shared_ffn_width
                out += [KeptTensor("shared_first_output", (m - 1) * width, True, shared),
                        KeptTensor("shared_activation", width, True, shared)]
                if s.shared_gate:
                    out += [KeptTensor("shared_output", h, False, shared),
                            KeptTensor("shared_gate_score", 1, False, shared)]
        if self.dropout:
            out.append(KeptTensor("mlp_bda_mask", h, False, fixed_bytes=1))
        return tuple(out)

    def kept_bytes(self, modules=(), dtype_bytes: int = 2, tp: int = 1, sequence_parallel: bool = False,
                   rows_per_token: float | None = None) -> float:
        """Bytes one GPU keeps per token of its tensor-parallel group's micro-batch with
        ``modules`` recomputed: split tensors over ``tp``, whole ones too with
        ``sequence_parallel``; expert rows at ``rows_per_token`` (default top_k: every
        token's rows, none dropped; the rows a GPU holds per token otherwise)."""
        chosen = set(modules)
        rows = (self.shape.top_k if self.moe else 0) if rows_per_token is None else rows_per_token
        total = 0.0
        for t in self.tensors:
            if t.freed_by & chosen:
                continue
            if t.per_row:
                total += t.bytes(dtype_bytes) * rows
            else:
                total += t.bytes(dtype_bytes) / (tp if t.split or sequence_parallel else 1)
        return total

    def saved_bytes(self, module: str, **kwargs) -> float:
        """Bytes per token ``module``'s recompute alone saves (``kept_bytes``'s arguments)."""
        return self.kept_bytes((), **kwargs) - self.kept_bytes((module,), **kwargs)

    def work(self, module: str) -> RecomputeWork:
        """What ``module``'s recompute runs again in this layer's backward (module doc);
        nothing where the module has nothing to recompute here."""
        s, h, m = self.shape, self.shape.hidden, self.shape.ffn_matrices
        mla = s.attention == "mla"
        if module == "core_attn":
            if self.flash:
                return RecomputeWork(attention_flops=s.attention_core_flops_per_token(self.seq_len, self.sliding))
            # unfused: the whole s x s scores (masked, not skipped), their softmax and dropout
            scores = s.heads * self.seq_len
            return RecomputeWork(attention_flops=s.attention_core_flops_per_token(self.seq_len, causal=False),
                                 token_kernel_elements=(4 if self.dropout else 2) * scores)
        if module == "mlp" and not self.moe:
            return RecomputeWork(token_linears=tuple(s.ffn_linears(s.dense_ffn)),
                                 token_kernel_elements=_activation(s.dense_ffn, m) + (2 * h if self.norms_fused else 0))
        if module == "moe_act" and self.moe:
            return RecomputeWork(row_kernel_elements=_activation(s.expert_ffn, m))
        if module == "moe" and self.moe:
            routed = RecomputeWork(token_linears=((h, s.experts),), row_linears=tuple(s.ffn_linears(s.expert_ffn)),
                                   token_kernel_elements=2 * s.experts,  # the scores: logits read, scores written
                                   # the activation; the permutation and its inverse read and write each row
                                   row_kernel_elements=_activation(s.expert_ffn, m) + 4 * h, dispatches=1)
            return self.work("shared_experts") + routed
        if module == "shared_experts" and self.moe and s.shared_experts:
            width, gate = s.shared_experts * s.shared_ffn_width, s.shared_gate
            linears = tuple(s.ffn_linears(width)) + (((h, 1),) if gate else ())
            return RecomputeWork(token_linears=linears, token_kernel_elements=_activation(width, m) + (2 * h if gate else 0))
        if module == "layernorm":
            own = (mla or not self.norms_fused) + (self.moe or not self.norms_fused)
            return RecomputeWork(token_kernel_elements=own * 2 * h)
        if module == "mla_up_proj" and mla:
            n, nope, rope, dv = s.heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
            qk, rq, rkv = n * (nope + rope), s.q_lora_rank, s.kv_lora_rank
            rope_kernel = qk + n * (nope + dv) + rope + 2 * qk + n * dv  # reads the up outputs, writes Q, K, V
            norms = 2 * (rq + rkv) if self.norms_fused else 0
            return RecomputeWork(token_linears=((rq or h, qk), (rkv, n * (nope + dv))),
                                 token_kernel_elements=rope_kernel + norms)
        if module not in RECOMPUTE_MODULES:
            raise ValueError(f"{module!r}: one of {', '.join(RECOMPUTE_MODULES)}")
        return RecomputeWork()

    def total_work(self, modules) -> RecomputeWork:
        """What ``modules`` together run again: the sum of each one's, as nested
        checkpoints run (module doc)."""
        total = RecomputeWork()
        for module in dict.fromkeys(modules):
            total = total + self.work(module)
        return total
