"""The sections of a scenario, one dataclass each, with a default and a one-line doc for
every field (``doc(...)``, declared and read by ``testbed.scenario.fields``; ``testbed
fields`` prints them). Validation of a single field sits next to it (``check=``); the
checks across fields are the scenario's (``testbed.scenario.scenario``).

Sizes of the cluster: ``gpus = gpus_per_node * nodes_per_microcluster * microclusters``;
``parallelism.ep_size`` GPUs form one expert-parallel (EP) group, and the
``gpus // ep_size`` EP groups each hold a replica of every expert (M8-M9).
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.core.checks import between, fraction, non_negative, percentile, positive
from testbed.scenario.fields import doc

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: the token strategies of the seed's comparisons (M7), which experiments sweep
TOKEN_STRATEGIES = ("alltoall", "allgather", "hierarchical")
#: every token exchange a scenario may name: M7's and the DeepEP-style dispatcher
DISPATCHERS = TOKEN_STRATEGIES + ("deepep",)
FFN_ACTIVATIONS = ("gelu", "swiglu")
ATTENTIONS = ("gqa", "mla")
EXPERT_SYNC_STRATEGIES = ("allreduce", "two_stage")
#: Megatron-Core's --recompute-modules (megatron/core/transformer/transformer_config.py)
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe_act", "moe", "layernorm", "mla_up_proj", "shared_experts")


def recompute_module_names(value: str) -> str | None:
    """None when ``value`` is a comma-separated list of known recompute modules, each once."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown_names = [n for n in names if n not in RECOMPUTE_MODULES]
    if unknown_names:
        return f"unknown module {unknown_names[0]!r} (known: {', '.join(RECOMPUTE_MODULES)})"
    if len(set(names)) < len(names):
        return "a module is named twice"
    return None


PLACEMENTS = ("topology", "strided", "random")


