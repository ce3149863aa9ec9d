"""Closed-form arithmetic of a whole transformer's training step (issue 13's foundation):
parameters, FLOPs, memory per GPU, the pipeline bubble and MFU.

Both backends and the reports are to draw the whole-model figures from here, so they
are written once. The formulas and their sources:

- The transformer's shape, its parameters and forward FLOPs per token, layer by layer
  (attention: GQA or MLA; SwiGLU or gelu FFNs; routed and shared experts; sliding
  windows; MTP): ``testbed.model.transformer_shape`` (``TransformerShape``, re-exported
  here). A step is 3 x the forward (the backward is twice it); full recompute adds one
  forward more. So a dense transformer step is ~6 x parameters x tokens (Kaplan et al.
  2020, "Scaling laws for neural language models", §2.1).
- Mixed-precision Adam keeps, per parameter, bf16 weights (2 B) and gradients (2 B), and
  fp32 master weights, first and second moments (4 + 4 + 4 B): 16 B (Rajbhandari et al.
  2020, "ZeRO", §3.1, with K = 12). ZeRO stage 1 shards the 12 B of optimizer state over
  the data-parallel group, stage 2 the gradients too.
- Activations of one layer for one micro-batch of b sequences (Korthikanti et al. 2022,
  "Reducing activation recomputation in large transformer models", §4.1, eq. 2): s b H
  (34 + 5 n s / H) bytes in 16-bit, divided by t under tensor and sequence parallelism
  (eq. 5: s b H / t (34 + 5 n s / H)); full recompute keeps only the layer input, 2 s b
  H bytes (/ t with sequence parallelism). Flash attention does not store the n s x s
  scores: the 5 n s / H term is dropped when ``flash`` is set.
- Activations of a layer of the models people train (``layer_activation_bytes``): the
  standard layer's above with its attention and dense-FFN terms at the shape's own widths
  (``TransformerShape.attention_activation_elements``, ``ffn_activation_elements``): a
  dense layer of F_d keeps s b H (18 + 4 F_d / H) with gelu, Megatron-LM's
  theoretical_memory_usage formula, and s b H (18 + 6 F_d / H) with SwiGLU, whose first
  GEMM writes 2 F_d (Megatron-Core's SwiGLU keeps it for its backward); MLA keeps its
  heads' Q, K, V and output input and its latents. An MoE layer has no dense FFN (issue
  25): of Korthikanti's FFN term, 19 s b H (its input 2, first GEMM's output 8, gelu's
  output 8, dropout mask 1), it keeps the mask only, and the router's fp32 scores and
  routing map (E x (4 + 1) bytes a token, Megatron-Core's tensors as
  ``testbed.model.recompute_modules`` lists them); the FFN's input (the pre-MLP norm's
  output) is the MoE layer's input, which the phase builder counts with its expert rows
  (``sim.step.phase_builder``'s ``activation_bytes``), and the rows
  (``expert_row_elements``) are Megatron-Core's: the expert's input, first GEMM's output
  and activation, H + m F; its shared experts' are ``sim.hardware.shared_experts``'.
- Megatron-Core's recompute by module (``--recompute-modules``, issue 25 item 6;
  ``transformer.recompute_modules``, ``recompute_modules_of``): each of those figures less
  what the modules save of it, byte for byte as ``testbed.model.recompute_modules``
  (``LayerRecompute``) counts the tensors each frees (``recompute_savings``: the layer's
  own tensors per token, the expert rows' per row, the shared experts' per token). The
  shared experts' figure is not Megatron-Core's tensors (here (m - 1) F_s + H a token,
  there m F_s and with a gate H + 1 more), and an expert row here leaves out the fp32
  probability Megatron-Core keeps (4 bytes a row: the activation multiplies by it), so a
  saving is taken off the figure it belongs to, and where it is larger than that figure
  (``moe``'s rows, by that probability; ``shared_experts``' or ``moe``'s with F_s > H or a
  gate) the part keeps nothing: every tensor of it is freed. A saving is Megatron-Core's
  even where the figure never counted the tensor (``core_attn`` frees flash attention's
  softmax statistics, 4 n bytes a token, which ``layer_activation_bytes`` leaves out).
  Without modules every figure is the one above.
- FP8 GEMMs' casts and weight copies: ``testbed.model.fp8_casts``.
- The 1F1B pipeline bubble: (p - 1) / (m + p - 1) of the step for p stages and m
  micro-batches; interleaved with v model chunks per stage, (p - 1) / (v m + p - 1)
  (Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters
  using Megatron-LM", §2.2).
- MFU: the model's FLOPs of a step (no recompute counted) over the step time x GPUs x
  the peak FLOP/s of one GPU (Chowdhery et al. 2022, "PaLM", appendix B).
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.model.mtp_layers import mtp_block_params, mtp_modules
from testbed.model.recompute_modules import LayerRecompute, fp8_cached
from testbed.model.transformer_shape import TransformerShape, attention_core_flops

__all__ = ["ADAM_MIXED_BYTES", "SHARED_EXPERT_TENSORS", "RecomputeSavings", "TransformerShape",
           "activation_bytes_per_layer", "attention_core_flops", "block_attention_layers", "block_grad_bytes", "bubble_fraction",
           "expert_row_bytes", "expert_row_elements", "layer_activation_bytes", "mfu", "mla_down_projection_params",
           "moe_layer_shape",
           "moe_stack_step_flops", "optimizer_bytes_per_param", "recompute_modules_of", "recompute_savings", "shape_of",
           "shared_expert_grad_bytes", "shared_expert_params_per_gpu", "zero_shards"]

#: bytes per parameter of mixed-precision Adam: bf16 weight, bf16 gradient, fp32 master, m, v
ADAM_MIXED_BYTES = {"weight": 2, "grad": 2, "master": 4, "moment1": 4, "moment2": 4}


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Share of a pipelined step that each stage idles: (p - 1) / (v m + p - 1) for p
    stages, m micro-batches and v model chunks per stage (1: plain 1F1B)."""
    if stages <= 0 or micro_batches <= 0 or chunks <= 0:
        raise ValueError(f"stages = {stages}, micro_batches = {micro_batches}, chunks = {chunks}: must be > 0")
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def optimizer_bytes_per_param(zero_stage: int = 0, dp: int = 1, bytes_per_part=ADAM_MIXED_BYTES) -> dict[str, float]:
    """Bytes one GPU holds per parameter it hosts, by part, under ZeRO ``zero_stage`` over
    ``dp`` data-parallel ranks: stage 1 shards master weights and moments, stage 2 the
    gradients too (stage 3, the weights, is not modelled)."""
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero_stage = {zero_stage}: 0, 1 or 2")
    if dp <= 0:
        raise ValueError(f"dp = {dp}: must be > 0")
    out = dict(bytes_per_part)
    if zero_stage >= 1:
        for part in ("master", "moment1", "moment2"):
            out[part] = out[part] / dp
    if zero_stage >= 2:
        out["grad"] = out["grad"] / dp
    return out


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: bool = False,
                               flash: bool = True) -> float:
    """Bytes of activations one transformer layer keeps for the backward, for one
    micro-batch of ``micro_batch`` sequences in 16-bit (Korthikanti et al. 2022, eq. 2-5;
    see the module doc)."""
    s, b, h = seq_len, micro_batch, hidden
    if recompute:
        return 2.0 * s * b * h / (tp if sequence_parallel else 1)
    scores = 0.0 if flash else 5.0 * heads * s / h
    if sequence_parallel:
        return s * b * h / tp * (34.0 + scores)
    # without sequence parallelism the layer norms' and dropouts' 10 s b h stay whole
    return s * b * h * (10.0 + 24.0 / tp + scores / tp)


