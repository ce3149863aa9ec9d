"""deepep's ops (testbed.policy.deepep, through the planner): a token crosses to each
destination node once, to its rail peer, which forwards it over NVLink; counted by hand
on a 2-node x 2-GPU cluster, and against the flat all-to-all's bytes."""

import numpy as np
import pytest

from testbed.core.errors import ScenarioError
from testbed.policy import deepep
from testbed.policy.collectives import ByteLedger
from testbed.policy.planner import Planner
from testbed.scenario.scenario import Scenario
from testbed.scenario.topology import LEAF, NVLINK, SPINE

H, T, K = 8, 4, 2  # fp32 tokens of 32 bytes; 4 tokens per rank, top-2
TOKEN, META = H * 4, K * 4  # bytes of a token row, of its K indices (or K probabilities)


def scenario(strategy="deepep", microclusters=1, nodes=2, payload="model", **cluster):
    return Scenario.from_dict({
        "model": {"hidden_size": H, "ffn_hidden_size": 16, "num_experts": 4, "top_k": K},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": nodes, "microclusters": microclusters, **cluster},
        "parallelism": {"ep_size": 4},
        "comm": {"token_strategy": strategy, "payload_dtype": payload},
        "workload": {"tokens_per_rank": T},
    })


#: each rank's tokens' experts (expert e lives on rank e); ranks 1 and 3 route nothing
CHOICES = {0: [[2, 3], [0, 2], [1, 3], [2, 3]], 2: [[0, 1], [1, 2], [2, 3], [0, 3]]}


def routing(planner):
    """(kept [W, E], fanout [W, P + A]) of ``CHOICES``."""
    lay = planner.layout
    kept = np.zeros((4, 4), dtype=np.int64)
    fanout = np.zeros((4, 6), dtype=np.int64)
    node_of = deepep.node_of_member(lay, planner.grids[0])
    for rank, experts in CHOICES.items():
        experts = np.array(experts)
        np.add.at(kept[rank], experts.ravel(), 1)
        fanout[rank] = deepep.fanout_of_tokens(experts, np.ones_like(experts, bool), lay.experts_per_rank, node_of)
    return kept, fanout


def stage_bytes(planner, stage, kept, fanout=None):
    """{op label: int64 [nvlink, leaf, spine]} of one stage's ops."""
    planner.tell_fanout(0, fanout)
    ledger = ByteLedger(planner.layout)
    out = {}
    for op in planner.token_ops(stage, 0, kept):
        out[op.label] = out.get(op.label, 0) + ledger.op_bytes(op)[1]
    return out


def test_the_fanout_counts_tokens_not_slots():
    p = Planner(scenario())
    kept, fanout = routing(p)
    # rank 0: member 0 gets t1, member 1 t2, member 2 t0 t1 t3, member 3 t0 t2 t3; node 0 t1 t2, node 1 all four
    assert fanout[0].tolist() == [1, 1, 3, 3, 2, 4]
    assert fanout[2].tolist() == [2, 2, 2, 2, 3, 3]
    assert kept[0].tolist() == [1, 1, 3, 3]  # slots: 8 of them, on 6 (token, node) pairs