@dataclass
class ModelConfig:
    """The MoE layer stack (only the MoE layers are modelled)."""

    hidden_size: int = doc("H: model (hidden) dimension", 64, check=positive)
    ffn_hidden_size: int = doc("F: each routed expert's FFN inner dimension (model.ffn_activation's matrices of H x F)", 128, check=positive)
    num_layers: int = doc("MoE layers in the stack", 2, check=positive)
    num_experts: int = doc("E: experts per MoE layer", 8, check=positive)
    top_k: int = doc("experts each token is routed to", 2, check=positive)
    dtype: str = doc("dtype of weights, activations and payloads", "fp32", choices=tuple(DTYPE_BYTES))
    ffn_activation: str = doc("the FFN of experts and dense layers: gelu (two matrices, H x F and F x H) or swiglu "
                              "(gate and up H x F, down F x H: Shazeer 2020, 'GLU Variants Improve Transformer')",
                              "gelu", choices=FFN_ACTIVATIONS)
    shared_experts: int = doc("experts every token goes through besides its routed top-k, on the rank it sits on "
                              "(DeepSeek-V3: 1; Qwen2-57B-A14B: 1); their compute can overlap the dispatch", 0,
                              check=non_negative)
    shared_ffn_hidden_size: int = doc("inner dimension of one shared expert; 0 = model.ffn_hidden_size", 0,
                                      check=non_negative)
    shared_expert_gate: bool = doc("a sigmoid gate (an H x 1 matrix) scales the shared experts' output "
                                   "(Qwen2-MoE's shared_expert_gate)", False)
    gemm_dtype: str = doc("dtype the GEMMs compute in: model (model.dtype) or fp8 (weights and inputs cast to fp8 "
                          "before each GEMM, with model.fp8_scaling)", "model", choices=("model", "fp8"))
    fp8_scaling: str = doc("fp8 GEMMs' scaling: blockwise (a scale per 128 x 128 block of weights and per 1 x 128 "
                           "of activations, DeepSeek-V3 §3.3.2) or tensor (one per tensor, Transformer Engine's "
                           "delayed scaling)", "blockwise", choices=("blockwise", "tensor"))
    ffn_bias: bool = doc("a bias on every FFN matrix's output (routed and shared experts, dense layers) and on "
                         "the router (gpt-oss)", False)
    preset: str = doc("a shipped model (configs/models/NAME.toml: testbed model --list); its fields fill "
                      "[model], [transformer] and [router] where the scenario leaves them out", "")
    config: str = doc("a Hugging Face config.json of a supported family (Mixtral, Qwen2-MoE, Qwen3-MoE, "
                      "DeepSeek-V2/V3, gpt-oss, OLMoE), read as a preset is", "")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def ffn_matrices(self) -> int:
        """Matrices of one FFN: 2 (gelu) or 3 (swiglu)."""
        return 3 if self.ffn_activation == "swiglu" else 2

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: ``ffn_matrices`` matrices of H x F, no biases."""
        return self.ffn_matrices * self.hidden_size * self.ffn_hidden_size

    @property
    def shared_ffn(self) -> int:
        """Inner dimension of one shared expert."""
        return self.shared_ffn_hidden_size or self.ffn_hidden_size

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * self.dtype_bytes


@dataclass
class TransformerConfig:
    """The whole transformer around the MoE layers (simulator; issue 13): attention in
    every layer, ``moe_every - 1`` dense-FFN layers before each MoE layer, the embedding
    and output head, and the optimizer's state. Off: the MoE layer stack alone, plain SGD."""

    enabled: bool = doc("model the whole transformer (the real backend: data x expert x tensor x pipeline parallelism, one micro-batch; no ZeRO or recompute)", False)
    num_heads: int = doc("attention query heads (model.hidden_size must be a multiple)", 8, check=positive)
    num_kv_heads: int = doc("attention key/value heads, grouped-query attention (a divisor of num_heads); 0 = num_heads", 0, check=non_negative)
    seq_len: int = doc("tokens per sequence, which attention spans (workload.tokens_per_rank per micro-batch must be a multiple, or with tp_size > 1 and sequence parallelism the tensor-parallel group's tp_size x tokens_per_rank: the group shares its micro-batch)", 256, check=positive)
    dense_ffn_hidden_size: int = doc("inner dimension of the dense layers' FFN; 0 = 4 x model.hidden_size", 0, check=non_negative)
    moe_every: int = doc("one layer in this many is MoE (1: every layer, 2: every other); model.num_layers counts the MoE ones", 1, check=positive)
    vocab_size: int = doc("vocabulary: the input embedding and the output head (V x H each)", 32000, check=positive)
    tied_embeddings: bool = doc("the output head is the input embedding", False)
    recompute: str = doc("activation recompute: none, or full (each layer keeps its input and runs its forward again in the backward)", "none", choices=("none", "full"))
    optimizer: str = doc("adam: mixed precision (weights and gradients in model.dtype, fp32 master weights and moments; AdamW with adam_weight_decay), or sgd (the MoE stack's)", "adam", choices=("adam", "sgd"))
    optimizer_state_bytes: int = doc("adam: bytes of optimizer state per parameter (fp32 master, m, v: 12)", 12, check=positive)
    micro_batches: int = doc("micro-batches per step (workload.tokens_per_rank split evenly): the pipeline's (parallelism.pp_size), else gradient accumulation; the simulator runs each stage on one and times the step with the pipeline schedule", 1, check=positive)
    adam_learning_rate: float = doc("adam: learning rate (run.learning_rate is plain SGD's)", 1e-3, check=positive)
    adam_beta1: float = doc("adam: decay of the first moment", 0.9, check=between(0, 0.9999))
    adam_beta2: float = doc("adam: decay of the second moment", 0.95, check=between(0, 0.9999))
    adam_eps: float = doc("adam: added to the second moment's root", 1e-8, check=positive)
    adam_weight_decay: float = doc("adam: decoupled weight decay per step (AdamW; 0 = Adam)", 0.0, check=non_negative)
    first_dense_layers: int = doc("dense-FFN layers before the first MoE layer, besides those of moe_every "
                                  "(DeepSeek-V3: 3, HF first_k_dense_replace)", 0, check=non_negative)
    head_dim: int = doc("dimension of one attention head; 0 = model.hidden_size / num_heads (Qwen3: 128 with H "
                        "4096 and 64 heads)", 0, check=non_negative)
    attention: str = doc("gqa (grouped-query attention) or mla (multi-head latent attention, DeepSeek-V2 §2.1: "
                         "q and kv through low-rank latents, a decoupled RoPE key)", "gqa", choices=ATTENTIONS)
    q_lora_rank: int = doc("mla: rank of the query's latent; 0 = queries projected from the hidden state "
                           "(DeepSeek-V2-Lite)", 0, check=non_negative)
    kv_lora_rank: int = doc("mla: rank of the key-value latent (DeepSeek-V3: 512)", 512, check=positive)
    qk_rope_head_dim: int = doc("mla: per-head dimension of the decoupled RoPE query and key (DeepSeek-V3: 64)",
                                64, check=positive)
    qk_nope_head_dim: int = doc("mla: per-head dimension of the query and key without RoPE (DeepSeek-V3: 128)",
                                128, check=positive)
    v_head_dim: int = doc("mla: per-head dimension of the values (DeepSeek-V3: 128)", 128, check=positive)
    sliding_window: int = doc("tokens a sliding-window attention layer looks back (gpt-oss: 128); 0 = every "
                              "layer attends the whole sequence", 0, check=non_negative)
    full_attention_every: int = doc("with sliding_window: one layer in this many attends the whole sequence, "
                                    "the rest the window (gpt-oss: 2, alternating from a sliding first layer)", 2,
                                    check=positive)
    attention_sinks: bool = doc("a learned sink logit per head in every attention's softmax (gpt-oss)", False)
    attention_bias: str = doc("biases of the attention projections: none, qkv (query, key and value: Qwen2) or "
                              "all (the output's too: gpt-oss, HF attention_bias)", "none",
                              choices=("none", "qkv", "all"))
    mtp_layers: int = doc("multi-token-prediction modules after the last layer, each an embedding projection, "
                          "one transformer layer and the shared head (DeepSeek-V3 §2.2: 1)", 0,
                          check=non_negative)
    recompute_modules: str = doc("selective recompute, Megatron-Core's --recompute-modules: a comma-separated list "
                                 "of core_attn, mlp, moe_act, moe, layernorm, mla_up_proj, shared_experts (each "
                                 "recomputes that module's forward in the backward instead of keeping its "
                                 "activations; DeepSeek-V3 on H100: mlp,mla_up_proj,moe_act,layernorm); empty = "
                                 "none (transformer.recompute = full recomputes whole layers)", "",
                                 check=recompute_module_names)
    zero_stage: int = doc("ZeRO: 0 (every rank keeps all optimizer state), 1 (the state sharded over the ranks that hold a parameter: all ranks for the dense ones, an expert's replicas for its), 2 (the gradients too); with the whole transformer's adam, 1 and 2 run Megatron-Core's distributed optimizer (--use-distributed-optimizer): each gradient bucket reduce-scattered, each rank's shard updated, the updated parameters all-gathered", 0, check=between(0, 2))
    overlap_grad_reduce: bool = doc("Megatron-Core's --overlap-grad-reduce: each gradient bucket's reduce-scatter "
                                    "(all-reduce with zero_stage 0) starts once the backward of its layers is done, "
                                    "beside the rest of the backward (as overlap.sync_with_backward); false = after "
                                    "the backward", False)
    overlap_param_gather: bool = doc("Megatron-Core's --overlap-param-gather (zero_stage >= 1 with adam, and "
                                     "overlap_grad_reduce, as Megatron-LM asks): each bucket's all-gather of updated "
                                     "parameters runs beside the next step's forward, one bucket ahead, each layer's "
                                     "forward waiting for its own; false = all of them after the optimizer step",
                                     False)
    grad_reduce_dtype: str = doc("dtype the dense and expert gradients are summed in, the reduce-scatter's "
                                 "(all-reduce's) element size: model (model.dtype; the routers' stay fp32: "
                                 "Megatron-LM's --grad-reduce-in-bf16) or fp32 (--accumulate-allreduce-grads-in-fp32, "
                                 "Megatron-LM's default with --bf16)", "model", choices=("model", "fp32"))

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads


