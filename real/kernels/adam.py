"""Adam in mixed precision for the real backend's whole transformer (issue 13,
``transformer.optimizer = adam``; Kingma and Ba 2015, "Adam: a method for stochastic
optimization", algorithm 1; with ``transformer.adam_weight_decay`` AdamW's decoupled
decay, Loshchilov and Hutter 2019).

Per parameter it keeps an fp32 master copy of the weight and fp32 first and second
moments: 12 bytes, ``transformer.optimizer_state_bytes``' default, which the simulator
counts; the master copy is kept even when ``model.dtype`` is fp32, so both backends hold
the same bytes. A step updates the master and returns it, and the caller writes it back
in ``model.dtype`` where the weight lives (a tensor, or an expert's pages wherever they
are). Each parameter counts its own steps for the bias correction: an expert replica
that received no gradient this step keeps its moments and its count.
"""

from __future__ import annotations

import math

import torch

from testbed.scenario.scenario import Scenario

STATE_BYTES = 12  # fp32 master, m, v


class MixedAdam:
    """Adam state of named parameters (module doc)."""

    def __init__(self, scenario: Scenario):
        t = scenario.transformer
        self.lr, self.beta1, self.beta2, self.eps = t.adam_learning_rate, t.adam_beta1, t.adam_beta2, t.adam_eps
        self.weight_decay = t.adam_weight_decay  # AdamW's, decoupled from the gradient
        self.state: dict[object, dict] = {}  # key -> {"master", "m", "v", "t"}

    def add(self, key, weight: torch.Tensor) -> None:
        """Start the state of ``key`` from its current ``weight``."""
        master = weight.detach().to(torch.float32, copy=True)
        self.state[key] = {"master": master, "m": torch.zeros_like(master), "v": torch.zeros_like(master), "t": 0}

    def step(self, key, grad: torch.Tensor) -> torch.Tensor:
        """One Adam step of ``key`` on ``grad``; returns the new fp32 master weight."""
        st = self.state[key]
        g = grad.detach().to(torch.float32)
        st["t"] += 1
        st["m"].mul_(self.beta1).add_(g, alpha=1.0 - self.beta1)
        st["v"].mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        # the bias corrections as scalars (torch.optim.Adam's form): one temporary, the denominator
        corrected1, corrected2 = 1.0 - self.beta1 ** st["t"], 1.0 - self.beta2 ** st["t"]
        denominator = st["v"].sqrt().div_(math.sqrt(corrected2)).add_(self.eps)
        if self.weight_decay:  # AdamW (Loshchilov and Hutter 2019): shrink the weight, then the Adam step
            st["master"].mul_(1.0 - self.lr * self.weight_decay)
        st["master"].addcdiv_(st["m"], denominator, value=-self.lr / corrected1)
        return st["master"]

    def reset_weight(self, key, weight: torch.Tensor) -> None:
        """``key``'s weight was replaced from elsewhere (a replica refresh, M9): the
        master follows it; the moments stay the replica's own."""
        self.state[key]["master"].copy_(weight.detach().to(torch.float32))

    @property
    def nbytes(self) -> int:
        """Bytes of all the state (master weights and moments)."""
        return sum(st[k].numel() * st[k].element_size() for st in self.state.values() for k in ("master", "m", "v"))

    def state_dict(self) -> dict:
        """CPU copies, for checkpoints (M23)."""
        return {key: {k: (v.to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in st.items()}
                for key, st in self.state.items()}

    def load_state_dict(self, saved: dict) -> None:
        for key, st in saved.items():
            mine = self.state[key]
            for k, v in st.items():
                if torch.is_tensor(v):
                    mine[k].copy_(v)
                else:
                    mine[k] = v