def test_dispatch_rows_on_a_two_by_two_cluster_counted_by_hand():
    """Grid [[0, 1], [2, 3]] (a node a row, one leaf). The hop along column 0: rank 0
    sends its 4 tokens for node 1 to rank 2, rank 2 its 3 for node 0 to rank 0 (7 rows
    over the leaf). The forward: rank 0 passes member 1 the tokens of column 0 bound
    there (1 of rank 0's, 2 of rank 2's), rank 2 passes member 3 3 + 2 (8 rows over
    NVLink). Every row carries the token, K indices and K probabilities."""
    p = Planner(scenario())
    kept, fanout = routing(p)
    got = stage_bytes(p, "dispatch", kept, fanout)
    leaf_rows, nvlink_rows = 7, 8
    assert got["tokens inter-node"].tolist() == [0, leaf_rows * TOKEN, 0]
    assert got["tokens intra-node"].tolist() == [nvlink_rows * TOKEN, 0, 0]
    for label in ("expert indices", "probabilities"):
        assert got[f"{label} inter-node"].tolist() == [0, leaf_rows * META, 0]
        assert got[f"{label} intra-node"].tolist() == [nvlink_rows * META, 0, 0]
    # the fanout all-gather first (DeepEP's notify): P + A int32 a member, a ring of 4 over 2 NVLink and 2 leaf hops
    ring = 4 * 3 * (4 + 2) * 4
    assert got["token fanout (deepep)"].tolist() == [ring // 2, ring // 2, 0]
    # the combine and the backward carry the same rows back (or forward again)
    assert stage_bytes(p, "combine", kept, fanout)["partial sums inter-node"].tolist() == [0, leaf_rows * TOKEN, 0]
    assert stage_bytes(p, "combine_backward", kept, fanout)["output gradients intra-node"].tolist() == \
        [nvlink_rows * TOKEN, 0, 0]
    back = stage_bytes(p, "dispatch_backward", kept, fanout)
    assert back["token gradients inter-node"].tolist() == [0, leaf_rows * TOKEN, 0]
    assert back["probability gradients intra-node"].tolist() == [nvlink_rows * META, 0, 0]


def test_the_hops_matrices_by_hand():
    p = Planner(scenario())
    kept, fanout = routing(p)
    inter, intra = deepep.hop_matrices(fanout, p.grid_positions[0])
    assert inter[0].tolist() == [[2, 4], [3, 3]]  # column 0: rank 0 <-> rank 2 (diagonal: own node)
    assert not inter[1].any()  # ranks 1 and 3 route nothing
    assert intra[0].tolist() == [[3, 3], [0, 0]]  # node 0: forwarder 0 keeps 3, passes 3 to rank 1
    assert intra[1].tolist() == [[5, 5], [0, 0]]  # node 1: forwarder 2 keeps 5, passes 5 to rank 3


def test_fp8_dispatches_tokens_in_one_byte_and_combines_at_the_model_dtype():
    p = Planner(scenario(payload="fp8"))
    kept, fanout = routing(p)
    assert stage_bytes(p, "dispatch", kept, fanout)["tokens inter-node"][LEAF] == 7 * H
    assert stage_bytes(p, "combine_backward", kept, fanout)["output gradients inter-node"][LEAF] == 7 * H
    assert stage_bytes(p, "combine", kept, fanout)["partial sums inter-node"][LEAF] == 7 * TOKEN
    assert stage_bytes(p, "dispatch_backward", kept, fanout)["token gradients inter-node"][LEAF] == 7 * TOKEN


def test_the_network_carries_a_token_once_per_node_where_the_flat_all_to_all_carries_each_slot():
    """Every token of every rank picks both experts of the other node (one on each GPU):
    the flat all-to-all sends each of the 2 slots across, deepep the token once, so its
    combine (no routing metadata) puts half the flat all-to-all's bytes on the leaf."""
    flat, dee = Planner(scenario("alltoall")), Planner(scenario())
    kept = np.zeros((4, 4), dtype=np.int64)
    kept[:2, 2:] = T  # ranks 0, 1 (node 0): every token to experts 2 and 3 (node 1), and back
    kept[2:, :2] = T
    both = np.array([[T, T, T, T, 0, T]] * 2 + [[T, T, T, T, T, 0]] * 2)  # to members 0-3, to nodes 0, 1
    both[np.arange(4)[:, None], [[0, 1], [0, 1], [2, 3], [2, 3]]] = 0  # no token for its own node's members
    dee.tell_fanout(0, both)
    ledger = ByteLedger(flat.layout)

    def leaf(planner, stage):
        return sum(ledger.op_bytes(op)[1][LEAF] for op in planner.token_ops(stage, 0, kept))
    assert leaf(flat, "combine") == 4 * T * 2 * TOKEN
    assert leaf(dee, "combine") * 2 == leaf(flat, "combine")
    # the dispatch adds the indices and probabilities of each token
    assert leaf(dee, "dispatch") == 4 * T * (TOKEN + 2 * META) + (4 * 3 * 6 * 4) // 2


def test_on_a_random_routing_the_network_rows_are_the_distinct_token_node_pairs():
    """Brute force: 4 nodes x 2 GPUs, 16 experts, top-4: the dispatch's inter-node rows
    are the (token, other node) pairs with a kept slot, its NVLink rows the (token,
    member) pairs whose member is not the forwarder; less than the flat all-to-all's
    slots across nodes."""
    s = Scenario.from_dict({
        "model": {"hidden_size": H, "num_experts": 16, "top_k": 4},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 4, "microclusters": 1},
        "parallelism": {"ep_size": 8}, "comm": {"token_strategy": "deepep"}, "workload": {"tokens_per_rank": 32}})
    p = Planner(s)
    lay = p.layout
    rng = np.random.default_rng(7)
    experts = np.stack([np.stack([rng.choice(16, 4, replace=False) for _ in range(32)]) for _ in range(8)])
    keep = rng.random(experts.shape) < 0.9
    node_of = deepep.node_of_member(lay, p.grids[0])
    fanout = np.stack([deepep.fanout_of_tokens(experts[r], keep[r], 2, node_of) for r in range(8)])
    kept = np.zeros((8, 16), dtype=np.int64)
    for r in range(8):
        np.add.at(kept[r], experts[r][keep[r]], 1)
    inter_rows = nvlink_rows = cross_slots = 0
    for r in range(8):
        for t in range(32):
            members = {int(e) // 2 for e, k in zip(experts[r, t], keep[r, t]) if k}
            nodes = {m // 2 for m in members}
            inter_rows += len(nodes - {r // 2})
            # the forwarder on node a is the member of a with r's local index; it keeps its own rows
            nvlink_rows += sum(1 for m in members if m != (m // 2) * 2 + r % 2)
            cross_slots += sum(1 for e, k in zip(experts[r, t], keep[r, t]) if k and int(e) // 4 != r // 2)
    p.tell_fanout(0, fanout)
    ledger = ByteLedger(lay)
    got = np.zeros(3, dtype=np.int64)
    for op in p.token_ops("combine", 0, kept):
        got += ledger.op_bytes(op)[1]
    assert got[LEAF] + got[SPINE] == inter_rows * TOKEN
    assert got[NVLINK] == nvlink_rows * TOKEN
    flat = Planner(s.replace(comm={"token_strategy": "alltoall"}))
    flat_net = sum(ledger.op_bytes(op)[1][LEAF] for op in flat.token_ops("combine", 0, kept))
    assert flat_net == cross_slots * TOKEN > got[LEAF]


def test_the_modelled_fanout_is_the_chance_a_token_hits_a_member_or_node():
    """Without tokens (synthetic routing), kept counts c_e over T tokens hit a set S of
    experts on T (1 - prod_S (1 - c_e / T)) tokens, rounded."""
    p = Planner(scenario())
    kept = np.zeros((4, 4), dtype=np.int64)
    kept[0] = [1, 2, 3, 4]  # T = 4: expert 3 takes every token
    fan = p.fanout(0, kept)  # nothing told: modelled
    assert fan[0, :4].tolist() == [1, 2, 3, 4]  # one expert a member: its count
    assert fan[0, 4] == round(T * (1 - (1 - 1 / T) * (1 - 2 / T)))  # node 0: experts 0 and 1
    assert fan[0, 5] == T
    assert not fan[1:].any()


def test_deepep_needs_the_same_members_on_every_node():
    data = {"model": {"num_experts": 6}, "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 3, "microclusters": 1},
            "parallelism": {"ep_size": 3}, "comm": {"token_strategy": "deepep"}}
    with pytest.raises(ScenarioError) as e:  # refused when the scenario is built, before any planner or rank
        Scenario.from_dict(data)
    assert e.value.field == "comm.token_strategy" and e.value.value == "deepep" and "every node" in e.value.reason


def test_only_the_token_rows_forwarded_after_a_hop_carry_the_kernels_sms():
    """Across nodes the forward of each stage's first message (its token rows) carries
    comm.deepep_sms (the kernels that bound it: sim.network.deepep_forward); the hop, the
    indices and probabilities, and the intranode kernels (one node: no hop) carry none."""
    p = Planner(scenario())
    kept, fanout = routing(p)
    p.tell_fanout(0, fanout)
    for stage, first in (("dispatch", "tokens"), ("combine", "partial sums"), ("combine_backward", "output gradients"),
                         ("dispatch_backward", "token gradients")):
        ops = p.token_ops(stage, 0, kept)
        carried = {op.label for op in ops if op.forward_sms}
        assert carried == {f"{first} intra-node"}, stage
        assert {op.forward_sms for op in ops if op.forward_sms} == {p.s.comm.deepep_sms}
    one_node = Scenario.from_dict({
        "model": {"hidden_size": H, "ffn_hidden_size": 16, "num_experts": 4, "top_k": K},
        "cluster": {"gpus_per_node": 4, "nodes_per_microcluster": 1, "microclusters": 1},
        "parallelism": {"ep_size": 4}, "comm": {"token_strategy": "deepep"}, "workload": {"tokens_per_rank": T}})
    q = Planner(one_node)
    assert not any(op.forward_sms for op in q.token_ops("dispatch", 0, kept))