def layer_activation_bytes(shape: TransformerShape, seq_len: int, micro_batch: int, moe: bool, tp: int = 1,
                           sequence_parallel: bool = False, recompute: bool = False, flash: bool = True,
                           recompute_modules=(), dtype_bytes: int = 2, fp8_input_bytes: float = 0.0) -> float:
    """Bytes of activations one layer of ``shape`` keeps for the backward, for one
    micro-batch of ``micro_batch`` sequences of ``seq_len``, in a model dtype of
    ``dtype_bytes`` bytes (2: 16-bit; the 16-bit figure scaled by ``dtype_bytes / 2``):
    Korthikanti et al.'s standard layer (``activation_bytes_per_layer``: attention of width
    H, a gelu FFN of 4 H) with the terms the shape changes taken at its own widths -
    attention's (``TransformerShape.attention_activation_elements``: head_dim, MLA's
    tensors and latents) and, in a dense-FFN layer (``moe`` false), the FFN's
    (``ffn_activation_elements`` of its F_d: SwiGLU's 3 F_d against gelu's 2 F_d). The
    standard terms' parts split over ``tp`` ranks stay split, the rest whole (all split
    with sequence parallelism). An MoE layer (``moe``) keeps none of the standard FFN term
    but its dropout mask, and its router's fp32 scores and routing map (E x 5 bytes a
    token, whole; 1/t with sequence parallelism): its FFN's input and its expert rows are
    the MoE layer's own (module doc). With full ``recompute`` only the layer's input. With
    ``recompute_modules`` (Megatron-Core's names; not with full ``recompute``) less what
    they free of the layer's own tensors (``recompute_savings``' ``layer``, per token of
    the micro-batch, at ``dtype_bytes``: masks and fp32 tensors at their own sizes). With
    ``fp8_input_bytes`` (fp8 GEMMs, not with full ``recompute``) the linears' inputs kept at
    that many bytes an element (``recompute_savings``)."""
    if recompute and recompute_modules:
        raise ValueError("recompute_modules are selective recompute's: not with full recompute")
    base = activation_bytes_per_layer(seq_len, micro_batch, shape.hidden, shape.heads, tp, sequence_parallel,
                                      recompute, flash)
    out = base
    if not recompute:
        h = shape.hidden
        split, whole = shape.attention_activation_elements
        split -= 4 * h  # the standard layer's Q, K, V and output-projection input (Korthikanti's 8 s b h)
        if not moe:
            split += shape.ffn_activation_elements(shape.dense_ffn) - 8 * h  # its FFN's 16 s b h
        else:  # no dense FFN: its first GEMM's and gelu's outputs (16 s b H, split), its input (2 s b H, whole)
            split -= 8 * h
            whole -= h
        if split != 0 or whole != 0:
            tokens = seq_len * micro_batch
            out = base + 2.0 * tokens * ((split + whole) / tp if sequence_parallel else split / tp + whole)
    out = out * dtype_bytes / 2.0
    if moe and not recompute:  # the router's fp32 scores and bool routing map (testbed.model.recompute_modules)
        out += seq_len * micro_batch * shape.experts * (4 + 1) / (tp if sequence_parallel else 1)
    if recompute_modules or (fp8_input_bytes and not recompute):
        saved = recompute_savings(shape, moe, recompute_modules, seq_len, dtype_bytes, tp, sequence_parallel, flash,
                                  fp8_input_bytes=0.0 if recompute else fp8_input_bytes)
        out -= seq_len * micro_batch * saved.layer
    return out


