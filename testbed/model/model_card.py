"""A model's card: its total and active parameters by component, its forward FLOPs per
token, the FLOPs Megatron-LM counts for it, the bytes a token's dispatch moves and the
weight bytes of one routed expert, the figures model cards and papers quote
(``testbed model``; docs/models.md sets them beside the published ones).

Active parameters are counted two ways, as publishers differ: ``active`` is what one
token's forward multiplies, the output head included and the input embedding (a lookup)
not, as gpt-oss's model card counts (arXiv 2508.10925, Table 1: "Unembedding parameters
are counted towards active, but not embeddings"); ``active_with_embedding`` adds the
input embedding table, as Mistral's 12.9B for Mixtral-8x7B and Qwen's 22B for
Qwen3-235B-A22B count. Both leave the MTP modules out (DeepSeek-V3's 671B / 37B are
"without its 14B MTP module").

Dispatch bytes per token: each MoE layer sends a token's hidden state (H values of
``comm.payload_dtype``) to each of its top_k experts, and the combine sends as many back
(M7's all-to-all; what the deepep dispatcher saves by sending once per node is its own).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from testbed.model.megatron_flops import megatron_flops_per_token
from testbed.model.transformer_shape import TransformerShape
from testbed.model.whole_model import shape_of

#: the components parameters are counted in, in print order
COMPONENTS = ("embedding", "head", "attention", "dense_ffn", "routed_experts", "shared_experts", "routers",
              "norms", "mtp")


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model by component (``COMPONENTS``): all of them and those one
    token meets (``active_by_component``; the input embedding's is its whole table)."""

    by_component: dict[str, int]
    active_by_component: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_component.values())

    @property
    def total_without_mtp(self) -> int:
        return self.total - self.by_component["mtp"]

    @property
    def active(self) -> int:
        """What one token's forward multiplies, the MTP modules aside: not the input embedding."""
        return sum(v for k, v in self.active_by_component.items() if k not in ("embedding", "mtp"))

    @property
    def active_with_embedding(self) -> int:
        return self.active + self.active_by_component["embedding"]


def param_count(shape: TransformerShape) -> ParamCount:
    """The parameters of ``shape`` by component."""
    s = shape
    mtp = s.mtp_layers * (s.mtp_module_params + s.mtp_module_norm_params)
    mtp_active = s.mtp_layers * (s.mtp_module_active_params + s.mtp_module_norm_params)
    common = {
        "embedding": s.input_embedding_params,
        "head": s.head_params,
        "attention": s.layers * s.attention_params,
        "dense_ffn": s.dense_layers * s.dense_ffn_params,
        "norms": s.layers * s.layer_norm_params + s.hidden,
    }
    total = {**common, "routed_experts": s.moe_layers * s.experts * s.expert_params,
             "shared_experts": s.moe_layers * s.shared_expert_params, "routers": s.moe_layers * s.router_params,
             "mtp": mtp}
    active = {**total, "routed_experts": s.moe_layers * s.top_k * s.expert_params, "mtp": mtp_active}
    return ParamCount({k: total[k] for k in COMPONENTS}, {k: active[k] for k in COMPONENTS})


@dataclass(frozen=True)
class ModelCard:
    """The figures of one model (module doc): parameters, FLOPs per token in sequences of
    ``seq_len`` (forward: causal, sliding windows as banded; Megatron-LM's: forward and
    backward), dispatch bytes per token and an expert's weight bytes."""

    layers: int
    moe_layers: int
    seq_len: int
    params: ParamCount
    forward_flops_per_token: float  # MTP modules included
    forward_flops_per_token_without_mtp: float
    megatron_flops_per_token: float  # forward + backward
    dispatch_bytes_per_token_per_moe_layer: int
    dispatch_bytes_per_token: int  # every MoE layer's, one way (the combine moves as many back)
    expert_weight_bytes: int

    def to_dict(self) -> dict:
        out = asdict(self)
        p = self.params
        out["params"] = {"total": p.total, "total_without_mtp": p.total_without_mtp, "active": p.active,
                         "active_with_embedding": p.active_with_embedding, "by_component": dict(p.by_component),
                         "active_by_component": dict(p.active_by_component)}
        return out


def model_card(scenario, seq_len: int | None = None) -> ModelCard:
    """The card of the whole transformer ``scenario`` describes (``shape_of``), its FLOPs
    over sequences of ``seq_len`` (default ``transformer.seq_len``)."""
    seq = seq_len or scenario.transformer.seq_len
    if seq <= 0:
        raise ValueError(f"seq_len = {seq}: must be > 0")
    shape, m = shape_of(scenario), scenario.model
    payload = 1 if scenario.comm.payload_dtype == "fp8" else m.dtype_bytes  # M22 compression
    per_layer = m.top_k * m.hidden_size * payload
    return ModelCard(
        layers=shape.layers, moe_layers=shape.moe_layers, seq_len=seq, params=param_count(shape),
        forward_flops_per_token=shape.forward_flops_per_token(seq),
        forward_flops_per_token_without_mtp=shape.forward_flops_per_token(seq, mtp=False),
        megatron_flops_per_token=megatron_flops_per_token(shape, seq),
        dispatch_bytes_per_token_per_moe_layer=per_layer,
        dispatch_bytes_per_token=per_layer * shape.moe_layers,
        expert_weight_bytes=shape.expert_params * m.dtype_bytes,
    )
