"""The real backend's model holds the parameters the model card counts
(``testbed.model.model_card``), component by component, for the features of the models
people train: SwiGLU, shared experts and their gate, dense-first layers, a head dimension
of its own, attention biases, MLA (with and without a query latent) and MTP modules; the
simulator's memory breakdown is drawn from those counts.

Two differences are by design and stated: the real model's norms carry no weights (the
card counts them apart, ``norms``, and in each MTP module), and its router always has M1's
gate bias (E per MoE layer) where the card counts a router bias only for the models that
have one (gpt-oss's, DeepSeek-V3's balancing bias: ``router_bias``)."""

import pytest
import torch

from real.rank.dense_model import DenseModel
from real.rank.rank_state import initial_expert_flat, initial_router
from real.rank.shared_experts import SharedExperts
from testbed.model.model_card import param_count
from testbed.model.mtp_layers import controller_scenario, mtp_modules
from testbed.model.whole_model import shape_of
from testbed.scenario.file import load_scenario
from testbed.scenario.scenario import Scenario

CPU, FP32 = torch.device("cpu"), torch.float32


def numel(named) -> int:
    return sum(p.numel() for _, p in named)


def real_params(s: Scenario) -> dict[str, int]:
    """The real model's parameters by the card's components, counted from the tensors its
    constructors make (``DenseModel``, ``SharedExperts``, the routers and expert flats)."""
    m = s.model
    layers, d = m.num_layers, mtp_modules(s)
    dense = DenseModel(s, FP32, CPU)
    shared = SharedExperts(controller_scenario(s), layers + d, FP32, CPU) if m.shared_experts else None
    expert = initial_expert_flat(s.run.seed, 0, m.hidden_size, m.ffn_hidden_size, m.ffn_activation == "swiglu").numel()
    router = sum(p.numel() for p in initial_router(s.run.seed, 0, s))
    shared_of = (lambda layer: numel(shared.named_layer_params(layer))) if shared is not None else (lambda layer: 0)
    first_att = sum(numel(att.items()) for att, _ in dense.first_dense)
    first_ffn = sum(numel(ffn.items()) for _, ffn in dense.first_dense)
    return {
        "embedding": dense.embedding.numel() if dense.head is not None else 0,
        "head": (dense.head if dense.head is not None else dense.embedding).numel(),
        "attention": sum(numel(sub.items()) for block in dense.attention for sub in block) + first_att,
        "dense_ffn": sum(numel(sub.items()) for block in dense.ffn for sub in block) + first_ffn,
        "routed_experts": layers * m.num_experts * expert,
        "shared_experts": sum(shared_of(layer) for layer in range(layers)),
        "routers": layers * router,
        "mtp": sum(numel([("proj", mod["proj"])]) + numel(mod["attention"].items()) + router + m.num_experts * expert
                   + shared_of(layers + k) for k, mod in enumerate(dense.mtp)),
    }


def small(**over) -> Scenario:
    d = {"model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
         "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
         "parallelism": {"ep_size": 2},
         "transformer": {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": 16, "vocab_size": 128}}
    for section, values in over.items():
        d.setdefault(section, {}).update(values)
    return Scenario.from_dict(d)


CASES = {
    "deepseek-like-cpu": lambda root: load_scenario(root / "configs" / "deepseek-like-cpu.toml"),
    "qwen-like-cpu": lambda root: load_scenario(root / "configs" / "qwen-like-cpu.toml"),
    # gelu, tied embeddings, two dense FFNs a block, attention biases of Q, K, V and O
    "gelu-tied": lambda root: small(transformer={"moe_every": 3, "tied_embeddings": True, "attention_bias": "all",
                                                 "head_dim": 12}),
    # MLA without a query latent (DeepSeek-V2-Lite), two MTP modules, two shared experts with a gate
    "mla-lite": lambda root: small(model={"ffn_activation": "swiglu", "shared_experts": 2,
                                          "shared_ffn_hidden_size": 20, "shared_expert_gate": True},
                                   transformer={"attention": "mla", "q_lora_rank": 0, "kv_lora_rank": 16,
                                                "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
                                                "mtp_layers": 2, "first_dense_layers": 2,
                                                "dense_ffn_hidden_size": 40}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_real_parameters_are_the_model_cards(case, repo_root):
    s = CASES[case](repo_root)
    shape = shape_of(s)
    card = param_count(shape).by_component
    got = real_params(s)
    gate_bias = 0 if shape.router_bias else s.model.num_experts  # M1's gate bias, per MoE layer
    want = dict(card)
    want["routers"] += shape.moe_layers * gate_bias
    want["mtp"] += shape.mtp_layers * (gate_bias - shape.mtp_module_norm_params)
    del want["norms"]
    assert got == want
    assert sum(got.values()) == param_count(shape).total - card["norms"] + (shape.moe_layers + shape.mtp_layers) * (
        gate_bias) - shape.mtp_layers * shape.mtp_module_norm_params
    assert got["attention"] > 0 and got["routed_experts"] > 0