#: the tensors of a layer (``LayerRecompute.tensors``) the simulator counts as the shared
#: experts' (``sim.hardware.shared_experts``), not the layer's own
SHARED_EXPERT_TENSORS = frozenset({"shared_first_output", "shared_activation", "shared_output", "shared_gate_score"})


@dataclass(frozen=True)
class RecomputeSavings:
    """Bytes Megatron-Core's recompute modules free of one layer, split as the simulator
    counts its activations (module doc): ``layer`` per token of the tensor-parallel group's
    micro-batch, of the layer's own tensors (``layer_activation_bytes``); ``row`` per expert
    row (``expert_row_elements``); ``shared`` per token, of the shared experts' tensors."""

    layer: float = 0.0
    row: float = 0.0
    shared: float = 0.0


def recompute_savings(shape: TransformerShape, moe: bool, modules, seq_len: int = 1, dtype_bytes: int = 2,
                      tp: int = 1, sequence_parallel: bool = False, flash: bool = True,
                      fp8_input_bytes: float = 0.0) -> RecomputeSavings:
    """What ``modules`` free of one layer of ``shape`` (``moe``: an MoE layer) on sequences
    of ``seq_len`` in a dtype of ``dtype_bytes`` (``testbed.model.recompute_modules``:
    ``LayerRecompute``'s tensors with Transformer Engine's fused norms and dropout, as the
    Korthikanti layer here keeps its masks): each freed tensor's bytes in the part it
    belongs to, split as ``LayerRecompute.kept_bytes`` splits them (over ``tp``; whole
    ones too with ``sequence_parallel``). The three parts sum to ``saved_bytes``' figure.
    With ``fp8_input_bytes`` (fp8 GEMMs: bytes an element of a quantized input, 1 and its
    scales) besides, what keeping the linears' inputs quantized saves of the tensors no
    module frees (``recompute_modules.fp8_cached``): ``dtype_bytes - fp8_input_bytes`` an
    element."""
    chosen = set(modules)
    parts = {"layer": 0.0, "row": 0.0, "shared": 0.0}
    for t in LayerRecompute(shape, moe, seq_len, flash=flash).tensors:
        if t.freed_by & chosen:
            saved = t.bytes(dtype_bytes)
        elif fp8_input_bytes and fp8_cached(t, moe):
            saved = t.elements * max(dtype_bytes - fp8_input_bytes, 0.0)
        else:
            continue
        if t.per_row:
            parts["row"] += saved
            continue
        part = "shared" if t.name in SHARED_EXPERT_TENSORS else "layer"
        parts[part] += saved / (tp if t.split or sequence_parallel else 1)
    return RecomputeSavings(**parts)


