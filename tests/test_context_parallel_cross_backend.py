"""Context parallelism on CPU ranks (issue 25, item 2; ``parallelism.cp_size``): each
sequence in 2 CP chunks, CP index r of a group holding chunks r and 2 CP - 1 - r, attention
around the ring (``real.rank.context_parallel``), everything else on the rank's own tokens.

The unsplit run: the same tokens as whole sequences on world / (TP x CP) GPUs without
context or tensor parallelism (GPU g holds what the TP x CP group g holds, each row at its
position in its sequence), computed by the single-process reference
(``real.rank.reference``). The task draws each GPU's tokens by its rank
(``real.kernels.task.TokenTask``), so the reference is given the split run's tokens
joined: CP index r's rows are its TP group's, in member order (``testbed.scenario.scenario``).
Dropless routing without noise or a balance loss: each token's route is its own, so in
exact arithmetic every step's loss (the mean over the tokens either way), every output
row and every gradient is the same; held to the float bound of tests/conftest.py. The
simulator's replay of the split run's routing moves the same bytes per stage and per link
level, and the ring's are worked out by hand."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from real.backend import RealBackend
from real.comm.tensor_parallel import shard
from real.kernels.task import TokenTask
from real.rank import reference
from testbed.policy.context_parallel import local_positions
from testbed.run.results import summarize
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

SEQ, H, HEADS, KV_HEADS = 32, 32, 4, 2
MLA = {"attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 8}


@dataclass(frozen=True)
class Layout:
    """A split run on 4 CPU ranks (2 nodes of 2) and its unsplit run: ``tokens`` a rank,
    the unsplit run on ``whole_gpus`` GPUs of EP ``whole_ep``; ``transformer`` fields besides."""

    cp: int
    tp: int
    tokens: int
    whole_gpus: int
    whole_ep: int
    transformer: tuple = ()

    def extra(self) -> dict:
        return dict(self.transformer)


LAYOUTS = {
    "cp2": Layout(cp=2, tp=1, tokens=SEQ, whole_gpus=2, whole_ep=2),  # DP 2; a rank: 2 sequences' chunks
    "cp4": Layout(cp=4, tp=1, tokens=SEQ, whole_gpus=1, whole_ep=1),  # one group: every step kind of the ring
    "cp2-mla": Layout(cp=2, tp=1, tokens=SEQ, whole_gpus=2, whole_ep=2, transformer=tuple(MLA.items())),
    "tp2-cp2": Layout(cp=2, tp=2, tokens=SEQ // 2, whole_gpus=1, whole_ep=1),  # CP groups (0, 2) and (1, 3)
}


def scenario(tmp_path, gpus_per_node: int, nodes: int, cp: int, tp: int, tokens: int, ep: int, **transformer):
    """4 experts in 2 MoE layers after a dense layer each, attention over sequences of
    ``SEQ`` (grouped-query, or MLA); plain SGD (the reference's)."""
    return Scenario.from_dict({
        "model": {"hidden_size": H, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": gpus_per_node, "nodes_per_microcluster": nodes, "microclusters": 1},
        "parallelism": {"ep_size": ep, "cp_size": cp, "tp_size": tp},
        "router": {"capacity_factor": 0.0, "aux_loss_coef": 0.0, "noise": "none"},
        "pager": {"enabled": False},
        "comm": {"expert_sync": "allreduce"},
        "workload": {"tokens_per_rank": tokens},
        "transformer": {"enabled": True, "num_heads": HEADS, "num_kv_heads": KV_HEADS, "seq_len": SEQ,
                        "vocab_size": 128, "moe_every": 2, "optimizer": "sgd", **transformer},
        "run": {"steps": 3, "warmup_steps": 1, "output_dir": str(tmp_path), "learning_rate": 0.05},
    })


def joined_rows(lay: Layout) -> list[np.ndarray]:
    """For each split rank of a TP x CP group (tp index fastest): the rows of the unsplit
    GPU's tokens that are its rows (its CP index's local rows, its TP share of them)."""
    sequences = lay.tokens * lay.tp * lay.cp // SEQ
    out = []
    for c in range(lay.cp):
        local = np.concatenate([j * SEQ + local_positions(c, lay.cp, SEQ) for j in range(sequences)])
        out += [local[t * lay.tokens:(t + 1) * lay.tokens] for t in range(lay.tp)]
    return out


class JoinedTask:
    """GPU g of the unsplit run holds the whole sequences of the split run's TP x CP group g."""

    def __init__(self, split: Scenario, lay: Layout):
        self.task, self.rows = TokenTask(split), joined_rows(lay)

    def batch(self, step: int, gpu: int):
        group = len(self.rows)
        tokens = torch.empty(group * len(self.rows[0]), dtype=torch.long)
        targets = torch.empty_like(tokens)
        for k, rows in enumerate(self.rows):
            ids, tgt = self.task.batch(step, gpu * group + k)
            tokens[torch.from_numpy(rows)], targets[torch.from_numpy(rows)] = ids, tgt
        return tokens, targets


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request, tmp_path_factory):
    lay = LAYOUTS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    split = scenario(tmp, 2, 2, lay.cp, lay.tp, lay.tokens, 2, **lay.extra())
    whole = scenario(tmp, lay.whole_gpus, 1, 1, 1, lay.tokens * lay.cp * lay.tp, lay.whole_ep, **lay.extra())
    result = RealBackend().run(split, debug={"capture": True})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "TokenTask", lambda s: JoinedTask(split, lay))
        ref = reference.reference_run(whole)
    return lay, split, whole, result, ref, tmp