@dataclass
class ClusterConfig:
    """The machines (M21): GPUs per node on NVLink, nodes per leaf, leaves under a spine."""

    gpus_per_node: int = doc("GPUs (or CPU ranks) per node, joined by NVLink", 2, check=positive)
    nodes_per_microcluster: int = doc("nodes per micro-cluster (one InfiniBand leaf)", 2, check=positive)
    microclusters: int = doc("micro-clusters joined by the InfiniBand spine", 2, check=positive)
    profile: str = doc("machine profile: a built-in name (local-cpu, a100-seed, h200) or a TOML path", "local-cpu")
    leaf_spine_oversubscription: float = doc("leaf downlink / uplink bandwidth ratio (1 = non-blocking)", 1.0, check=positive)
    rail_optimized: bool = doc("rail-optimised leaves (M21): NIC i of every node of a micro-cluster goes to leaf "
                               "(micro-cluster, i), so cross-rail traffic crosses the spine; false = one leaf per "
                               "micro-cluster", False)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes_per_microcluster * self.microclusters

    @property
    def gpus_per_microcluster(self) -> int:
        return self.gpus_per_node * self.nodes_per_microcluster


@dataclass
class ParallelismConfig:
    """Expert parallelism x expert replication = GPUs (M8, M11)."""

    ep_size: int = doc("GPUs per expert-parallel group; experts are sharded over it, tokens travel inside it", 4, check=positive)
    placement: str = doc("EP group -> rank mapping: topology (contiguous, M11), strided (ignores topology), random", "topology", choices=PLACEMENTS)
    placement_seed: int = doc("seed of the random placement", 0)
    pp_size: int = doc("pipeline stages of the whole transformer (transformer.enabled): consecutive blocks of cluster.gpus / pp_size GPUs (whole nodes), each with model.num_layers / pp_size MoE layers and their blocks unless pipeline_layout or decoder_first/last_pipeline_num_layers say otherwise, scheduled by pipeline_schedule over transformer.micro_batches (the real backend: even stages, one micro-batch)", 1, check=positive)
    pp_chunks: int = doc("model chunks per pipeline stage: 1 = plain 1F1B, more = Megatron's interleaved schedule (transformer.micro_batches a multiple of pp_size)", 1, check=positive)
    tp_size: int = doc("tensor parallelism of the whole transformer's dense layers (transformer.enabled), over consecutive GPUs of a node: each GPU holds 1/tp of the attention heads, dense-FFN columns and vocabulary (the MoE layers see each GPU's own tokens); 1 = none", 1, check=positive)
    sequence_parallel: bool = doc("with tp_size > 1: each GPU keeps only its own tokens between sublayers (all-gather before, reduce-scatter after each); false = the group's tokens replicated inside the blocks (an all-reduce after each, gathers around the MoE layers)", True)
    cp_size: int = doc("context parallelism: each sequence split over this many GPUs, ring attention exchanging "
                       "keys and values (Megatron-Core's --context-parallel-size); 1 = none", 1, check=positive)
    etp_size: int = doc("expert tensor parallelism of the MoE layers (Megatron-Core's "
                        "--expert-tensor-parallel-size, whose default is tp_size); 1 = each expert whole on a GPU, "
                        "as the testbed has always run them", 1, check=positive)
    moe_layout: str = doc("how the MoE layers' expert groups are formed: folded (their ETP x EP x expert-DP grid "
                          "independent of attention's TP x CP x DP, MoE parallel folding, arXiv 2504.14960) or "
                          "nested (EP carved out of DP, expert TP = TP: Megatron-Core before folding)", "folded",
                          choices=("folded", "nested"))
    pipeline_layout: str = doc("Megatron-Core's --pipeline-model-parallel-layout: E embedding, t transformer "
                               "layer, m MTP layer, L loss, | stage boundary, x*n and (...)*n repeats (DeepSeek-V3 "
                               "on 1,024 H100: Et*3|(tt|)*29m|L); stage i on pipeline rank i % pp_size, its "
                               "virtual chunk i // pp_size; empty = the even split", "")
    decoder_first_pipeline_num_layers: int = doc("transformer layers of the first pipeline stage, the rest "
                                                 "split evenly (Megatron-Core's flag of that name); 0 = even", 0,
                                                 check=non_negative)
    decoder_last_pipeline_num_layers: int = doc("transformer layers of the last pipeline stage (Megatron-Core's "
                                                "flag of that name); 0 = even", 0, check=non_negative)
    pipeline_schedule: str = doc("1f1b (interleaved with pp_chunks > 1: Megatron's schedules) or dualpipe "
                                 "(DeepSeek-V3 §3.2.1: micro-batches from both ends, the backward split into "
                                 "input and weight gradients, a forward and a backward chunk overlapped)", "1f1b",
                                 choices=("1f1b", "dualpipe"))
    attention_parallel: str = doc("how attention is split over a tensor-parallel group: tp (by heads, Megatron's "
                                  "tensor parallelism) or ulysses (an all-to-all of heads and sequence around "
                                  "attention: MegaScale-MoE's SP inside a node)", "tp", choices=("tp", "ulysses"))


