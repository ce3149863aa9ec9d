"""Megatron-Core's combined 1F1B (``overlap.moe_expert_parallel_comm``, its
``--overlap-moe-expert-parallel-comm``): which scenarios it runs on.

In the steady state of the (interleaved) 1F1B schedule, and between the micro-batches of
gradient accumulation without pipeline stages, the forward of one micro-batch and the
backward of another run as one scheduled unit, layer by layer, so that one's expert-parallel
dispatch and combine run while the other computes (``combined_1f1b.py``,
``combined_1f1b_schedule_for_no_pipelining`` and ``..._for_interleaved_pipelining``). The
simulator times it in ``sim.pipeline.schedule`` (``OverlappedPair``).

Refused as Megatron-Core's ``TransformerConfig.__post_init__`` refuses it (Megatron-LM at
d98e8a64ddf34856e74b24714e3bedb2f5a39553, ``megatron/core/transformer/transformer_config.py``),
each naming the scenario field that carries Megatron's option:

- pipeline stages without virtual chunks: "virtual_pipeline_model_parallel_size must be
  specified when pipeline_model_parallel_size > 1" (Megatron-LM's arguments turn one virtual
  stage into none): ``parallelism.pp_chunks``. Without them each stage's pair would wait for
  its neighbour's (the extra warm-up forward is one ahead only), which makes the step longer;
- no expert parallelism (``parallelism.ep_size`` 1), a token dispatcher other than alltoall or
  flex (``comm.token_strategy``: alltoall, or deepep for flex), full recompute
  (``transformer.recompute``), ``moe`` in ``transformer.recompute_modules``, a model in
  neither bf16 nor fp16 (``model.dtype``), the shared-expert overlap
  (``overlap.shared_experts`` where the model has shared experts: Megatron's
  ``moe_shared_expert_overlap``), more than one MTP module (``transformer.mtp_layers``).

And by the testbed: DualPipe (``parallelism.pipeline_schedule``) overlaps pairs of its own
(``sim.pipeline.dualpipe``); combined 1F1B is Megatron's 1F1B. Megatron's other conditions
have no field here (torch >= 2.6, CUDA graphs of the moe or mlp scope, delay_wgrad_compute,
FSDP with interleaving).
"""

from __future__ import annotations

from testbed.core.errors import ScenarioError
from testbed.scenario.scenario import Scenario

FIELD = "overlap.moe_expert_parallel_comm"
DISPATCHERS = ("alltoall", "deepep")  # Megatron's alltoall and flex (DeepEP) token dispatchers


def combined_1f1b(s: Scenario) -> bool:
    """Whether the scenario's (pipelined) micro-batches run as combined 1F1B."""
    return bool(s.overlap.moe_expert_parallel_comm)


def check_combined_1f1b(s: Scenario) -> None:
    """Raise ``ScenarioError`` naming the first field that rules combined 1F1B out (module doc);
    nothing when ``overlap.moe_expert_parallel_comm`` is off."""
    if not combined_1f1b(s):
        return
    p, t, m = s.parallelism, s.transformer, s.model
    why = f"with {FIELD} = true: "
    modules = [n.strip() for n in t.recompute_modules.split(",") if n.strip()]
    refusals = (
        (not t.enabled, "transformer.enabled", t.enabled, "it pairs the whole transformer's micro-batches"),
        (p.pipeline_schedule == "dualpipe", "parallelism.pipeline_schedule", p.pipeline_schedule,
         "DualPipe overlaps its own forward-backward pairs; combined 1F1B is Megatron's (interleaved) 1F1B"),
        (p.pp_size > 1 and p.pp_chunks == 1, "parallelism.pp_chunks", p.pp_chunks,
         (f"Megatron-Core needs the interleaved schedule, pp_chunks > 1 (its virtual_pipeline_model_parallel_size), "
          f"with parallelism.pp_size = {p.pp_size}")),
        (p.ep_size == 1, "parallelism.ep_size", p.ep_size, "Megatron-Core runs it only with expert parallelism"),
        (s.comm.token_strategy not in DISPATCHERS, "comm.token_strategy", s.comm.token_strategy,
         "Megatron-Core runs it with the alltoall or flex (deepep) token dispatcher only"),
        (t.recompute == "full", "transformer.recompute", t.recompute, "Megatron-Core refuses it beside full recompute"),
        ("moe" in modules, "transformer.recompute_modules", t.recompute_modules,
         "Megatron-Core refuses it with moe in recompute_modules"),
        (m.dtype not in ("bf16", "fp16"), "model.dtype", m.dtype,
         "Megatron-Core runs it with a bf16 or fp16 model only"),
        (m.shared_experts > 0 and s.overlap.shared_experts, "overlap.shared_experts", s.overlap.shared_experts,
         "Megatron-Core refuses it beside the shared-expert overlap (moe_shared_expert_overlap): set it false"),
        (t.mtp_layers > 1, "transformer.mtp_layers", t.mtp_layers, "Megatron-Core runs it with at most one MTP module"),
    )
    for refused, field, value, reason in refusals:
        if refused:
            raise ScenarioError(field, value, why + reason)
