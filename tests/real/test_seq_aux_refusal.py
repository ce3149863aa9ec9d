"""The sequence-wise balance loss (DeepSeek-V3 eq. 17-20) with a sequence split over GPUs
(TP + SP sharing a micro-batch, or CP): the scenario loads and the simulator runs it (it
routes synthetic tokens and takes no loss); the real backend, whose router takes the loss
over each rank's own sequences, refuses it naming ``router.seq_aux_loss_coef``."""

import pytest

from real.backend import check_runnable
from testbed.core.errors import ScenarioError
from testbed.run.backend import get_backend
from testbed.run.features import check_features
from testbed.scenario.scenario import Scenario

#: 16 GPUs, TP 2 x PP 2 with sequence parallelism, sequences of 64
TP_SPLIT = {
    "model": {"num_layers": 4},
    "cluster": {"gpus_per_node": 8, "nodes_per_microcluster": 2, "microclusters": 1},
    "parallelism": {"ep_size": 4, "tp_size": 2, "pp_size": 2},
    "transformer": {"enabled": True, "seq_len": 64, "micro_batches": 2},
    "pager": {"enabled": False},
}

#: 8 GPUs, CP 2: each sequence of 1,024 over 2 GPUs
CP_SPLIT = {
    "model": {"hidden_size": 128, "ffn_hidden_size": 128, "num_experts": 8, "num_layers": 2},
    "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 2, "microclusters": 1},
    "parallelism": {"ep_size": 4, "cp_size": 2},
    "workload": {"tokens_per_rank": 512},
    "transformer": {"enabled": True, "seq_len": 1024},
    "pager": {"enabled": False},
}


def build(base, tokens=None, coef=1e-4) -> Scenario:
    data = {k: dict(v) for k, v in base.items()}
    data["router"] = {"seq_aux_loss_coef": coef}
    if tokens is not None:
        data["workload"] = {"tokens_per_rank": tokens}
    return Scenario.from_dict(data)


@pytest.mark.parametrize("base, tokens", [(TP_SPLIT, 64), (CP_SPLIT, None)], ids=["tp-sp", "cp"])
def test_split_sequences_load_and_the_simulator_takes_them(base, tokens):
    """64 tokens a GPU in 2 micro-batches of 32: half a sequence of 64 each (TP 2 shares it);
    CP 2: half of each sequence of 1,024."""
    s = build(base, tokens)
    check_features(s, "sim")
    get_backend("sim").check(s)


@pytest.mark.parametrize("base, tokens", [(TP_SPLIT, 64), (CP_SPLIT, None)], ids=["tp-sp", "cp"])
def test_the_real_backend_refuses_them_naming_the_field(base, tokens):
    with pytest.raises(ScenarioError) as err:
        check_runnable(build(base, tokens))
    assert err.value.field == "router.seq_aux_loss_coef"


def test_whole_sequences_on_each_gpu_pass_the_real_check():
    """128 tokens a GPU in 2 micro-batches: 64, one whole sequence each; and no loss at all."""
    check_runnable(build(TP_SPLIT, 128))
    check_runnable(build(CP_SPLIT, coef=0.0))