@dataclass
class RouterConfig:
    """The token router (M1-M3)."""

    noise: str = doc("training noise on gate logits: gumbel or none", "gumbel", choices=("gumbel", "none"))
    temperature_start: float = doc("softmax temperature at step 0 (M1 schedule)", 1.2, check=positive)
    temperature_end: float = doc("softmax temperature after temperature_steps", 0.8, check=positive)
    temperature_steps: int = doc("steps of the linear temperature schedule", 1000, check=positive)
    capacity_factor: float = doc("M2 capacity factor; 0 = dropless", 1.25, check=non_negative)
    pad_capacity_to_ep: bool = doc("round capacity up to a multiple of the EP size", False)
    drop_policy: str = doc("which tokens over capacity are dropped: probs (lowest probability) or position (latest)", "probs", choices=("probs", "position"))
    aux_loss_coef: float = doc("alpha of the Switch aux load-balancing loss (M3)", 0.01, check=non_negative)
    weight_std: float = doc("std of the gate weight initialisation", 0.02, check=non_negative)
    bias_std: float = doc("std of the gate bias initialisation (M1: 0.01)", 0.01, check=non_negative)
    local_bias: float = doc("M22 local-first routing: added to the gate logits of experts whose replica for the "
                            "token's EP group sits in the token's node (router.local_scope); 0 = off. A top-1 "
                            "choice then picks such an expert e^local_bias times as often, relative to the others",
                            0.0, check=non_negative)
    local_scope: str = doc("where router.local_bias counts an expert as local: node or microcluster", "node",
                           choices=("node", "microcluster"))
    score: str = doc("gate scores: softmax over all experts (M1), or sigmoid per expert (DeepSeek-V3 §2.1.2)",
                     "softmax", choices=("softmax", "sigmoid"))
    normalize_top_k: bool = doc("the k chosen scores rescaled to sum to 1 (M1; HF norm_topk_prob)", True)
    routed_scaling_factor: float = doc("the routed experts' output scaled by this (DeepSeek-V3: 2.5)", 1.0,
                                       check=positive)
    expert_groups: int = doc("group-limited routing: experts in this many contiguous groups (HF n_group; "
                             "DeepSeek-V3: 8, one per node of its EP group), a token routed inside "
                             "router.groups_per_token of them only; 0 = none", 0, check=non_negative)
    groups_per_token: int = doc("group-limited routing: groups a token may use (HF topk_group; DeepSeek-V3 "
                                "node-limited M = 4, DeepSeek-V2 device-limited M = 3)", 0, check=non_negative)
    group_score: str = doc("how a group is ranked for a token: top2_sum (the sum of its two highest scores, "
                           "DeepSeek-V3) or max (its highest, DeepSeek-V2)", "top2_sum", choices=("top2_sum", "max"))
    bias_update_rate: float = doc("auxiliary-loss-free balancing: each expert's routing bias (added to its score "
                                  "for the top-k choice only) moves by this against the sign of its load error "
                                  "every step (DeepSeek-V3 §2.1.2: 0.001); 0 = off", 0.0, check=non_negative)
    seq_aux_loss_coef: float = doc("alpha of the sequence-wise balance loss (DeepSeek-V3 eq. 17-20: 0.0001); "
                                   "0 = off", 0.0, check=non_negative)


