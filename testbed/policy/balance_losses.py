"""The router's load-balancing losses: Switch's aux loss (M3) and DeepSeek-V3's
sequence-wise balance loss.

Tensor suffixes: T tokens, S sequences, E experts, K top-k slots.

- M3 (Switch form): alpha E sum_i f_i P_i, f_i the share of the rank's (token, slot)
  pairs routed to expert i (the choice made, before capacity), P_i the mean score of
  expert i over the rank's tokens; with sigmoid scores each token's scores are first
  normalised to sum to 1 (as eq. 19 below, and Megatron-LM's aux-loss scores do), with
  softmax they already do.
- Sequence-wise (DeepSeek-V3 §2.1.2, eq. 17-20), per sequence of T tokens:
  L_Bal = alpha sum_i f_i P_i, f_i = E / (K T) sum_t 1(s_{i,t} in Topk({s_{j,t}}, K)),
  s'_{i,t} = s_{i,t} / sum_j s_{j,t}, P_i = (1 / T) sum_t s'_{i,t}; averaged over the
  rank's sequences (HF DeepSeek-V2 ``seq_aux``: ``.mean()`` over the batch). The top-k in
  f_i is eq. 18's: of the unbiased scores s, over every expert (no bias, no group limit),
  as Megatron-LM's ``compute_routing_scores_for_aux_loss`` does. A sequence is
  ``transformer.seq_len`` tokens with the whole transformer, else the rank's tokens of
  the step (``sequence_tokens``).
"""

from __future__ import annotations

import torch

from testbed.scenario.scenario import Scenario


def sequence_tokens(scenario: Scenario) -> int:
    """Tokens of one sequence of the sequence-wise loss (module doc)."""
    t = scenario.transformer
    return t.seq_len if t.enabled else scenario.workload.tokens_per_rank


def switch_aux_loss(scores_TE: torch.Tensor, routed_E: torch.Tensor, slots: int, coef: float, score: str
                    ) -> torch.Tensor:
    """M3's loss of one rank's tokens, times ``coef``: ``routed_E`` the slots routed to each
    expert, ``slots`` = T x K."""
    num_experts = scores_TE.shape[-1]
    if score != "softmax":
        scores_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
    f_E = routed_E.float() / slots
    return coef * num_experts * (f_E * scores_TE.mean(0)).sum()


def sequence_balance_loss(scores_TE: torch.Tensor, top_k: int, coef: float, seq_tokens: int) -> torch.Tensor:
    """Eq. 17-20 (module doc) of one rank's tokens in sequences of ``seq_tokens``, times
    ``coef`` (a scalar; differentiable through P_i only)."""
    tokens, num_experts = scores_TE.shape
    s_STE = scores_TE.reshape(tokens // seq_tokens, seq_tokens, num_experts)
    p_SE = (s_STE / s_STE.sum(-1, keepdim=True)).mean(1)  # eq. 19, 20
    top_STK = s_STE.detach().topk(top_k, dim=-1).indices
    hits_SE = torch.zeros(p_SE.shape, dtype=scores_TE.dtype, device=scores_TE.device)
    hits_SE.scatter_add_(-1, top_STK.flatten(1), torch.ones(top_STK.flatten(1).shape, dtype=scores_TE.dtype,
                                                           device=scores_TE.device))
    f_SE = hits_SE * (num_experts / (top_k * seq_tokens))  # eq. 18
    return coef * (f_SE * p_SE).sum(-1).mean()  # eq. 17, averaged over sequences
