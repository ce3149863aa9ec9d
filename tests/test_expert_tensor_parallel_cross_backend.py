"""Expert tensor parallelism and the nested MoE layout on both backends (issue 25, item 3;
``parallelism.etp_size``, ``parallelism.moe_layout``): real CPU ranks count the same bytes
per stage and per link level as the simulator's replay of their routing, the ETP group's
all-gathers and reduce-scatters around the EP all-to-all (``real.comm.expert_tensor_parallel``,
as ``testbed.policy.expert_tensor_parallel.etp_token_ops`` plans them) among them.

The layouts, 2 CPU ranks a node: the MoE stack with folded ETP 2 x EP 2 on 4 ranks, the
hierarchical exchange (each EP group one member a node) and FP8 payloads; the whole
transformer with nested TP 2 x EP 2 on 8 ranks (ETP = TP, expert DP 2), and nested CP 2 x
EP 2 on 4 ranks (ETP 1: EP members CP apart, groups (0, 2) and (1, 3)).

By hand, on the MoE stack (dropless, so every rank's T K slots are received somewhere and
each rank's received rows are all-gathered to its ETP - 1 peers): with FP8 payloads the
gathered rows are H bytes each, the partial sums H x 4 (fp32, the model's dtype), and the
all-to-all's rows H bytes either way, so a step's combine (reduce-scatter + all-to-all) less
its dispatch (all-to-all + all-gather) is ``L W T K (ETP - 1) H (4 - 1)`` bytes; the route's
counts are gathered over the TP x EP group of ETP EP = 4 ranks: ``L W (ETP EP - 1) 4 E``.
"""

import pytest

from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

SEQ, H, E, L, T, K = 32, 32, 4, 2, 16, 2


def scenario(tmp_path, nodes: int, parallelism: dict, transformer: bool, comm: dict) -> Scenario:
    data = {
        "model": {"hidden_size": H, "ffn_hidden_size": 48, "num_experts": E, "num_layers": L, "top_k": K,
                  "ffn_activation": "swiglu"},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": nodes, "microclusters": 1},
        "parallelism": parallelism,
        "router": {"capacity_factor": 0.0},
        "pager": {"enabled": False},
        "heat": {"enabled": False},
        "comm": {"expert_sync": "allreduce", **comm},
        "workload": {"tokens_per_rank": T},
        "run": {"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path)},
    }
    if transformer:
        data["transformer"] = {"enabled": True, "num_heads": 4, "num_kv_heads": 2, "seq_len": SEQ,
                               "vocab_size": 128, "moe_every": 2, "optimizer": "sgd"}
    return Scenario.from_dict(data)


CASES = {
    "moe-stack folded etp 2 hierarchical fp8": (2, {"ep_size": 2, "etp_size": 2}, False,
                                                {"token_strategy": "hierarchical", "payload_dtype": "fp8"}),
    "nested tp 2 ep 2": (4, {"tp_size": 2, "ep_size": 2, "etp_size": 2, "moe_layout": "nested",
                             "sequence_parallel": True}, True, {}),
    "nested cp 2 ep 2": (2, {"cp_size": 2, "ep_size": 2, "moe_layout": "nested"}, True, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_real_expert_tp_and_its_replay_move_the_same_bytes(tmp_path, name):
    nodes, parallelism, transformer, comm = CASES[name]
    s = scenario(tmp_path, nodes, parallelism, transformer, comm)
    real = run_scenario(s, "real")
    replay = run_scenario(s.replace(workload={"trace": real["run_dir"]}), "sim")
    assert real["bytes_by_stage"] == replay["bytes_by_stage"]
    assert real["bytes_by_level"] == replay["bytes_by_level"]
    assert real["bytes_by_stage"]["dispatch"] > 0 and real["bytes_by_stage"]["route"] > 0
    if not transformer:  # by hand (module doc)
        world, etp, ep = s.world_size, s.parallelism.etp_size, s.parallelism.ep_size
        by_stage = real["bytes_by_stage"]
        assert by_stage["combine"] - by_stage["dispatch"] == L * world * T * K * (etp - 1) * H * (4 - 1)
        assert by_stage["combine_backward"] - by_stage["dispatch_backward"] == -L * world * T * K * (etp - 1) * H * 3
        assert by_stage["route"] == L * world * (etp * ep - 1) * 4 * E
