"""Expert tensor parallelism and the nested MoE layout on CPU ranks (issue 25, item 3;
``parallelism.etp_size``, ``parallelism.moe_layout``): each rank holds 1/ETP of each of its
shard's experts (``real.rank.rank_state.expert_slice_flat``), the ETP group all-gathers the
rows its members received in the EP all-to-all, computes its slice on all of them and
reduce-scatters the partial outputs back (``real.comm.expert_tensor_parallel``); the EP,
ETP and expert-DP groups are the layout's (``testbed.scenario.topology.Layout``).

The unsplit run computes the same tokens with whole experts in one process
(``real.rank.reference``). On the MoE stack it is the same scenario, each rank's tokens its
own; with the whole transformer under tensor parallelism and sequence parallelism it is half
the GPUs without TP, GPU g holding the tokens of TP group g's ranks 2g and 2g + 1 (as
tests/test_shared_sequences_cross_backend.py). In exact arithmetic every step's loss, every
output row and every gradient is the same (an expert slice's gradient the slice of the whole
expert's), and every slice starts as the slice of the whole expert the unsplit run starts
from; held to the float bound of tests/conftest.py. The layouts: folded ETP 2 x EP 2 on 4
ranks (ETP groups (0, 1), (2, 3), EP groups (0, 2), (1, 3), each slice on one rank), and
nested TP 2 x EP 2 on 8 ranks (EP carved out of DP: EP groups (0, 2), (1, 3), (4, 6), (5, 7),
ETP = TP groups, each slice's gradient summed over its expert-DP group (0, 4), (1, 5), ...).
"""

from dataclasses import dataclass

import pytest
import torch

from real.backend import RealBackend
from real.comm.tensor_parallel import shard
from real.kernels.task import TokenTask
from real.rank import reference
from real.rank.rank_state import expert_slice_flat
from testbed.core.errors import ScenarioError
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import Layout

SEQ, H, F = 32, 32, 48


@dataclass(frozen=True)
class Case:
    """A split run (``nodes`` nodes of 2 CPU ranks) and how its unsplit run is laid out."""

    nodes: int
    parallelism: tuple
    transformer: bool
    activation: str

    @property
    def tp(self) -> int:
        return dict(self.parallelism).get("tp_size", 1)


CASES = {
    # the MoE stack, SwiGLU, capacity drops: expert TP alone (no dense layers to split)
    "moe-stack etp 2": Case(2, (("ep_size", 2), ("etp_size", 2)), False, "swiglu"),
    # the whole transformer: folded TP 2 x ETP 2 x EP 2 on 4 ranks
    "folded tp 2 etp 2": Case(2, (("tp_size", 2), ("ep_size", 2), ("etp_size", 2)), True, "gelu"),
    # nested TP 2 x EP 2 on 8 ranks: expert DP 2
    "nested tp 2 ep 2": Case(4, (("tp_size", 2), ("ep_size", 2), ("etp_size", 2), ("moe_layout", "nested")), True,
                             "swiglu"),
}


def scenario(tmp_path, case: Case, split: bool) -> Scenario:
    """4 experts in 2 MoE layers (with the transformer after a dense layer each); plain SGD.
    The unsplit run: ``nodes`` nodes of 2 / TP GPUs, no TP, EP 2, ETP 1, folded."""
    tokens = SEQ // case.tp if split else SEQ
    parallelism = dict(case.parallelism) if split else {"ep_size": 2}
    data = {
        "model": {"hidden_size": H, "ffn_hidden_size": F, "num_experts": 4, "num_layers": 2,
                  "ffn_activation": case.activation},
        "cluster": {"gpus_per_node": 2 if split else 2 // case.tp, "nodes_per_microcluster": case.nodes,
                    "microclusters": 1},
        "parallelism": {**parallelism, "sequence_parallel": True} if case.transformer else parallelism,
        # the MoE stack routes each rank's own tokens either way: capacity and noise as the run's;
        # with TP a rank routes half of what the unsplit GPU does: dropless, without noise or aux loss
        "router": ({"capacity_factor": 1.0} if not case.transformer
                   else {"capacity_factor": 0.0, "aux_loss_coef": 0.0, "noise": "none"}),
        "pager": {"enabled": False},
        "heat": {"enabled": False},
        "comm": {"expert_sync": "allreduce"},
        "workload": {"tokens_per_rank": tokens},
        "run": {"steps": 3, "warmup_steps": 1, "output_dir": str(tmp_path), "learning_rate": 0.05},
    }
    if case.transformer:
        data["transformer"] = {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": SEQ,
                               "vocab_size": 128, "moe_every": 2, "optimizer": "sgd"}
    return Scenario.from_dict(data)


class JoinedTask:
    """GPU g of the unsplit run holds the tokens of the split run's TP group g, in member order."""

    def __init__(self, split: Scenario):
        self.task, self.tp = TokenTask(split), split.parallelism.tp_size

    def batch(self, step: int, gpu: int):
        parts = [self.task.batch(step, self.tp * gpu + i) for i in range(self.tp)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, tmp_path_factory):
    case = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param.replace(" ", "-"))
    split, whole = scenario(tmp, case, True), scenario(tmp, case, False)
    result = RealBackend().run(split, debug={"capture": True})
    with pytest.MonkeyPatch.context() as mp:
        if case.tp > 1:
            mp.setattr(reference, "TokenTask", lambda s: JoinedTask(split))
        ref = reference.reference_run(whole)
    return case, split, whole, result, ref