@dataclass
class PagerConfig:
    """Expert weights in fixed-size pages between GPU and host memory (M12-M16)."""

    enabled: bool = doc("page expert weights (false: all expert weights stay on the GPU)", True)
    page_size_bytes: int = doc("page size in bytes or with a unit (seed default 16MiB)", 16 * 2**20, check=positive, size=True)
    gpu_budget_bytes: int = doc("GPU bytes for expert pages per GPU; 0 = room for all local experts", 0, check=non_negative, size=True)
    emergency_free_fraction: float = doc("M15: evict when free memory falls below this fraction (of the budget or of the device, by free_memory)", 0.05, check=fraction)
    free_memory: str = doc("M15: whose free memory triggers the emergency: budget (free slots of the page budget) or device (the GPU allocator's free memory on CUDA, modelled in the simulator and on CPU ranks)", "budget", choices=("budget", "device"))
    device_memory_bytes: int = doc("M15, free_memory = device: device memory modelled for the simulator and CPU ranks; 0 = the profile's device memory (simulator; required on CPU ranks)", 0, check=non_negative, size=True)
    eviction_order: str = doc("M15: emergency victims clean_first (clean before dirty, then least recent: cheapest write-back) or scored (the seed's: most dirtiness, fewest references first)", "clean_first", choices=("clean_first", "scored"))
    cold_percentile: float = doc("M13: an expert below this heat percentile ...", 10.0, check=percentile)
    cold_consecutive_updates: int = doc("M13: ... for this many consecutive heat updates moves to host", 5, check=positive)
    prefetch_pages: int = doc("M14: an expert's predicted-first pages: loaded ahead by prefetch_ahead, and when a frozen expert wakes (M20)", 3, check=non_negative)
    prefetch_ahead: bool = doc("M14: while a layer computes, load the first prefetch_pages pages of the next layer's experts that the last step used there and that are off the GPU (the rest load on demand when the layer comes)", False)
    defrag_threshold: float = doc("M17: compact the device pool at a step's end when more than this share of the "
                                  "experts with two or more pages on the GPU have them out of slot order (0 = never)",
                                  0.0, check=fraction)
    defrag_interval: int = doc("M17: compact the device pool every this many steps whatever its fragmentation "
                               "(0 = never)", 0, check=non_negative)
    pipeline_pages: bool = doc("M14: an expert whose pages are being loaded computes page by page as they arrive "
                               "(its GEMMs in blocks of the rows a page holds) instead of after its last page", False)