@pytest.mark.slow
def test_the_ring_computes_what_whole_sequences_do(runs, float_bound):
    """Every step's loss and every rank's output rows; the first step's gradients of the
    routed experts, the routers and every dense weight (summed over DP x CP; with TP each
    rank's shard of it), against the unsplit run's."""
    lay, split, whole, result, ref, _ = runs
    n = float_bound.chain(whole)
    assert float_bound.chain(split) == n  # the same tokens through the same layers
    assert [rec.loss for rec in result.records] == [float_bound.approx(want["loss"], n) for want in ref]
    rows, group = joined_rows(lay), lay.tp * lay.cp
    first = ref[0]
    for rank, cap in enumerate(result.captured):
        gpu, k = divmod(rank, group)
        for step, out in enumerate(cap["outputs"]):
            float_bound.assert_close(out, ref[step]["outputs"][gpu][rows[k]], n, msg=f"rank {rank} step {step}")
        assert cap["expert_grads"]
        for inst, grad in cap["expert_grads"].items():
            float_bound.assert_close(grad, first["expert_grads"][inst], n, msg=f"expert {inst}")
        assert cap["named_grads"].keys() == first["named_grads"].keys()
        for name, grad in cap["named_grads"].items():
            want = first["named_grads"][name]
            split_dims = [d for d in range(want.dim()) if grad.shape[d] != want.shape[d]]
            if split_dims:  # this rank's 1/tp of the weight
                want = shard(want, split_dims[0], rank % lay.tp, lay.tp)
            float_bound.assert_close(grad, want, n, msg=f"rank {rank} {name}")


@pytest.mark.slow
def test_the_ring_and_its_replay_move_the_same_bytes(runs):
    """The simulator replays the split run's routing: the ring's sends, the tensor-parallel
    collectives, the token exchange of each rank's own tokens, the syncs: the same bytes per
    stage and per link level. The ring's by hand, without TP: a KV block is a rank's 32 rows
    x 2 KV heads x 8 x (K and V) x 4 bytes = 4,096 bytes (MLA: 32 rows x 4 heads x (8 + 4 +
    8) x 4 = 10,240); each of the 4 attention sublayers sends CP - 1 of them per rank
    forward, and backward 2 (CP - 1) (the blocks again and their gradients)."""
    lay, split, _, result, _, tmp = runs
    cp, world = lay.cp, split.world_size
    result.routing.save(tmp)
    real = summarize(result.records, split.run.warmup_steps)
    if lay.tp == 1:
        block = SEQ * (HEADS * (8 + 4 + 8) if lay.transformer else KV_HEADS * (H // HEADS) * 2) * 4
        assert block == (10240 if lay.transformer else 4096)
        assert real["bytes_by_stage"]["dense"] == 4 * (cp - 1) * world * block
        assert real["bytes_by_stage"]["dense_backward"] == 4 * 2 * (cp - 1) * world * block
    replay = run_scenario(split.replace(workload={"trace": str(tmp)}), "sim")
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    assert real["bytes_by_level"] == replay["bytes_by_level"]
