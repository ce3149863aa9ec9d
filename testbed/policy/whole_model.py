"""Closed-form arithmetic of a whole transformer's training step (issue 13's foundation):
parameters, FLOPs, memory per GPU, the pipeline bubble and MFU.

Both backends and the reports are to draw the whole-model figures from here, so they
are written once. The formulas and their sources:

- The transformer's shape, its parameters and forward FLOPs per token, layer by layer
  (attention: GQA or MLA; SwiGLU or gelu FFNs; routed and shared experts; sliding
  windows; MTP): ``testbed.policy.transformer_shape`` (``TransformerShape``, re-exported
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
- The 1F1B pipeline bubble: (p - 1) / (m + p - 1) of the step for p stages and m
  micro-batches; interleaved with v model chunks per stage, (p - 1) / (v m + p - 1)
  (Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters
  using Megatron-LM", §2.2).
- MFU: the model's FLOPs of a step (no recompute counted) over the step time x GPUs x
  the peak FLOP/s of one GPU (Chowdhery et al. 2022, "PaLM", appendix B).
"""

from __future__ import annotations

from testbed.policy.transformer_shape import TransformerShape, attention_core_flops

__all__ = ["ADAM_MIXED_BYTES", "TransformerShape", "activation_bytes_per_layer", "attention_core_flops",
           "block_grad_bytes", "bubble_fraction", "mfu", "moe_stack_step_flops", "optimizer_bytes_per_param",
           "shape_of", "zero_shards"]

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


def block_grad_bytes(scenario, layer: int) -> int:
    """Bytes of the gradients of MoE layer ``layer``'s block besides its router, with the
    whole transformer (0 without), on one GPU (1/tp of them under tensor parallelism):
    its attention and dense FFNs, the output head's with the last layer (ready first in
    the backward) and the input embedding's with layer 0 (ready last; a tied embedding
    is both, complete there)."""
    t, m = scenario.transformer, scenario.model
    if not t.enabled:
        return 0
    shape = shape_of(scenario)
    out = (t.moe_every * shape.attention_params + (t.moe_every - 1) * shape.dense_ffn_params) * m.dtype_bytes
    embedding = t.vocab_size * m.hidden_size * m.dtype_bytes
    if layer == m.num_layers - 1 and not t.tied_embeddings:
        out += embedding
    if layer == 0:
        out += embedding
    return out // scenario.parallelism.tp_size  # each tensor-parallel rank holds 1/tp of them


def zero_shards(scenario) -> tuple[int, int, int, int]:
    """(dense state, expert state, dense gradient, expert gradient) shards of ZeRO
    (``transformer.zero_stage``): the ranks each is divided over. A dense parameter's
    shard lives on every rank of its tensor-parallel index (world / tp ranks; with pipeline
    parallelism those of one stage, the scenario ``sim.pipeline.run`` simulates), an expert on its replicas;
    stage 1 shards the optimizer state, stage 2 the gradients too."""
    stage, replicas = scenario.transformer.zero_stage, scenario.replicas
    world = scenario.world_size // scenario.parallelism.tp_size  # a dense parameter's data-parallel ranks
    state = (world, replicas) if stage >= 1 else (1, 1)
    grads = (world, replicas) if stage >= 2 else (1, 1)
    return state + grads