def recompute_modules_of(scenario) -> tuple[str, ...]:
    """The recompute modules a scenario names (``transformer.recompute_modules``, a
    comma-separated string), in order; none without the whole transformer."""
    t = scenario.transformer
    if not t.enabled:
        return ()
    return tuple(n.strip() for n in t.recompute_modules.split(",") if n.strip())


def expert_row_elements(hidden: int, ffn: int, ffn_matrices: int = 2) -> int:
    """Elements an MoE layer keeps for the backward per expert row (a kept (token, expert)
    slot), Megatron-Core's tensors (``testbed.model.recompute_modules``): the expert's
    input (H, the first grouped GEMM's), its first GEMM's output ((matrices - 1) F: gelu's
    F, SwiGLU's gate and up 2 F, which the activation keeps for its backward) and the
    activation's output (F, the second GEMM's input). Not its output: Megatron-Core
    multiplies by the routing probability inside the activation, before the second GEMM
    (NVIDIA/Megatron-LM d98e8a64, megatron/core/transformer/moe/experts.py:943-1030), so
    no gradient needs the output (issue 25: the rows kept 2 H + (matrices - 1) F before).
    The fp32 probability (4 bytes a row) is left out."""
    return hidden + ffn_matrices * ffn


def expert_row_bytes(hidden: int, ffn: int, ffn_matrices: int, dtype_bytes: int, saved: float = 0.0) -> float:
    """Bytes an MoE layer keeps per expert row in a dtype of ``dtype_bytes``:
    ``expert_row_elements``' less ``saved`` (``RecomputeSavings.row``), none where the
    saving is larger (``moe``'s recompute frees every tensor of the row; module doc)."""
    return max(expert_row_elements(hidden, ffn, ffn_matrices) * dtype_bytes - saved, 0.0)