def rows_of(case: Case, rank: int, ref_rows: torch.Tensor) -> torch.Tensor:
    """The unsplit GPU's output rows that are split rank ``rank``'s."""
    gpu, k = divmod(rank, case.tp)
    n = ref_rows[gpu].shape[0] // case.tp
    return ref_rows[gpu][k * n:(k + 1) * n]


@pytest.mark.slow
def test_expert_slices_compute_what_whole_experts_do(runs, float_bound):
    """Every step's loss and every rank's output rows; the first step's gradient of every
    expert slice (summed over its expert-DP group) and the slice after the update, the
    routers' and every dense weight's gradients (with TP each rank's shard), against the
    unsplit run's."""
    case, split, whole, result, ref = runs
    n = float_bound.chain(whole)
    assert float_bound.chain(split) == n  # the same tokens through the same layers
    assert [rec.loss for rec in result.records] == [float_bound.approx(want["loss"], n) for want in ref]
    lay, m = Layout(split), split.model
    swiglu = m.ffn_activation == "swiglu"
    etp = split.parallelism.etp_size

    def piece(flat, rank):
        return expert_slice_flat(flat, H, F, swiglu, etp, int(lay.etp_index[rank]))

    first = ref[0]
    for rank, cap in enumerate(result.captured):
        for step, out in enumerate(cap["outputs"]):
            float_bound.assert_close(out, rows_of(case, rank, ref[step]["outputs"]), n, msg=f"rank {rank} step {step}")
        local = {layer * 4 + e for layer in range(2) for e in lay.local_experts(rank)}
        assert cap["expert_grads"] and set(cap["expert_grads"]) <= local
        for inst in local - set(cap["expert_grads"]):  # no token anywhere: not updated
            assert not first["expert_grads"][inst].any()
        for inst, grad in cap["expert_grads"].items():
            assert grad.numel() == m.expert_params // etp
            float_bound.assert_close(grad, piece(first["expert_grads"][inst], rank), n, msg=f"expert {inst}")
        for inst, w in cap["experts_after"].items():
            float_bound.assert_close(w, piece(first["experts_after"][inst], rank), float_bound.updates(split))
        for name, grad in cap["named_grads"].items():
            want = first["named_grads"][name]
            split_dims = [d for d in range(want.dim()) if grad.shape[d] != want.shape[d]]
            if split_dims:  # this rank's 1/tp of the weight
                want = shard(want, split_dims[0], rank % case.tp, case.tp)
            float_bound.assert_close(grad, want, n, msg=f"rank {rank} {name}")
    if not case.transformer:
        assert sum(rec.dropped_slots for rec in result.records) > 0  # the capacity path ran


def test_a_slice_is_the_whole_experts_columns_and_rows():
    """SwiGLU: slice 1 of 2 of w1 [H, 2F] is its gate columns [F/2, F) then its up columns
    [3F/2, 2F), of w2 [F, H] rows [F/2, F); the slices' FFN outputs add up to the whole's."""
    hidden, ffn = 4, 6
    w1, w2 = torch.randn(hidden, 2 * ffn), torch.randn(ffn, hidden)
    flat = torch.cat([w1.reshape(-1), w2.reshape(-1)])
    got = expert_slice_flat(flat, hidden, ffn, True, 2, 1)
    want = torch.cat([torch.cat([w1[:, 3:6], w1[:, 9:12]], dim=1).reshape(-1), w2[3:6].reshape(-1)])
    assert torch.equal(got, want)
    assert torch.equal(expert_slice_flat(flat, hidden, ffn, True, 1, 0), flat)
    x = torch.randn(5, hidden)

    def ffn_of(f, inner):
        a = x @ f[:hidden * 2 * inner].view(hidden, -1)
        return (torch.nn.functional.silu(a[:, :inner]) * a[:, inner:]) @ f[hidden * 2 * inner:].view(inner, hidden)

    parts = ffn_of(expert_slice_flat(flat, hidden, ffn, True, 2, 0), 3) + ffn_of(got, 3)
    torch.testing.assert_close(parts, ffn_of(flat, ffn))


@pytest.mark.parametrize("change, field", [
    ({"pager": {"enabled": True}}, "pager.enabled"),
    ({"heat": {"enabled": True}}, "heat.enabled"),
    ({"comm": {"expert_sync": "two_stage"}}, "comm.expert_sync"),
    ({"comm": {"token_strategy": "allgather"}}, "comm.token_strategy"),
    ({"comm": {"token_strategy": "deepep"}}, "comm.token_strategy"),
    ({"overlap": {"micro_batches": 2}}, "overlap.micro_batches"),
])
def test_what_expert_tp_cannot_run_with_is_refused_before_a_rank_starts(tmp_path, change, field):
    """``testbed.policy.expert_tensor_parallel.check_expert_tensor_parallel``'s refusals (and the
    real backend's own, of micro-batched exchanges) hold on the real backend too: one line
    naming the field, before a run folder is written or a rank started."""
    s = scenario(tmp_path / "runs", CASES["moe-stack etp 2"], True).replace(**change)
    with pytest.raises(ScenarioError, match=rf"^{field} = .*parallelism\.etp_size = 2"):
        run_scenario(s, "real")
    assert not (tmp_path / "runs").exists()