@dataclass
class HeatConfig:
    """The expert heat map and states (M18-M20)."""

    enabled: bool = doc("keep the heat map (false: no heat update, no heat all-reduce, no cold migration, wake-up or hot prefetch - a baseline without M18-M20)", True)
    alpha: float = doc("weight of compute heat", 0.5, check=non_negative)
    beta: float = doc("weight of memory heat (page accesses)", 0.3, check=non_negative)
    gamma: float = doc("weight of communication heat (bytes in expert sync)", 0.2, check=non_negative)
    window_steps: int = doc("sliding window of the heat map, in steps", 100, check=positive)
    update_interval: int = doc("steps between heat updates", 10, check=positive)
    hot_percentile: float = doc("above this percentile an expert is Hot", 90.0, check=percentile)
    cold_percentile: float = doc("below this percentile an expert is Cold (frozen)", 30.0, check=percentile)
    wake_fraction: float = doc("M20: fraction of frozen experts probed when the cold level rises", 0.05, check=fraction)
    probe_tokens: int = doc("M20: tokens of a probe activation (the probed expert's weights brought from where they are and run on them)", 16, check=positive)
    probe_timeout_ms: float = doc("M20: a probed expert that answers within this many ms becomes Warm again", 10.0, check=non_negative)
    deferred: bool = doc("M18: a due heat update runs off the step's critical path: at the next step's first layer, after its access (its experts, having pending work, are not migrated then, M13), its page moves on the copy stream beside that layer instead of at the step's end", False)
    compute_source: str = doc("compute heat from routed tokens (identical on both backends) or measured kernel time", "tokens", choices=("tokens", "measured"))