def mfu(model_flops: float, step_time_s: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``model_flops`` of a step (no recompute) over what
    ``gpus`` GPUs of ``peak_flops`` FLOP/s each could do in ``step_time_s`` seconds."""
    if step_time_s <= 0 or gpus <= 0 or peak_flops <= 0:
        raise ValueError(f"step_time_s = {step_time_s}, gpus = {gpus}, peak_flops = {peak_flops}: must be > 0")
    return model_flops / (step_time_s * gpus * peak_flops)


def moe_stack_step_flops(hidden: int, ffn: int, experts: int, layers: int, tokens: int, kept_slots: float) -> float:
    """Model FLOPs of a training step of the MoE layer stack the testbed runs today (no
    attention or dense layers): every kept (token, expert) slot through its expert's two
    matrices (4 H F) and every token of every layer through the router (2 H E), forward
    and backward (3 x the forward). ``tokens``: tokens per layer over all ranks;
    ``kept_slots``: slots kept under capacity over all ranks and layers."""
    return 3.0 * (kept_slots * 4.0 * hidden * ffn + tokens * layers * 2.0 * hidden * experts)


def shape_of(scenario) -> TransformerShape:
    """The transformer a scenario describes (``[transformer]``): ``first_dense_layers``
    dense layers, then ``model.num_layers`` MoE layers, each with ``moe_every - 1``
    dense layers before it; attention in all; the fields of the models people train
    (SwiGLU, shared experts, MLA, sliding windows, MTP, biases) as the scenario sets them."""
    m, t, r = scenario.model, scenario.transformer, scenario.router
    return TransformerShape(layers=t.first_dense_layers + m.num_layers * t.moe_every, hidden=m.hidden_size,
                            heads=t.num_heads, kv_heads=t.kv_heads,
                            dense_ffn=t.dense_ffn_hidden_size or 4 * m.hidden_size,
                            vocab=t.vocab_size, experts=m.num_experts, expert_ffn=m.ffn_hidden_size, top_k=m.top_k,
                            moe_every=t.moe_every, tied_embeddings=t.tied_embeddings,
                            ffn_matrices=m.ffn_matrices, ffn_bias=m.ffn_bias, shared_experts=m.shared_experts,
                            shared_ffn=m.shared_ffn, shared_gate=m.shared_expert_gate,
                            # gpt-oss's router bias; DeepSeek-V3's balancing bias (aux-loss-free, §2.1.2)
                            router_bias=m.ffn_bias or r.bias_update_rate > 0,
                            first_dense=t.first_dense_layers, head_size=t.head_dim, attention=t.attention,
                            q_lora_rank=t.q_lora_rank, kv_lora_rank=t.kv_lora_rank,
                            qk_nope_head_dim=t.qk_nope_head_dim, qk_rope_head_dim=t.qk_rope_head_dim,
                            v_head_dim=t.v_head_dim, attention_bias=t.attention_bias,
                            attention_sinks=t.attention_sinks, sliding_window=t.sliding_window,
                            full_attention_every=t.full_attention_every, mtp_layers=t.mtp_layers)


def moe_layer_shape(scenario) -> TransformerShape:
    """One MoE layer of the scenario as a shape of its own, for the figures of its FFN
    (routed and shared experts, router) whether or not the whole transformer is modelled:
    ``shape_of``'s FFN fields, one layer, attention left at one head (not to be read)."""
    m, r = scenario.model, scenario.router
    return TransformerShape(layers=1, hidden=m.hidden_size, heads=1, kv_heads=1, dense_ffn=0, vocab=1,
                            experts=m.num_experts, expert_ffn=m.ffn_hidden_size, top_k=m.top_k,
                            ffn_matrices=m.ffn_matrices, ffn_bias=m.ffn_bias, shared_experts=m.shared_experts,
                            shared_ffn=m.shared_ffn, shared_gate=m.shared_expert_gate,
                            router_bias=m.ffn_bias or r.bias_update_rate > 0)


def is_ulysses(scenario) -> bool:
    """Attention runs as Ulysses over a tensor-parallel group of more than one GPU."""
    p = scenario.parallelism
    return scenario.transformer.enabled and p.attention_parallel == "ulysses" and p.tp_size > 1


def dense_weight_split(scenario) -> int:
    """The GPUs each dense weight is split over: ``parallelism.tp_size`` under tensor
    parallelism, 1 under Ulysses (every weight whole, replicated over the group)."""
    return 1 if is_ulysses(scenario) else scenario.parallelism.tp_size


def shared_expert_params_per_gpu(scenario) -> int:
    """Parameters of one MoE layer's shared experts (and their gate) on one GPU: under
    tensor parallelism (``parallelism.tp_size`` t) each holds 1/t of their FFNs (Megatron-Core's
    SharedExpertMLP is an MLP: column-parallel fc1, row-parallel fc2) and the whole gate
    (H, replicated: ``gate_weight``); 0 without shared experts."""
    m = scenario.model
    if not m.shared_experts:
        return 0
    shape = moe_layer_shape(scenario)
    gate = shape.hidden if shape.shared_gate else 0
    return (shape.shared_expert_params - gate) // dense_weight_split(scenario) + gate


def shared_expert_grad_bytes(scenario) -> int:
    """Bytes of one MoE layer's shared-expert gradients (and their gate's) on one GPU, as
    their weights (``shared_expert_params_per_gpu``; 0 without)."""
    return shared_expert_params_per_gpu(scenario) * scenario.model.dtype_bytes


def mla_down_projection_params(shape: TransformerShape) -> int:
    """Weights of one layer's MLA down projections, H x r_q and H x (r_kv + d_rope): whole on
    every tensor-parallel rank in Megatron-Core (TELinear ``parallel_mode = "duplicated"``,
    ``megatron/core/transformer/multi_latent_attention.py``), unlike its up and output
    projections, split by heads; 0 for GQA. With sequence parallelism their gradients are
    summed over the tensor-parallel group (``finalize_model_grads``'
    ``_allreduce_non_tensor_model_parallel_grads``: their ``sequence_parallel`` attribute)."""
    if shape.attention != "mla":
        return 0
    return shape.hidden * (shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_head_dim)


def block_attention_layers(scenario, layer: int) -> int:
    """Attention sublayers whose weights MoE layer ``layer``'s bucket carries (``block_grad_bytes``,
    ``scenario`` the controller's): its block's ``moe_every``, with layer 0 the dense-first
    layers', with the last layer the MTP modules' (one each)."""
    t, m = scenario.transformer, scenario.model
    if not t.enabled:
        return 0
    mtp = mtp_modules(scenario)
    out = t.moe_every if layer < m.num_layers - mtp else 0
    if layer == 0:
        out += t.first_dense_layers
    if layer == m.num_layers - 1:
        out += mtp
    return out


def block_grad_bytes(scenario, layer: int) -> int:
    """Bytes of the gradients of MoE layer ``layer``'s block besides its router, on one
    GPU, ``scenario`` the controller's (``testbed.model.mtp_layers.controller_scenario``:
    the model's, and with D MTP modules its last D MoE layers theirs): with the whole
    transformer (1/tp of them under tensor parallelism) its attention and dense FFNs (an
    MTP module's MoE layer none), with layer 0 the dense-first layers'
    (``transformer.first_dense_layers``) and the input embedding's (ready last; a tied
    embedding is both, complete there), with the last layer the output head's and the MTP
    modules' projections and attentions (``mtp_block_params``; ready first in the
    backward); and the layer's shared experts' (``shared_expert_grad_bytes``, whole, the
    MoE stack's too). The sum the planner's ``dense_sync`` buckets all-reduce."""
    t, m = scenario.transformer, scenario.model
    shared = shared_expert_grad_bytes(scenario)
    if not t.enabled:
        return shared
    shape = shape_of(scenario)
    mtp = mtp_modules(scenario)
    out = 0
    if layer < m.num_layers - mtp:  # the model's MoE layers: their blocks
        out = (t.moe_every * shape.attention_params + (t.moe_every - 1) * shape.dense_ffn_params) * m.dtype_bytes
    embedding = t.vocab_size * m.hidden_size * m.dtype_bytes
    if layer == m.num_layers - 1 and not t.tied_embeddings:
        out += embedding
    if layer == m.num_layers - 1 and mtp:
        out += mtp * mtp_block_params(shape) * m.dtype_bytes
    if layer == 0:
        out += embedding + t.first_dense_layers * (shape.attention_params + shape.dense_ffn_params) * m.dtype_bytes
    # each tensor-parallel rank holds 1/tp of them, but MLA's down projections whole (replicated)
    replicated = block_attention_layers(scenario, layer) * mla_down_projection_params(shape) * m.dtype_bytes
    return (out - replicated) // dense_weight_split(scenario) + replicated + shared


def zero_shards(scenario) -> tuple[int, int, int, int]:
    """(dense state, expert state, dense gradient, expert gradient) shards of ZeRO
    (``transformer.zero_stage``): the ranks each is divided over. A dense parameter's
    shard lives on every rank of its tensor-parallel index (world / tp ranks; with pipeline
    parallelism those of one stage, the scenario ``sim.pipeline.run`` simulates), an expert on its replicas;
    stage 1 shards the optimizer state, stage 2 the gradients too."""
    stage, replicas = scenario.transformer.zero_stage, scenario.replicas
    world = scenario.world_size // dense_weight_split(scenario)  # a dense parameter's data-parallel ranks
    state = (world, replicas) if stage >= 1 else (1, 1)
    grads = (world, replicas) if stage >= 2 else (1, 1)
    return state + grads
