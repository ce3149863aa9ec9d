"""What one GPU's memory holds over a simulated step, by category (issue 13).

Each category is the most it holds at once during the step, from the same figures the
phases' memory annotations use, for the GPU whose simulated memory peaked highest:

- ``expert_pages``: the expert weights resident at the step's start (the pager's slots,
  or every local expert unpaged);
- ``parameters``: the other weights (routers; the shared experts and the routed experts'
  biases; with the whole transformer attention, dense FFNs, embeddings and the MTP
  modules' projections and attentions), and with fp8 GEMMs the fp8 copies of the
  weights the step computes with (each layer's, held from its forward to its backward);
- ``gradients``: every gradient the backward makes (the experts that computed, routers,
  shared experts, the dense blocks'), held until the optimizer step;
- ``optimizer_state``: Adam's fp32 master weights and moments of everything the GPU holds
  (``transformer.optimizer = adam``), its ZeRO shard (``transformer.zero_stage``), none
  for plain SGD;
- ``activations``: what every layer's forward keeps for its backward (MoE layers: the
  input, each expert row's input, first GEMM's output and output, the shared experts';
  with the whole transformer also the dense blocks' and the logits; with recompute
  modules, ``transformer.recompute_modules``, less what they free, and instead of the
  logits, freed before any layer's backward, the expert rows one layer's ``moe``
  recompute makes again where those are more);
- ``comm_buffers``: the largest send and receive buffers of one batch of concurrent
  collectives (a phase's), of every stage, tensor-parallel ones included;
- ``communicators``: the communicators it holds (M10), ``collectives.communicator_MiB``
  each.

Every MoE layer the controller plans is counted, the MTP modules' too
(``testbed.model.mtp_layers``: their routed experts are paged, their routers and shared
experts held, as every MoE layer's; their projections and attentions are dense blocks).

The categories are not all at their most at one moment (activations peak at the end of
the forward, gradients at the end of the backward), so their sum bounds the timeline's
peak (``peak_memory_bytes``, reached where ``peak_memory_at`` says) from above.
"""

from __future__ import annotations

from sim.hardware.dense_layers import grouped_sum
from sim.step.phases import StepDecisions
from testbed.model.whole_model import block_grad_bytes


def memory_breakdown(sim, d: StepDecisions, phases, rank: int) -> dict[str, float]:
    """Bytes per category of GPU ``rank`` over the step ``d`` and its ``phases`` (module doc), the held
    ones (expert pages, communicators) as they stand after the step."""
    s, m, t = sim.s, sim.s.model, sim.s.transformer
    builder, dense = sim.builder, sim.builder.dense
    rows = [builder.expert_rows(f) for f in d.forward]
    router_bytes = builder.router_grad_bytes * m.num_layers
    params = router_bytes + (dense.param_bytes if t.enabled else 0.0)
    shared = builder.shared
    if builder.extra_param_bytes:
        params += builder.extra_param_bytes
    if builder.compute.fp8:  # the fp8 copies, each layer's as its forward made them
        params += sum(float(builder.fp8_copy_bytes(r)[rank]) for r in rows) + m.num_layers * shared.fp8_copy_bytes
        if t.enabled:
            params += sum(h - a for h, a in zip(dense.held_bytes, dense.activation_bytes))
            params += dense.head_held_bytes - dense.head_activation_bytes
    _, _, dense_shard, expert_shard = builder.zero  # ZeRO-2 keeps a shard of each gradient (of an ETP slice)
    activations = sum(float(builder.activation_bytes(r)[rank]) for r in rows)
    gradients = sum(int((r[rank] > 0).sum()) for r in rows) * builder.expert_update_bytes / expert_shard + router_bytes
    if shared.enabled:
        activations += m.num_layers * shared.activation_bytes
    if t.enabled:
        recomputed = max((float(builder.recomputed_bytes(r)[rank]) for r in rows), default=0.0)
        transient = dense.head_activation_bytes if dense.head_activation_bytes >= recomputed else recomputed
        activations += grouped_sum(dense.activation_bytes, lambda v: v) + transient
    if t.enabled or shared.enabled:
        gradients += sum(block_grad_bytes(s, layer) for layer in range(m.num_layers)) / dense_shard
    # the largest buffers of one collective phase: what the phases hold while their ops run
    buffers = max((float(ph.mem_transient[rank]) for ph in phases if ph.mem_transient is not None), default=0.0)
    return {"expert_pages": float(sim.expert_weight_bytes()[rank]), "parameters": params, "gradients": float(gradients),
            "optimizer_state": sim.optimizer_state_bytes(), "activations": activations,
            "comm_buffers": buffers, "communicators": float(sim.communicator_bytes()[rank])}