@dataclass
class CommConfig:
    """How tokens travel and how replicated experts are synchronised (M5, M7-M10)."""

    token_strategy: str = doc("token exchange: alltoall, allgather, hierarchical, or deepep (a token crosses the "
                              "network once per destination node, to the GPU on its own rail there, which forwards "
                              "it over NVLink to its experts' GPUs; the combine in reverse, partial sums reduced on "
                              "the forwarding GPU: DeepEP's normal kernels)", "alltoall", choices=DISPATCHERS)
    deepep_sms: int = doc("deepep: SMs its kernels hold while they run, taken from the compute that overlaps "
                          "them in proportion to the profile's compute.sm_count (DeepSeek-V3: 20 of 132)", 20,
                          check=non_negative)
    expert_sync: str = doc("replicated expert gradient sync: allreduce or two_stage (M9)", "allreduce", choices=EXPERT_SYNC_STRATEGIES)
    group_cache_size: int = doc("M10: active groups (communicators) kept in the LRU cache", 100, check=positive)
    sync_batch_experts: int = doc("M9: experts per all-gather batch, on concurrent streams", 4, check=positive)
    payload_dtype: str = doc("dtype of dispatch/combine payloads: model (as model.dtype) or fp8 (M22 compression)", "model", choices=("model", "fp8"))
    grad_bucket_bytes: int = doc("router gradients are all-reduced in buckets of at most this many bytes, filled in backward order, as torch DDP's bucket_cap_mb (25 MiB); 0 = every layer in one bucket", 25 * 2**20, check=non_negative, size=True)


@dataclass
class OverlapConfig:
    """Overlap of communication with compute (M22); the simulator models these."""

    micro_batches: int = doc("tokens split into this many micro-batches whose all-to-all overlaps the experts of another (1 = none)", 1, check=positive)
    sync_with_backward: bool = doc("expert and router gradient sync of a layer overlaps the backward of the layers below it", False)
    moe_expert_parallel_comm: bool = doc("with pipeline stages, Megatron-Core's combined 1F1B "
                                         "(--overlap-moe-expert-parallel-comm): in the steady state a micro-batch's "
                                         "forward and another's backward run as one pair, each one's dispatch and "
                                         "combine hidden behind the other's compute", False)
    shared_experts: bool = doc("model.shared_experts run beside the token exchange: their first GEMM and activation "
                               "beside the dispatch, their second beside the combine (backward the other way round), "
                               "as Megatron-Core's moe_shared_expert_overlap; false: after the combine, in order", True)
    tp_comm: bool = doc("Megatron-Core's --tp-comm-overlap (Transformer Engine's userbuffers): each block's "
                        "tensor-parallel all-gathers and reduce-scatters run beside its compute, the reduce-scatters "
                        "holding 16 SMs (sim.step.context_parallel_ring); needs sequence parallelism with tp_size > 1",
                        False)


@dataclass
class CheckpointConfig:
    """Hierarchical checkpoints (M23) and what a restart costs."""

    enabled: bool = doc("write checkpoints during real runs", False)
    expert_interval: int = doc("steps between full expert-weight checkpoints (seed: 1000)", 1000, check=positive)
    optimizer_interval: int = doc("steps between optimizer-state checkpoints with the expert pages changed since (seed: 100); runs resume from the latest", 100, check=positive)
    rng_interval: int = doc("steps between RNG-state checkpoints (seed: every step)", 1, check=positive)
    directory: str = doc("folder of the checkpoints; empty = <run folder>/checkpoints", "")
    restart_s: float = doc("seconds to restart after a lost GPU before work resumes (seed's goal: < 30)", 30.0, check=non_negative)


FAULT_KINDS = ("link_degraded", "link_down", "gpu_lost")


@dataclass
class FaultConfig:
    """One fault event of a simulated run (``[[faults]]`` tables)."""

    at_step: int = doc("step at whose start the fault happens", 0, check=non_negative)
    kind: str = doc("link_degraded, link_down or gpu_lost", "link_degraded", choices=FAULT_KINDS)
    target: str = doc("links: a level (nvlink, nic, spine, pcie), leaf:M (micro-cluster M's spine uplink) or gpu:N (rank N's NIC); gpu_lost: gpu:N", "spine")
    factor: float = doc("link_degraded: fraction of bandwidth left (0 < factor < 1)", 0.5, check=fraction)


