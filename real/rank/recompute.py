"""Megatron-Core's recompute by module on the real ranks (``transformer.recompute_modules``,
``--recompute-granularity selective --recompute-modules``; issue 25 item 6): the two ways a
module's forward is run again in the backward instead of keeping what it saved, as
``testbed.model.recompute_modules`` describes them (NVIDIA/Megatron-LM d98e8a64,
``megatron/core/tensor_parallel/random.py``), and which modules a scenario names.

- ``checkpoint`` (``core_attn``, ``mlp``, ``shared_experts``; random.py:600-631): the
  module runs keeping only its inputs and its output; its backward runs it again with grad.
  Here ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: its saved-tensor hooks
  keep nothing of the module's own saves, its inputs are kept once (saved for backward by
  the checkpoint, which is what a rank's ``ActivationMeter`` counts) and its recompute
  restores the CPU RNG state of the forward (``preserve_rng_state``). No module recomputed
  here draws random numbers (the real model has no dropout); the router's Gumbel noise
  (``real.rank.layer.noise_generator``, a generator seeded per call) is drawn in the MoE
  layer, whose recompute (``moe``) the real backend refuses (``real.backend``).
- ``checkpoint_without_output`` (``layernorm``, ``mla_up_proj``; random.py:848-1028): as
  above, and the module's output is not kept by its consumers either: Megatron resizes the
  output's storage to 0 once its consumers ran (993-996) and a hook refills it when their
  gradient arrives. Here the consumers run under ``torch.autograd.graph.saved_tensors_hooks``
  whose pack hook keeps, in place of any tensor on the output's storage (the output or a
  view of it), only its size, stride and offset; the first unpack in the backward runs the
  module again (no grad) on its kept inputs and returns the same view of the refilled
  output. So exactly what Megatron frees is freed: the module's internal saves (by the
  checkpoint) and every consumer's reference to its output (by the hooks), while the
  consumers' other saves go to the hooks outside (a rank's ``ActivationMeter``, an outer
  recompute). The refill draws no random numbers and restores no RNG state: the modules
  run so (norms, MLA's up projections) draw none. The refilled output lives until the
  consumers' graph is released. The
  module runs three times (forward, refill, the checkpoint's recompute for its own
  backward) where Megatron's runs twice; the bytes kept are the same.
- ``moe_act`` (experts.py:269-276): ``real.kernels.experts.PagedExpertFFN`` keeps the
  activation's input and recomputes the activation in its backward whatever the modules
  (both its kernels), so the real experts always run as with ``moe_act``: naming it
  frees nothing more on these ranks.

Where each is wired: the attention core and MLA's up projections in
``real.rank.attention``, the norms and dense FFNs in ``real.rank.dense_model``, the
shared experts in ``real.rank.shared_experts``. The module names are read once per
scenario (``testbed.model.whole_model.recompute_modules_of``; checked by
``testbed.model.recompute_modules.check_recompute_modules`` in ``real.backend``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from testbed.model.whole_model import recompute_modules_of


def checkpoint(fn, *inputs):
    """``fn(*inputs)`` keeping only its inputs for the backward, which runs it again (module doc)."""
    return _torch_checkpoint(fn, *inputs, use_reentrant=False)


@dataclass(frozen=True)
class _Refill:
    """What a consumer keeps of a tensor on a recomputed output's storage: which output,
    and the view of it (elements)."""

    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


#: torch's saved-tensor hook stack, read to pass the consumers' other saves on (module doc): a
#: private function of torch 2.8 and later (``torch._C._autograd``), None on older ones, where the
#: real backend refuses the modules that need it (``WITHOUT_OUTPUT``)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
#: the modules run by ``checkpoint_without_output``
WITHOUT_OUTPUT = ("layernorm", "mla_up_proj")


def without_output_supported() -> bool:
    """Whether this torch lets ``checkpoint_without_output`` read the hook stack."""
    return _top_hooks is not None


def checkpoint_without_output(fn, consumer, *inputs):
    """``consumer(fn(*inputs))`` where ``fn`` keeps only its inputs and ``consumer`` keeps
    no reference to ``fn``'s output (a tensor or a tuple of tensors): refilled by running
    ``fn`` again when the backward first needs it (module doc)."""
    outs = checkpoint(fn, *inputs)
    listed = outs if isinstance(outs, tuple) else (outs,)
    storages = {o.untyped_storage().data_ptr(): i for i, o in enumerate(listed)}
    outer = _top_hooks(False)  # an outer meter's or recompute's
    refilled: list[torch.Tensor] = []

    def pack(t):
        i = storages.get(t.untyped_storage().data_ptr())
        if i is not None and t.dtype == listed[i].dtype:
            return _Refill(i, t.size(), t.stride(), t.storage_offset())
        return outer[0](t) if outer is not None else t

    def unpack(p):
        if isinstance(p, _Refill):
            if not refilled:
                with torch.no_grad():
                    again = fn(*(x.detach() if isinstance(x, torch.Tensor) else x for x in inputs))
                refilled.extend(again if isinstance(again, tuple) else (again,))
            return refilled[p.index].as_strided(p.size, p.stride, p.offset)
        return outer[1](p) if outer is not None else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consumer(outs)


@dataclass(frozen=True)
class Recompute:
    """The recompute modules a rank runs (``transformer.recompute_modules``), and the
    wrappers that run a module's forward as they say."""

    modules: frozenset = frozenset()

    @classmethod
    def of(cls, scenario) -> Recompute:
        return cls(frozenset(recompute_modules_of(scenario)))

    def __contains__(self, module: str) -> bool:
        return module in self.modules

    def run(self, module: str, fn, *inputs):
        """``fn(*inputs)``, checkpointed when ``module`` is recomputed."""
        return checkpoint(fn, *inputs) if module in self.modules else fn(*inputs)

    def run_without_output(self, module: str, fn, consumer, *inputs):
        """``consumer(fn(*inputs))``, ``fn`` checkpointed without its output when ``module``
        is recomputed."""
        if module in self.modules:
            return checkpoint_without_output(fn, consumer, *inputs)
        return consumer(fn(*inputs))


#: no module recomputed
NO_RECOMPUTE = Recompute()
