"""Multi-token prediction on the real backend (``transformer.mtp_layers``; DeepSeek-V3 §2.2,
arXiv 2412.19437, eq. 21-25).

MTP module k (k = 1 .. D, ``d = k - 1`` here) predicts, at each position i, the token k + 1
ahead from the representation of depth k - 1 (the main model's last layer for k = 1):

    h'_i = M_k [norm(h^{k-1}_i); norm(Emb(t_{i+k}))]      M_k: 2H x H (eq. 21)
    h^k  = TRM_k(h')                                     one transformer layer (eq. 22)
    P^k  = OutHead(h^k)                                  the main model's head, shared (eq. 23)
    L_MTP = lambda / D sum_k CE(P^k, t_{i+k+1})          (eq. 24-25)

In the testbed's token task the target of position i is t_{i+1} (``real.kernels.task``), so
module k takes the embedding of the input token at i + k and the target at i + k, within
the position's sequence (``transformer.seq_len``): the last k positions of a sequence have
none, and their loss is left out (their rows still pass through the layer, so that every
MoE layer routes ``workload.tokens_per_rank`` tokens). The embedding and head are the main
model's (shared, their gradients summed from both uses).

TRM_k is one attention sublayer and an MoE layer (Megatron-LM's MTP takes the decoder's
last layer's spec; the model card counts it so: ``TransformerShape.mtp_module_params``).
Its MoE layer is one more MoE layer for the controller: the main model's L MoE layers are
its layers 0 .. L-1 and module d's is layer L + d (``testbed.model.mtp_layers``, as the
simulator plans it too), so its routing, pages, token exchange, expert sync, router and
shared experts are planned as every MoE layer's. Its projection and attention are in the
last MoE layer's (L + D - 1) gradient bucket, with the head (ready first in the
backward): its own MoE layer's bucket holds no block.
"""

from __future__ import annotations

import torch

#: lambda of the MTP loss (DeepSeek-V3 §4.2: 0.3 for the first 10T tokens, then 0.1)
MTP_LOSS_WEIGHT = 0.3

#: the layer index MTP module d's weights are seeded by (d added): past every model's layers
MTP_LAYER = 1 << 20


def mtp_weights(hidden: int, w, b, attention) -> dict:
    """MTP module weights: ``proj`` (M_k, 2H x H: its rows the normalised hidden state's
    then the embedding's) and ``attention`` (``attention(w, b)``: its layer's sublayer)."""
    return {"proj": w((2 * hidden, hidden), 14, None), "attention": attention(w, b)}


def tokens_ahead(ids_T: torch.Tensor, k: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids k positions ahead in each sequence of ``seq_len``, whether there is one) [T]:
    the last k positions of a sequence take id 0, marked invalid."""
    pos = torch.arange(ids_T.shape[0], device=ids_T.device)
    valid = (pos % seq_len) < seq_len - k
    ahead = torch.where(valid, ids_T.roll(-k), torch.zeros_like(ids_T))
    return ahead, valid