@dataclass
class WorkloadConfig:
    """Where routing comes from: a synthetic skewed workload (M4) or a recorded trace."""

    tokens_per_rank: int = doc("tokens each rank routes per step per layer", 256, check=positive)
    global_batch: int = doc("sequences per step over all data-parallel ranks (Megatron's --global-batch-size, "
                            "transformer.seq_len tokens each): tokens_per_rank and transformer.micro_batches "
                            "are derived from it (testbed.layout.batch); 0 = from tokens_per_rank", 0, check=non_negative)
    micro_batch_size: int = doc("with global_batch: sequences per micro-batch of one data-parallel rank, shared by "
                                "its TP x CP group (Megatron's --micro-batch-size)", 1, check=positive)
    skew: float = doc("Zipf exponent of global expert popularity (0 = uniform; at most 50: by then the first "
                      "expert takes every token)", 1.0, check=between(0, 50))
    drift: float = doc("per-step drift of popularity (0 = static)", 0.02, check=non_negative)
    locality: float = doc("weight of each rank's own preference against the global one", 0.5, check=fraction)
    seed: int = doc("seed of the workload", 0)
    trace: str = doc("run folder whose routing trace is replayed (sim backend); empty = synthetic", "")


@dataclass
class RunConfig:
    """Steps, seeds and where results go."""

    steps: int = doc("training steps to run, warm-up included", 6, check=positive)
    warmup_steps: int = doc("first steps left out of the summary", 1, check=non_negative)
    seed: int = doc("seed of model initialisation and router noise", 0)
    learning_rate: float = doc("SGD learning rate", 0.05, check=non_negative)
    output_dir: str = doc("folder that holds run folders", "runs")


@dataclass
class SimConfig:
    """Options of the simulator backend."""

    network_model: str = doc("flow (max-min fair), analytic (bottleneck link), or auto", "auto", choices=("auto", "flow", "analytic"))
    flow_max_gpus: int = doc("auto picks the flow model up to this many GPUs", 64, check=positive)
    expert_kernel: str = doc("expert GEMMs as one grouped kernel, a per-expert loop (efficiency curves of the profile) or "
                             "Transformer Engine's multi-stream GroupedLinear (multistream: needs the profile's "
                             "compute.gemm)", "grouped", choices=("grouped", "loop", "multistream"))
    representative_slice: bool = doc("fast evaluation for a layout search: where every block of EP and TP groups sees "
                                     "the same routing law, simulate two blocks' GPUs (the gradient sync over its whole "
                                     "groups) and scale, and route one layer of one block for layers and blocks of one "
                                     "popularity (sim.step.representative_slice lists the conditions); where they do not "
                                     "hold the full simulation runs and the summary's representative_slice says why", False)


@dataclass
class RealConfig:
    """Options of the PyTorch backend."""

    device: str = doc("cpu (gloo), cuda (NCCL, one rank per GPU) or auto", "auto", choices=("auto", "cpu", "cuda"))
    network: str = doc("loopback (ranks talk over this machine's loopback) or emulated (each rank in its own network "
                       "namespace, wired and rate-shaped as the cluster and its profile's links; needs root)",
                       "loopback", choices=("loopback", "emulated"))
    timeout_s: float = doc("a collective that waits longer than this fails the run", 60.0, check=positive)
    max_ranks_per_core: int = doc("CPU ranks per core the backend runs without --force (more measure the scheduler)", 4,
                                  check=positive)
    check_weights: bool = doc("keep an unpaged copy of expert weights and check pages against it every step", False)
    profile: bool = doc("run the steps after warm-up under torch.profiler; each rank writes torch_trace_rank<r>.json into the run folder", False)


SECTIONS = {
    "model": ModelConfig, "cluster": ClusterConfig, "parallelism": ParallelismConfig,
    "router": RouterConfig, "pager": PagerConfig, "heat": HeatConfig, "comm": CommConfig,
    "overlap": OverlapConfig, "workload": WorkloadConfig, "run": RunConfig,
    "checkpoint": CheckpointConfig, "sim": SimConfig, "real": RealConfig, "transformer": TransformerConfig,
}
