"""``testbed model SPEC``: a model's card (``testbed.model.model_card``): total and active
parameters by component, forward FLOPs per token, Megatron-LM's FLOPs per token, the
dispatch bytes of a token and the weight bytes of one routed expert. SPEC is a preset
name (``--list``), a Hugging Face config.json, or a scenario TOML.
"""

from __future__ import annotations

import json

from testbed.core.errors import ScenarioError
from testbed.core.units import format_bytes
from testbed.model.model_card import COMPONENTS, ModelCard, model_card
from testbed.scenario.file import load_scenario
from testbed.scenario.presets import PRESETS_DIR, preset_names
from testbed.scenario.scenario import Scenario

#: the sequence length of the FLOPs per token unless --seq-len gives one: DeepSeek-V3's pre-training
#: sequence (arXiv 2412.19437 §4.2), at which Megatron-LM's figures are usually quoted
DEFAULT_SEQ_LEN = 4096


def add_parser(sub) -> None:
    p = sub.add_parser("model", help="a model's parameters, FLOPs per token, dispatch bytes and expert bytes",
                       description="Print a model's card: total and active parameters (by component), forward "
                       "FLOPs per token, the FLOPs Megatron-LM counts (forward + backward), a token's dispatch "
                       "bytes and one routed expert's weight bytes.")
    p.add_argument("spec", nargs="?", metavar="SPEC", help="a preset name (configs/models/NAME.toml), a Hugging "
                   "Face config.json, or a scenario TOML")
    p.add_argument("--list", action="store_true", help="list the presets")
    p.add_argument("--seq-len", type=int, default=None, help=f"sequence length of the FLOPs per token (default "
                   f"{DEFAULT_SEQ_LEN}; a scenario TOML: its transformer.seq_len)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one scenario field (repeatable)")
    p.add_argument("--json", action="store_true", help="print the card as one JSON object")
    p.set_defaults(func=run)


def scenario_of(spec: str, overrides=()) -> tuple[Scenario, str]:
    """The scenario SPEC names and what it is (preset, config.json or scenario)."""
    if spec.endswith(".json"):
        return load_scenario(None, overrides, base={"model": {"config": spec}}), "config.json"
    if spec.endswith(".toml"):
        return load_scenario(spec, overrides), "scenario"
    if spec not in preset_names():
        raise ScenarioError("SPEC", spec, "not a preset (" + ", ".join(preset_names()) + "), a config.json or a "
                            "scenario .toml")
    return load_scenario(None, overrides, base={"model": {"preset": spec}}), "preset"


def run(args) -> int:
    if args.list:
        for name in preset_names():
            print(f"{name:18s} {PRESETS_DIR / (name + '.toml')}")
        return 0
    if not args.spec:
        raise ScenarioError("SPEC", "", "give a preset name, a config.json or a scenario TOML (or --list)")
    if args.seq_len is not None and args.seq_len <= 0:
        raise ScenarioError("--seq-len", args.seq_len, "must be > 0")
    scenario, kind = scenario_of(args.spec, args.overrides)
    seq = args.seq_len or (scenario.transformer.seq_len if kind == "scenario" else DEFAULT_SEQ_LEN)
    try:
        card = model_card(scenario, seq)
    except ValueError as e:  # a shape the closed forms refuse (e.g. heads not dividing hidden)
        raise ScenarioError("SPEC", args.spec, str(e)) from None
    if args.json:
        print(json.dumps({"spec": args.spec, "kind": kind, **card.to_dict()}))
    else:
        print(format_card(args.spec, kind, scenario, card))
    return 0


def _count(n: float, unit: str = "") -> str:
    """``n`` with a decimal prefix: 671.03B, 1.04M (parameters), 86.88 GFLOP."""
    prefixes = (("T", 1e12), ("G" if unit else "B", 1e9), ("M", 1e6), ("K" if not unit else "k", 1e3))
    for prefix, scale in prefixes:
        if abs(n) >= scale:
            return f"{n / scale:.2f}" + (f" {prefix}{unit}" if unit else prefix)
    return f"{n:.0f}" + (f" {unit}" if unit else "")




def format_card(spec: str, kind: str, scenario: Scenario, card: ModelCard) -> str:
    """The card as a few readable lines."""
    p, m = card.params, scenario.model
    payload = "fp8" if scenario.comm.payload_dtype == "fp8" else m.dtype
    mtp = p.by_component["mtp"]
    parts = " | ".join(f"{k} {_count(p.by_component[k])}" for k in COMPONENTS if p.by_component[k])
    lines = [
        f"model       {spec} ({kind}): {card.layers} layers, {card.moe_layers} MoE, {m.num_experts} experts, "
        f"top-{m.top_k}" + (f", {m.shared_experts} shared" if m.shared_experts else ""),
        f"params      total {_count(p.total_without_mtp)}" + (f" (+ MTP {_count(mtp)} = {_count(p.total)})" if mtp else "")
        + f" | active {_count(p.active)} per token ({_count(p.active_with_embedding)} with the input embedding"
        + (", MTP aside)" if mtp else ")"),
        f"components  {parts}",
        f"FLOPs/token {_count(card.forward_flops_per_token, 'FLOP')} forward at seq_len {card.seq_len} (causal"
        + (", MTP included" if mtp else "") + f"); x 3 for a training step: "
        f"{_count(3 * card.forward_flops_per_token, 'FLOP')}",
        (f"Megatron    {_count(card.megatron_flops_per_token, 'FLOP')} per token, forward + backward "
         "(Megatron-LM num_floating_point_operations)"),
        (f"dispatch    {format_bytes(card.dispatch_bytes_per_token_per_moe_layer)} per token per MoE layer "
         f"(top-{m.top_k} x H {m.hidden_size} x {payload}), {format_bytes(card.dispatch_bytes_per_token)} over "
         f"the {card.moe_layers} MoE layers; the combine as much back"),
        f"expert      {format_bytes(card.expert_weight_bytes)} of weights per routed expert ({m.dtype})",
    ]
    return "\n".join(lines)
