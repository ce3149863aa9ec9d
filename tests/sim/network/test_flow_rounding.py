"""A flow due at the instant its component is re-shared can be left a rounding error below
0 bytes (``Network._advance``): it is done, and the next finish is the others'. A 64-GPU
gpt-oss-120b layout whose TP collectives overlap the GEMMs (``overlap.tp_comm``) left 32
such flows and stopped the flow model with an empty reduction; it now runs."""

from testbed.run.runner import run_scenario
from testbed.study.layout_space import layout_scenario
from testbed.study.plan import cluster_of, plan_base


def test_flows_a_rounding_error_past_their_end_finish(tmp_path):
    base = plan_base("gpt-oss-120b", 64, "h100", 512, 4096, output_dir=tmp_path)
    point = {"parallelism.tp_size": 4, "parallelism.pp_size": 1, "parallelism.ep_size": 32,
             "parallelism.moe_layout": "folded", "parallelism.etp_size": 1, "overlap.tp_comm": True}
    s = layout_scenario(base, {**point, **cluster_of(8, point)})
    assert s.sim.network_model == "auto" and s.world_size <= s.sim.flow_max_gpus  # the flow model runs it
    out = run_scenario(s, "sim")
    assert 0 < out["step_time_s"] < 60
