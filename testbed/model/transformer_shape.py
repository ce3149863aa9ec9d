"""The shape of one transformer and its per-layer closed forms: the parameters and forward
FLOPs per token of each layer's attention, dense FFN, routed and shared experts and
router, of the embedding and head, the norms and the multi-token-prediction modules.
``testbed.model.whole_model`` builds a step's figures (memory, MFU) on it and
``testbed.model.model_card`` a model's totals; the simulator reads the per-layer figures.

The formulas and their sources:

- Attention, grouped-query (GQA; Ainslie et al. 2023): Q and O of H x n d, K and V of
  H x k d for n query heads and k key/value heads of dimension d (H / n unless given:
  Qwen3's 128 with H 4096 and 64 heads). Biases: of Q, K, V (Qwen2) or of all four
  (gpt-oss); attention sinks: one logit per head (gpt-oss).
- Attention, multi-head latent (MLA; DeepSeek-V2 §2.1, HF ``modeling_deepseek.py``): the
  query through a latent of rank r_q (H x r_q, r_q x n (d_nope + d_rope)) or straight
  from H; keys and values from one latent of rank r_kv plus a shared RoPE key
  (H x (r_kv + d_rope)), up to n (d_nope + d_v); the output n d_v x H; an RMSNorm on
  each latent.
- FFN: 2 matrices (gelu: H x F, F x H) or 3 (SwiGLU: gate and up H x F, down F x H;
  Shazeer 2020); with biases (gpt-oss) (matrices - 1) F + H more. An MoE layer: a router
  H x E (and a bias of E: gpt-oss's router, DeepSeek-V3's balancing bias), E routed
  experts, shared experts every token passes (DeepSeek's, Qwen2-MoE's with a sigmoid
  gate H x 1).
- Layers: ``first_dense`` dense-FFN layers (DeepSeek-V3: 3), then one MoE layer in
  every ``moe_every`` (the ``moe_every - 1`` before it dense). With a sliding window,
  layer i attends the whole sequence when (i + 1) % ``full_attention_every`` == 0, the
  window otherwise (gpt-oss: alternating from a sliding layer 0).
- Norms: an RMSNorm (H) before attention and before the FFN of every layer, one after
  the last; query/key norms (Qwen3, OLMoE) are left out (under 1e-5 of the parameters).
  ``params`` leaves every norm out, as the simulator and the real backend count;
  ``norm_params`` are those.
- MTP (DeepSeek-V3 §2.2): each module an RMSNorm of the hidden state and of the next
  token's embedding, a projection 2H x H, one transformer layer (an MoE one when the
  last layer is) and a norm before the output head; the embedding and head are the
  main model's (shared), run once more per module.
- The GEMMs' shapes (``attention_linears``, ``ffn_linears``: one per Megatron-Core
  Linear, SwiGLU's gate and up fused) and the activations a layer keeps per token
  beyond its input (``attention_activation_elements``, ``mla_up_proj_elements``,
  ``ffn_activation_elements``), which ``testbed.model.whole_model`` turns into bytes.
- FLOPs, forward, per token: 2 per multiply-add of every matrix weight the token meets
  (the input embedding is a lookup: none; biases and norms: none, as Megatron-LM
  counts), plus attention's core: 2 x 2 x keys x n d (QK^T and the weighted values; MLA:
  2 keys n (d_nope + d_rope) + 2 keys n d_v), keys being the positions a query
  attends: s / 2 of a causal sequence of s (flash attention skips the masked half), the
  band of a sliding window w < s: w - w^2 / (2 s) on average.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BIASES = ("none", "qkv", "all")


def attended_keys(seq_len: int, window: int = 0, causal: bool = True) -> float:
    """Positions a query attends on average in a sequence of ``seq_len``: all of them
    (not causal), half (causal: the lower triangle of the scores), or the band of a
    causal sliding ``window`` shorter than the sequence, w - w^2 / (2 s) (its area
    s w - w^2 / 2 over s queries)."""
    if not causal:
        if window:
            raise ValueError(f"window = {window}: a sliding window is causal here")
        return float(seq_len)
    if window and window < seq_len:
        return window - window * window / (2.0 * seq_len)
    return seq_len * 0.5


def attention_core_flops(tokens: int, seq_len: int, width: int, causal: bool = True, window: int = 0) -> float:
    """FLOPs of attention's core (scores and weighted values) in the forward, for ``tokens``
    tokens attending over sequences of ``seq_len`` with ``width`` = heads x head dim:
    2 x 2 x seq_len x width per token, halved by a causal mask (flash attention skips the
    masked blocks); with a sliding ``window``, 2 x 2 x ``attended_keys`` x width."""
    if window and causal and window < seq_len:
        return 2.0 * 2.0 * tokens * width * attended_keys(seq_len, window)
    return 2.0 * 2.0 * tokens * seq_len * width * (0.5 if causal else 1.0)


@dataclass(frozen=True)
class TransformerShape:
    """One transformer: ``layers`` layers of width ``hidden`` (H); attention of
    ``heads`` query heads and ``kv_heads`` key/value heads; a dense FFN of ``dense_ffn``
    (F_d) in the layers that are not MoE; every ``moe_every``-th layer MoE with
    ``experts`` experts of ``expert_ffn`` (F), ``top_k`` per token (0 experts: dense only);
    ``vocab`` tokens, the output head tied to the embedding or not.

    The fields after ``tied_embeddings`` are the models people train (issue 24; module
    doc); their defaults give the shapes of before: gelu FFNs of 2 matrices, no biases,
    no shared experts, GQA of head dimension H / n over the whole sequence, no MTP."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    dense_ffn: int
    vocab: int
    experts: int = 0
    expert_ffn: int = 0
    top_k: int = 0
    moe_every: int = 1
    tied_embeddings: bool = False
    ffn_matrices: int = 2  # 2: gelu, 3: SwiGLU
    ffn_bias: bool = False  # every FFN matrix has a bias (gpt-oss)
    shared_experts: int = 0  # per MoE layer, every token through them
    shared_ffn: int = 0  # inner dimension of one shared expert; 0 = expert_ffn
    shared_gate: bool = False  # a sigmoid gate H x 1 on the shared experts (Qwen2-MoE)
    router_bias: bool = False  # a bias of E on the router (gpt-oss; DeepSeek-V3's balancing bias)
    first_dense: int = 0  # dense-FFN layers before the first MoE one (of ``layers``)
    head_size: int = 0  # dimension of one head; 0 = hidden / heads
    attention: str = "gqa"  # gqa or mla
    q_lora_rank: int = 0  # mla: rank of the query latent; 0 = queries from H
    kv_lora_rank: int = 0  # mla: rank of the key-value latent
    qk_nope_head_dim: int = 0  # mla: query/key dimension per head without RoPE
    qk_rope_head_dim: int = 0  # mla: the decoupled RoPE query/key dimension per head
    v_head_dim: int = 0  # mla: value dimension per head
    attention_bias: str = "none"  # none, qkv or all
    attention_sinks: bool = False  # a sink logit per head (gpt-oss)
    sliding_window: int = 0  # tokens a sliding layer looks back; 0 = none
    full_attention_every: int = 2  # with a window: one layer in this many attends the whole sequence
    mtp_layers: int = 0  # multi-token-prediction modules after the last layer

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "full_attention_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)}: must be > 0")
        if not self.head_size and self.hidden % self.heads:
            raise ValueError(f"hidden = {self.hidden} is not a multiple of heads = {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads = {self.heads} is not a multiple of kv_heads = {self.kv_heads}")
        if self.experts and not (0 < self.top_k <= self.experts and self.expert_ffn > 0 and self.moe_every > 0):
            raise ValueError(f"an MoE shape needs 0 < top_k <= experts, expert_ffn > 0 and moe_every > 0 "
                             f"(top_k = {self.top_k}, experts = {self.experts}, expert_ffn = {self.expert_ffn}, "
                             f"moe_every = {self.moe_every})")
        if self.ffn_matrices not in (2, 3):
            raise ValueError(f"ffn_matrices = {self.ffn_matrices}: 2 (gelu) or 3 (SwiGLU)")
        if not 0 <= self.first_dense <= self.layers:
            raise ValueError(f"first_dense = {self.first_dense}: between 0 and layers = {self.layers}")
        if self.attention_bias not in ATTENTION_BIASES:
            raise ValueError(f"attention_bias = {self.attention_bias!r}: one of {', '.join(ATTENTION_BIASES)}")
        if self.attention == "mla":
            dims = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            if any(getattr(self, d) <= 0 for d in dims):
                raise ValueError("mla needs " + ", ".join(f"{d} = {getattr(self, d)}" for d in dims) + " > 0")
            if self.attention_bias != "none":
                raise ValueError(f"attention_bias = {self.attention_bias!r}: MLA's projections have no biases here")
        elif self.attention != "gqa":
            raise ValueError(f"attention = {self.attention!r}: gqa or mla")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    # ---- which layer is what ------------------------------------------------------------------
    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` (0-based) has the MoE FFN: after the first dense ones, layers
        moe_every - 1, 2 moe_every - 1, ... of the rest."""
        return bool(self.experts) and i >= self.first_dense and (i - self.first_dense + 1) % self.moe_every == 0

    def is_sliding_layer(self, i: int) -> bool:
        """Layer ``i`` attends a sliding window, not the whole sequence."""
        return self.sliding_window > 0 and (i + 1) % self.full_attention_every != 0

    @property
    def moe_layers(self) -> int:
        """Layers whose FFN is the MoE one (``is_moe_layer``)."""
        return (self.layers - self.first_dense) // self.moe_every if self.experts else 0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def sliding_layers(self) -> int:
        return self.layers - self.layers // self.full_attention_every if self.sliding_window else 0

    # ---- parameters of one layer -------------------------------------------------------------
    @property
    def attention_matrix_params(self) -> int:
        """Weights of one layer's attention projections (the matrices its GEMMs multiply)."""
        h = self.hidden
        if self.attention == "mla":
            n, qk = self.heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            q = self.q_lora_rank * (h + n * qk) if self.q_lora_rank else h * n * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * n * (
                self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + n * self.v_head_dim * h
        d = self.head_dim
        return h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h

    @property
    def attention_params(self) -> int:
        """Q, K, V and O of one layer (MLA: its latent projections), with their biases
        and sinks."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = {"none": 0, "qkv": q + 2 * kv, "all": q + 2 * kv + self.hidden}[self.attention_bias]
        return self.attention_matrix_params + bias + (self.heads if self.attention_sinks else 0)

    @property
    def layer_norm_params(self) -> int:
        """Norms of one layer: before attention and before the FFN (H each), MLA's on its
        latents."""
        latents = (self.q_lora_rank + self.kv_lora_rank) if self.attention == "mla" else 0
        return 2 * self.hidden + latents

    def _ffn_params(self, inner: int) -> int:
        biases = (self.ffn_matrices - 1) * inner + self.hidden if self.ffn_bias else 0
        return self.ffn_matrices * self.hidden * inner + biases

    @property
    def dense_ffn_params(self) -> int:
        return self._ffn_params(self.dense_ffn)

    @property
    def dense_ffn_matrix_params(self) -> int:
        return self.ffn_matrices * self.hidden * self.dense_ffn

    @property
    def expert_params(self) -> int:
        """One routed expert: its FFN's matrices (and biases)."""
        return self._ffn_params(self.expert_ffn)

    @property
    def expert_matrix_params(self) -> int:
        return self.ffn_matrices * self.hidden * self.expert_ffn

    @property
    def shared_ffn_width(self) -> int:
        return self.shared_ffn or self.expert_ffn

    @property
    def shared_expert_params(self) -> int:
        """All shared experts of one MoE layer and their gate."""
        return self.shared_experts * self._ffn_params(self.shared_ffn_width) + (self.hidden if self.shared_gate else 0)

    @property
    def shared_expert_matrix_params(self) -> int:
        gate = self.hidden if self.shared_gate else 0
        return self.shared_experts * self.ffn_matrices * self.hidden * self.shared_ffn_width + gate

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts + (self.experts if self.router_bias else 0)

    @property
    def moe_params(self) -> int:
        """One MoE layer's router, all its routed experts and its shared experts."""
        return self.router_params + self.experts * self.expert_params + self.shared_expert_params

    @property
    def moe_active_params(self) -> int:
        """What one token meets of an MoE layer: the router, top_k experts, the shared ones."""
        return self.router_params + self.top_k * self.expert_params + self.shared_expert_params

    # ---- parameters of the model -------------------------------------------------------------
    @property
    def input_embedding_params(self) -> int:
        """The input embedding's own parameters (V x H; none when tied: it is the head)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.input_embedding_params + self.head_params

    @property
    def mtp_ffn_is_moe(self) -> bool:
        """An MTP module's layer is an MoE one when the model's last layer is (Megatron-LM)."""
        return self.is_moe_layer(self.layers - 1)

    @property
    def mtp_module_norm_params(self) -> int:
        """Norms of one MTP module: its hidden state's, the embedding's, the one before the
        head, and its layer's."""
        return 3 * self.hidden + self.layer_norm_params

    @property
    def mtp_module_params(self) -> int:
        """One MTP module without the norms: the projection 2H x H and one layer (the
        embedding and head are shared)."""
        ffn = self.moe_params if self.mtp_ffn_is_moe else self.dense_ffn_params
        return 2 * self.hidden * self.hidden + self.attention_params + ffn

    @property
    def mtp_module_active_params(self) -> int:
        ffn = self.moe_active_params if self.mtp_ffn_is_moe else self.dense_ffn_params
        return 2 * self.hidden * self.hidden + self.attention_params + ffn

    @property
    def norm_params(self) -> int:
        """Every norm: each layer's, the final one, the MTP modules'."""
        return (self.layers * self.layer_norm_params + self.hidden
                + self.mtp_layers * self.mtp_module_norm_params)

    @property
    def params(self) -> int:
        """Every parameter of the model but the norms' (``norm_params``)."""
        return (self.layers * self.attention_params + self.dense_layers * self.dense_ffn_params
                + self.moe_layers * self.moe_params + self.embedding_params
                + self.mtp_layers * self.mtp_module_params)

    @property
    def dense_params(self) -> int:
        """Every parameter besides the experts and routers: attention, dense FFNs, embeddings
        (the MTP modules and norms aside)."""
        return (self.layers * self.attention_params + self.dense_layers * self.dense_ffn_params
                + self.embedding_params)

    @property
    def active_params(self) -> int:
        """Parameters one token meets (norms aside): the router, top_k experts and shared
        experts of each MoE layer, the embedding table and head, the MTP modules."""
        return (self.layers * self.attention_params + self.dense_layers * self.dense_ffn_params
                + self.moe_layers * self.moe_active_params + self.embedding_params
                + self.mtp_layers * self.mtp_module_active_params)

    # ---- the GEMMs' shapes -------------------------------------------------------------------
    @property
    def attention_linears(self) -> list[tuple[int, int]]:
        """(inputs, outputs) of each of one layer's attention projections, one GEMM each
        (a Linear layer of Megatron-Core, which casts its own input under fp8): GQA's fused
        Q, K and V (H x (n + 2 k) d) and O (n d x H); MLA's query down and up projections
        (or the one query projection without a latent), key-value down (H x (r_kv + d_rope))
        and up (r_kv x n (d_nope + d_v)), and O (n d_v x H). Their sizes sum to
        ``attention_matrix_params``."""
        h, n = self.hidden, self.heads
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = [(h, self.q_lora_rank), (self.q_lora_rank, n * qk)] if self.q_lora_rank else [(h, n * qk)]
            return q + [(h, self.kv_lora_rank + self.qk_rope_head_dim),
                        (self.kv_lora_rank, n * (self.qk_nope_head_dim + self.v_head_dim)), (n * self.v_head_dim, h)]
        d = self.head_dim
        return [(h, (n + 2 * self.kv_heads) * d), (n * d, h)]

    def ffn_linears(self, inner: int) -> list[tuple[int, int]]:
        """(inputs, outputs) of one FFN's GEMMs of inner dimension ``inner``: the first
        (gelu: H x F; SwiGLU: gate and up fused, H x 2F, as Megatron-Core's linear_fc1) and
        the second (F x H). Their sizes sum to ``ffn_matrices`` x H x F."""
        return [(self.hidden, (self.ffn_matrices - 1) * inner), (inner, self.hidden)]

    # ---- activations kept for the backward (elements per token) ----------------------------
    @property
    def attention_activation_elements(self) -> tuple[int, int]:
        """Elements per token one layer's attention keeps for its backward beyond its input,
        as (split over tensor-parallel ranks by heads, whole on each): GQA's Q and the
        output projection's input n d wide each, K and V k d wide each at the k key-value
        heads (Korthikanti et al.'s 4 H with d = H / n and k = n): Transformer Engine's
        attention takes the key-value heads as they are (Megatron-Core's
        TEDotProductAttention passes ``num_gqa_groups``, NVIDIA/Megatron-LM d98e8a64
        megatron/core/extensions/transformer_engine.py:2092; only its local
        DotProductAttention repeats them, dot_product_attention.py:169-174); MLA's Q and K
        (n (d_nope + d_rope) each), V and the output projection's input (n d_v each),
        and its latents whole (Megatron-Core's down projections are not split): the query
        latent before and after its norm (2 r_q), the key-value latent with the RoPE key
        (r_kv + d_rope) and after its norm (r_kv)."""
        n = self.heads
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            return 2 * n * qk + 2 * n * self.v_head_dim, 2 * self.q_lora_rank + 2 * self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * (n + self.kv_heads) * self.head_dim, 0

    @property
    def mla_up_proj_elements(self) -> int:
        """Elements per token of MLA's up projections' outputs, Q, K (n (d_nope + d_rope)
        each) and V (n d_v), that Megatron-Core's ``--recompute-modules mla_up_proj``
        recomputes in the backward instead of keeping (from the latents it keeps); 0 for GQA."""
        if self.attention != "mla":
            return 0
        return 2 * self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim) + self.heads * self.v_head_dim

    def ffn_activation_elements(self, inner: int) -> int:
        """Elements per token one FFN of inner dimension ``inner`` keeps beyond its input:
        its first GEMM's output ((matrices - 1) F: Megatron-Core's SwiGLU keeps its 2F
        input for its backward) and the activation's output (F, the second GEMM's input):
        matrices x F (gelu at F = 4H: Korthikanti et al.'s 8 H)."""
        return self.ffn_matrices * inner

    # ---- FLOPs -------------------------------------------------------------------------------
    def attention_core_flops_per_token(self, seq_len: int, sliding: bool = False, causal: bool = True) -> float:
        """Forward FLOPs of one layer's attention core for one token (module doc)."""
        window = self.sliding_window if sliding else 0
        if self.attention == "mla":
            n, keys = self.heads, attended_keys(seq_len, window, causal)
            return 2.0 * keys * n * (self.qk_nope_head_dim + self.qk_rope_head_dim) + 2.0 * keys * n * self.v_head_dim
        return attention_core_flops(1, seq_len, self.heads * self.head_dim, causal, window)

    def attention_forward_flops(self, seq_len: int, sliding: bool = False, causal: bool = True) -> float:
        """Forward FLOPs of one layer's attention for one token: projections and core."""
        return 2.0 * self.attention_matrix_params + self.attention_core_flops_per_token(seq_len, sliding, causal)

    def ffn_forward_flops(self, moe: bool) -> float:
        """Forward FLOPs of one layer's FFN for one token: the dense one, or the router,
        top_k routed experts and the shared experts (all tokens routed, none dropped)."""
        if not moe:
            return 2.0 * self.dense_ffn_matrix_params
        return 2.0 * (self.hidden * self.experts + self.top_k * self.expert_matrix_params
                      + self.shared_expert_matrix_params)

    def layer_forward_flops(self, i: int, seq_len: int, causal: bool = True) -> float:
        """Forward FLOPs of layer ``i`` for one token."""
        return self.attention_forward_flops(seq_len, self.is_sliding_layer(i), causal) + self.ffn_forward_flops(
            self.is_moe_layer(i))

    def mtp_forward_flops(self, seq_len: int, causal: bool = True) -> float:
        """Forward FLOPs of one MTP module for one token: the projection, its layer (whole
        sequence) and the shared head once more."""
        return (2.0 * 2 * self.hidden * self.hidden + self.attention_forward_flops(seq_len, False, causal)
                + self.ffn_forward_flops(self.mtp_ffn_is_moe) + 2.0 * self.head_params)

    def forward_flops_per_token(self, seq_len: int, causal: bool = True, mtp: bool = True) -> float:
        """FLOPs of one token's forward: 2 per matrix weight it meets (the input embedding is
        a lookup: none) plus attention's core over ``seq_len``; the MTP modules unless
        ``mtp`` is false."""
        flops = sum(self.layer_forward_flops(i, seq_len, causal) for i in range(self.layers))
        flops += 2.0 * self.head_params
        if mtp:
            flops += self.mtp_layers * self.mtp_forward_flops(seq_len, causal)
        return flops

    def step_flops(self, tokens: int, seq_len: int, recompute: bool = False, causal: bool = True) -> float:
        """FLOPs of a training step on ``tokens`` tokens: forward, backward (twice the
        forward) and, with full ``recompute``, one forward more."""
        return (4.0 if recompute else 3.0) * tokens * self.forward_flops_per_token(seq_len, causal)
