"""A Hugging Face ``config.json`` read as the [model], [transformer] and [router] fields of
a scenario (``model.config``), for the families the testbed knows: Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V2/V3, gpt-oss and OLMoE.

Every key of the file is read into a field, or listed in ``IGNORED`` with why it changes
neither time nor memory; any other key, or a value the testbed does not model (a
sliding window on Qwen's last layers, attention dropout, a layer pattern of its own), is
refused with a ``ScenarioError`` naming it, never dropped.

Besides the file, each family fixes what its HF modelling code fixes (cited per family):
the gated SiLU FFN (SwiGLU) of all of them, Qwen2-MoE's Q/K/V biases and shared-expert
gate, gpt-oss's attention sinks and FFN and router biases. What a config.json does not
say of training is read the same way for every family and stated here: bf16 mixed
precision (``model.dtype``; ``torch_dtype`` is the checkpoint's), routers without noise
at temperature 1 (the HF routers have none) and without a gate bias (``bias_std`` 0:
none, or zero-initialised), dropless (``capacity_factor`` 0: the HF MoE blocks route
every token), router weights drawn with ``initializer_range``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.core.errors import ScenarioError

FIELD = "model.config"

#: keys that change neither time nor memory, and why each is left out
IGNORED = {
    "architectures": "the HF class names; model_type picks the family",
    "auto_map": "the Python classes of a trust_remote_code checkpoint",
    "bos_token_id": "a token id: which token, not how many",
    "eos_token_id": "a token id: which token, not how many",
    "pad_token_id": "a token id: which token, not how many",
    "torch_dtype": "the checkpoint's storage dtype; the run's is model.dtype (bf16 for every imported model)",
    "transformers_version": "the library version that wrote the file",
    "use_cache": "inference's key-value cache",
    "initial_context_length": "gpt-oss: the context before YaRN's extension (rope_scaling's original length)",
    "max_position_embeddings": "the longest position RoPE reaches (no parameters); the trained sequence is "
                               "transformer.seq_len",
    "rope_theta": "RoPE's base frequency: no parameters, and rotary FLOPs are not counted",
    "rope_scaling": "RoPE's context extension (YaRN's frequencies and attention scale): no parameters, the same FLOPs",
    "rms_norm_eps": "the norms' epsilon",
    "output_router_logits": "whether the HF forward returns the router logits",
    "pretraining_tp": "DeepSeek: the tensor parallelism whose GEMM slicing the HF forward reproduces bit for bit",
    "ep_size": "DeepSeek-V3: the expert parallelism of its inference code; the run's is parallelism.ep_size",
    "swiglu_limit": "gpt-oss: the clamp of the SwiGLU's inputs, the same FLOPs and parameters",
    "clip_qkv": "OLMoE: a clamp of Q, K and V, the same FLOPs and parameters",
}

#: what every imported model takes that a config.json does not say (module doc)
COMMON = {
    "model": {"dtype": "bf16", "ffn_activation": "swiglu"},
    "router": {"noise": "none", "temperature_start": 1.0, "temperature_end": 1.0, "capacity_factor": 0.0,
               "bias_std": 0.0},
}

#: DeepSeek-V3 §4.2: aux-loss-free balancing's bias update speed gamma = 0.001 and the
#: sequence-wise balance loss's alpha = 0.0001, which its config.json does not carry
DEEPSEEK_V3_BIAS_UPDATE_RATE = 0.001
DEEPSEEK_V3_SEQ_AUX_LOSS_COEF = 0.0001


class _Keys:
    """The keys of one config.json, each read (``get``), allowed one value only
    (``only``) or ignored, and any left over refused (``finish``)."""

    def __init__(self, path: str, cfg: dict, family: str):
        self.path, self.cfg, self.family, self.read = path, cfg, family, set()

    def refuse(self, reason: str) -> ScenarioError:
        return ScenarioError(FIELD, self.path, f"{self.family} config.json: {reason}")

    def get(self, key: str, default: Any = ..., kind: type | tuple = int) -> Any:
        """The value of ``key`` (``default`` when absent; without one, it must be there)."""
        self.read.add(key)
        if key not in self.cfg or (self.cfg[key] is None and default is not ...):
            if default is ...:
                raise self.refuse(f"has no {key}")
            return default
        value = self.cfg[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.refuse(f"{key} = {value!r}: expected " + " or ".join(t.__name__ for t in kinds))
        return value

    def only(self, key: str, allowed: tuple, feature: str) -> None:
        """``key`` may be absent or one of ``allowed``; another value is ``feature``,
        which the testbed does not model."""
        self.read.add(key)
        if key in self.cfg and self.cfg[key] not in allowed:
            raise self.refuse(f"{key} = {self.cfg[key]!r}: {feature} is not supported")

    def finish(self) -> None:
        for key in self.cfg:
            if key not in self.read and key not in IGNORED:
                raise self.refuse(f"unknown key {key!r} (neither read nor listed as changing neither time nor "
                                  "memory in testbed/scenario/hf_config.py)")


def read_config(path: str | Path) -> dict:
    """The scenario tables (model, transformer, router) of the config.json at ``path``."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ScenarioError(FIELD, str(path), "no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ScenarioError(FIELD, str(path), f"cannot read it as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ScenarioError(FIELD, str(path), "a config.json holds one JSON object")
    return config_sections(cfg, str(path))


def config_sections(cfg: dict, path: str = "config.json") -> dict:
    """The scenario tables of a parsed config.json (``path`` names it in errors)."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ScenarioError(FIELD, path, f"model_type = {family!r}: a supported family is one of "
                            + ", ".join(FAMILIES))
    keys = _Keys(path, cfg, family)
    keys.read.add("model_type")
    tables = FAMILIES[family](keys)
    keys.finish()
    out = {section: dict(COMMON.get(section, {})) for section in ("model", "transformer", "router")}
    for section, fields in tables.items():
        out[section].update(fields)
    return out


# ---- what every family shares ---------------------------------------------------------------------
def _common(k: _Keys, experts_key: str, ffn_key: str) -> dict:
    """hidden size, heads, vocabulary, experts and the router's init, as most families
    name them."""
    k.only("hidden_act", ("silu",), "an FFN activation other than SiLU (SwiGLU)")
    k.only("attention_dropout", (0, 0.0), "attention dropout")
    heads = k.get("num_attention_heads")
    model = {"hidden_size": k.get("hidden_size"), "ffn_hidden_size": k.get(ffn_key),
             "num_experts": k.get(experts_key), "top_k": k.get("num_experts_per_tok")}
    transformer = {"num_heads": heads, "num_kv_heads": k.get("num_key_value_heads", heads),
                   "vocab_size": k.get("vocab_size"),
                   "tied_embeddings": k.get("tie_word_embeddings", False, kind=bool)}
    head_dim = k.get("head_dim", None)
    if head_dim is not None:
        transformer["head_dim"] = head_dim
    router = {"weight_std": float(k.get("initializer_range", 0.02, kind=(int, float)))}
    return {"model": model, "transformer": transformer, "router": router}


def _merge(base: dict, **sections: dict) -> dict:
    for name, fields in sections.items():
        base.setdefault(name, {}).update(fields)
    return base


def _attention_bias(k: _Keys) -> str:
    """HF ``attention_bias``: a bias on Q, K, V and O (Qwen3-MoE, gpt-oss, OLMoE)."""
    return "all" if k.get("attention_bias", False, kind=bool) else "none"


def _layers(k: _Keys, first_dense: int = 0, every: int = 1) -> dict:
    total = k.get("num_hidden_layers")
    if first_dense > total or (total - first_dense) % every:
        raise k.refuse(f"num_hidden_layers = {total}: not {first_dense} dense layers then whole groups of "
                       f"{every} with the last one MoE")
    return {"num_layers": (total - first_dense) // every}


# ---- the families ---------------------------------------------------------------------------------
def _mixtral(k: _Keys) -> dict:
    """Mixtral (HF ``modeling_mixtral.py``): softmax top-k renormalised, every layer MoE."""
    k.only("sliding_window", (None,), "Mistral's sliding window on every layer")
    k.only("router_jitter_noise", (0, 0.0), "the router's multiplicative jitter noise")
    out = _common(k, "num_local_experts", "intermediate_size")
    return _merge(out, model=_layers(k),
                  router={"aux_loss_coef": float(k.get("router_aux_loss_coef", 0.001, kind=(int, float))),
                          "normalize_top_k": True})


def _qwen_moe(k: _Keys, qwen2: bool) -> dict:
    """Qwen2-MoE and Qwen3-MoE (HF ``modeling_qwen2_moe.py``, ``modeling_qwen3_moe.py``):
    layer i is MoE when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step is
    0 (the testbed's moe_every); Qwen2-MoE has a shared expert with a sigmoid gate and
    biases on Q, K and V."""
    k.only("use_sliding_window", (False,), "Qwen's sliding window on the layers from max_window_layers on")
    k.read.update(("sliding_window", "max_window_layers"))  # used only with use_sliding_window
    out = _common(k, "num_experts", "moe_intermediate_size")
    every = k.get("decoder_sparse_step", 1)
    dense_only = k.get("mlp_only_layers", [], kind=list)
    if dense_only != list(range(len(dense_only))) or (dense_only and every != 1):
        raise k.refuse(f"mlp_only_layers = {dense_only}: only leading dense layers (0, 1, ...) with "
                       "decoder_sparse_step = 1 are supported")
    first_dense = len(dense_only)
    transformer = {"moe_every": every, "first_dense_layers": first_dense,
                   "dense_ffn_hidden_size": k.get("intermediate_size")}
    router = {"aux_loss_coef": float(k.get("router_aux_loss_coef", 0.001, kind=(int, float))),
              "normalize_top_k": k.get("norm_topk_prob", False, kind=bool)}
    model = _layers(k, first_dense, every)
    if qwen2:
        shared = k.get("shared_expert_intermediate_size")
        model.update(shared_experts=1 if shared else 0, shared_ffn_hidden_size=shared, shared_expert_gate=bool(shared))
        transformer["attention_bias"] = "qkv"
    else:
        transformer["attention_bias"] = _attention_bias(k)
    return _merge(out, model=model, transformer=transformer, router=router)


def _gpt_oss(k: _Keys) -> dict:
    """gpt-oss (HF ``modeling_gpt_oss.py``; model card arXiv 2508.10925): top-k on the
    logits then a softmax over the k (= softmax renormalised), attention sinks, biases on
    the experts and the router, sliding and whole-sequence layers by layer_types. The
    MXFP4 of its checkpoint is a quantisation after training (the card's §2), not the
    training's."""
    out = _common(k, "num_local_experts", "intermediate_size")
    top_k = out["model"]["top_k"]
    if k.get("experts_per_token", top_k) != top_k:
        raise k.refuse(f"experts_per_token = {k.cfg['experts_per_token']} differs from num_experts_per_tok = {top_k}")
    quant = k.get("quantization_config", None, kind=dict)
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise k.refuse(f"quantization_config = {quant!r}: only gpt-oss's post-training mxfp4 is known")
    transformer = {"attention_bias": _attention_bias(k), "attention_sinks": True}
    transformer.update(_window(k, out["transformer"]))
    return _merge(out, model={**_layers(k), "ffn_bias": True},
                  transformer=transformer,
                  router={"aux_loss_coef": float(k.get("router_aux_loss_coef", 0.001, kind=(int, float))),
                          "normalize_top_k": True})


def _window(k: _Keys, transformer: dict) -> dict:
    """gpt-oss's layer_types: sliding layers and a whole-sequence one every n, from a
    sliding layer 0 (transformer.full_attention_every)."""
    types = k.get("layer_types", None, kind=list)
    window = k.get("sliding_window", None)
    if not types or "sliding_attention" not in types:
        return {}
    if window is None:
        raise k.refuse("layer_types has sliding layers but sliding_window is null")
    layers = k.cfg.get("num_hidden_layers")
    every = types.index("full_attention") + 1 if "full_attention" in types else 0
    expected = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(len(types))]
    if not every or types != expected or len(types) != layers:
        raise k.refuse("layer_types: only a whole-sequence layer every n from a sliding layer 0 is supported, "
                       f"one per layer ({layers})")
    return {"sliding_window": window, "full_attention_every": every}


def _olmoe(k: _Keys) -> dict:
    """OLMoE (HF ``modeling_olmoe.py``): softmax top-k, every layer MoE; its Q and K norms
    are not counted (transformer_shape's module doc)."""
    out = _common(k, "num_experts", "intermediate_size")
    return _merge(out, model=_layers(k), transformer={"attention_bias": _attention_bias(k)},
                  router={"aux_loss_coef": float(k.get("router_aux_loss_coef", 0.01, kind=(int, float))),
                          "normalize_top_k": k.get("norm_topk_prob", False, kind=bool)})


def _deepseek(k: _Keys) -> dict:
    """DeepSeek-V2 and V3 (their ``modeling_deepseek.py``; DeepSeek-V2 §2, DeepSeek-V3 §2):
    MLA, first_k_dense_replace dense layers then MoE ones with n_shared_experts shared
    experts of moe_intermediate_size each; routing by topk_method: greedy (plain top-k),
    group_limited_greedy (V2: groups ranked by their best score) or noaux_tc (V3: groups
    by the sum of their two best, aux-loss-free balancing with the bias update speed and
    sequence-wise loss of V3 §4.2)."""
    k.only("moe_layer_freq", (1,), "an MoE layer other than every layer after the dense ones")
    k.only("attention_bias", (False,), "biases on MLA's projections")
    k.read.add("num_key_value_heads")  # MLA's keys and values come per head from the latent: unread by the HF code
    out = _common(k, "n_routed_experts", "moe_intermediate_size")
    first_dense = k.get("first_k_dense_replace", 0)
    transformer = {"first_dense_layers": first_dense, "dense_ffn_hidden_size": k.get("intermediate_size"),
                   "attention": "mla", "q_lora_rank": k.get("q_lora_rank", 0), "kv_lora_rank": k.get("kv_lora_rank"),
                   "qk_nope_head_dim": k.get("qk_nope_head_dim"), "qk_rope_head_dim": k.get("qk_rope_head_dim"),
                   "v_head_dim": k.get("v_head_dim"), "mtp_layers": k.get("num_nextn_predict_layers", 0)}
    del out["transformer"]["num_kv_heads"]
    model = {**_layers(k, first_dense), "shared_experts": k.get("n_shared_experts", 0)}
    router = {"score": k.get("scoring_func", "softmax", kind=str),
              "normalize_top_k": k.get("norm_topk_prob", False, kind=bool),
              "routed_scaling_factor": float(k.get("routed_scaling_factor", 1.0, kind=(int, float)))}
    if router["score"] not in ("softmax", "sigmoid"):
        raise k.refuse(f"scoring_func = {router['score']!r}: softmax or sigmoid")
    method = k.get("topk_method", "greedy", kind=str)
    groups, per_token = k.get("n_group", 1), k.get("topk_group", 1)
    if method == "noaux_tc":
        router.update(bias_update_rate=DEEPSEEK_V3_BIAS_UPDATE_RATE, aux_loss_coef=0.0,
                      seq_aux_loss_coef=float(k.get("aux_loss_alpha", DEEPSEEK_V3_SEQ_AUX_LOSS_COEF,
                                                    kind=(int, float))))
        k.only("seq_aux", (True,), "a batch-wise balance loss beside aux-loss-free balancing")
    elif method in ("greedy", "group_limited_greedy"):
        alpha = float(k.get("aux_loss_alpha", 0.001, kind=(int, float)))
        sequence_wise = k.get("seq_aux", True, kind=bool)  # the HF MoEGate's per-sequence loss
        router.update(aux_loss_coef=0.0 if sequence_wise else alpha, seq_aux_loss_coef=alpha if sequence_wise else 0.0)
    else:
        raise k.refuse(f"topk_method = {method!r}: greedy, group_limited_greedy or noaux_tc")
    if method != "greedy" and groups > 1:  # greedy ignores the groups; one group limits nothing
        router.update(expert_groups=groups, groups_per_token=per_token,
                      group_score="top2_sum" if method == "noaux_tc" else "max")
    quant = k.get("quantization_config", None, kind=dict)
    if quant is not None:
        if quant.get("quant_method") != "fp8" or quant.get("weight_block_size") != [128, 128]:
            raise k.refuse(f"quantization_config = {quant!r}: only fp8 in 128 x 128 blocks (DeepSeek-V3) is known")
        # DeepSeek-V3 trained with fp8 GEMMs scaled per 128 x 128 weight block (§3.3.2): the checkpoint keeps them
        model.update(gemm_dtype="fp8", fp8_scaling="blockwise")
    return _merge(out, model=model, transformer=transformer, router=router)


FAMILIES = {
    "mixtral": _mixtral,
    "qwen2_moe": lambda k: _qwen_moe(k, qwen2=True),
    "qwen3_moe": lambda k: _qwen_moe(k, qwen2=False),
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "gpt_oss": _gpt_oss,
    "olmoe": _olmoe,
}
