"""``testbed plan``'s search (``testbed.study.plan``) on a tiny model: its counts, pruning, ranking,
the published runs' matching and placing, and a killed plan resuming with no layout run twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import testbed.study.sweep as sweep_module
from testbed.core.errors import ScenarioError
from testbed.model.memory_estimate import ACTIVATIONS, WEIGHTS
from testbed.run.store import is_complete
from testbed.study.layout_space import enumerate_layouts, layout_scenario, plan_knobs
from testbed.study.plan import (
    PlanOptions,
    cluster_of,
    estimate,
    leaf_nodes,
    matching_published,
    plan_base,
    published_order,
    run_plan,
    same_as_folded,
    why_slower,
)

#: a Mixtral-family config.json of 4 layers of 4 experts (H 256, F 512), top-2
TINY = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 4, "num_local_experts": 4, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 1000, "sliding_window": None, "router_jitter_noise": 0.0}
#: 4 GPUs in 2 nodes of 2: TP 1 or 2, PP 1 or 2, EP 1, 2 or 4; folded (ETP 1) or nested (ETP = TP); bf16 or fp8
KNOBS: dict = {}


def tiny_base(tmp_path: Path, **kw):
    config = tmp_path / "cfg" / "tiny.json"
    config.parent.mkdir(exist_ok=True)
    config.write_text(json.dumps(TINY))
    return plan_base(str(config), 4, "h100", 8, 256, gpus_per_node=2, output_dir=tmp_path / "runs", **kw)


def opts(**kw) -> PlanOptions:
    return PlanOptions(knobs=dict(KNOBS), jobs=1, progress=False, published=False, **kw)


def complete_runs(tmp_path: Path) -> int:
    return sum(1 for d in (tmp_path / "runs").glob("sim-*") if is_complete(d))


def test_a_small_plan_counts_every_layout_and_ranks_the_fitting_ones(tmp_path):
    """Every combination is refused, a duplicate (a nested layout whose groups are its folded
    twin's), pruned, over memory when simulated, or ranked; the ranking descends in tokens/s per
    GPU; the bound is below every simulated peak."""
    r = run_plan(tiny_base(tmp_path), "tiny", opts())
    # tp, pp, ep, folded with ETP 1 or nested with ETP 1 or 2, and bf16 or fp8 GEMMs (the h100 has an fp8 ceiling)
    assert r["enumerated"] == 2 * 2 * 3 * 3 * 2
    assert r["enumerated"] == r["valid"] + r["same_as_folded"] + sum(r["refused"].values())
    assert r["valid"] == r["simulated"] + sum(r["pruned"].values())
    assert r["simulated"] == r["ranked"] + sum(r["not_fitting"].values()) == r["ran_now"] == complete_runs(tmp_path)
    tps = [e["tokens_per_s_per_gpu"] for e in r["ranking"]]
    assert tps == sorted(tps, reverse=True) and len(r["top"]) == min(10, r["ranked"])
    assert r["bound_above_peak"] == 0
    assert all(e["bound_bytes"] <= e["peak_memory_bytes"] for e in r["ranking"])


def test_the_memory_bound_prunes_with_its_reason(tmp_path):
    """--max-memory just above the smallest bound: the layouts that hold more all step pruned on
    weights+optimizer, those under it but over with their activations on activations, the rest
    simulated and ranked within the cap."""
    base = tiny_base(tmp_path)
    valid = enumerate_layouts(base, plan_knobs(base), derive=lambda p: cluster_of(2, p)).valid
    valid = [p for p in valid if not same_as_folded(p, valid, base.world_size)]
    bounds = [estimate(layout_scenario(base, p)) for p in valid]
    cap = min(b.total for b in bounds) + 1.0
    r = run_plan(base, "tiny", opts(max_memory_bytes=cap))
    assert r["pruned"].get(WEIGHTS, 0) == sum(b.held > cap for b in bounds) > 0
    assert r["pruned"].get(ACTIVATIONS, 0) == sum(b.held <= cap < b.total for b in bounds)
    assert r["simulated"] == sum(b.total <= cap for b in bounds) > 0
    assert all(e["peak_memory_bytes"] <= cap for e in r["ranking"])
    assert r["ranked"] + r["not_fitting"]["--max-memory"] + r["not_fitting"]["device memory"] == r["simulated"]


def test_a_killed_plan_resumes_and_runs_no_layout_twice(tmp_path, monkeypatch):
    """The third simulation raises (a kill); the plan again runs only the layouts with no complete
    run, and a third time none."""
    base = tiny_base(tmp_path)
    calls = {"n": 0}
    real = sweep_module._run_task

    def dies_third(scenario_dict, backend):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(scenario_dict, backend)

    monkeypatch.setattr(sweep_module, "_run_task", dies_third)
    with pytest.raises(KeyboardInterrupt):
        run_plan(base, "tiny", opts())
    assert complete_runs(tmp_path) == 2
    monkeypatch.setattr(sweep_module, "_run_task", real)
    again = run_plan(base, "tiny", opts())
    assert again["ran_now"] == again["simulated"] - 2
    assert complete_runs(tmp_path) == again["simulated"]
    assert run_plan(base, "tiny", opts())["ran_now"] == 0
    assert complete_runs(tmp_path) == again["simulated"]


def test_fixing_a_knob_and_a_bundle_key(tmp_path):
    r = run_plan(tiny_base(tmp_path), "tiny", opts(fixed={"parallelism.pp_size": 2, "pager.enabled": False}))
    assert {e["layout"]["parallelism.pp_size"] for e in r["ranking"]} == {2}
    with pytest.raises(ScenarioError, match=r"^--fix = 'pager.enabled=True': not a candidate"):
        run_plan(tiny_base(tmp_path), "tiny", opts(fixed={"pager.enabled": True}))


def test_the_leaves_follow_the_stages_as_the_published_scenarios_choose_them():
    """Mixtral on 128 H100 (16 nodes, PP 8): one leaf of 16; on 1,024 (PP 8): leaves of 32;
    MegaScale on 240, 480, 720, 960 and 1,440 H800 (PP 15): 30, 20, 30, 24 and 12 nodes a leaf."""
    assert leaf_nodes(16, 8) == 16 and leaf_nodes(128, 8) == 32
    assert [leaf_nodes(n, 15) for n in (30, 60, 90, 120, 180)] == [30, 20, 30, 24, 12]
    assert cluster_of(180, {"parallelism.pp_size": 15}) == {"cluster.nodes_per_microcluster": 12,
                                                              "cluster.microclusters": 15}


def test_the_published_runs_of_a_setup_are_found():
    base = plan_base("mixtral-8x22b", 128, "h100", 256, 4096)
    names = [n for n, _ in matching_published(base)]
    assert {"mixtral-8x22b-128-h100-tpep.toml", "mixtral-8x22b-128-h100-mcore.toml",
            "mixtral-8x22b-128-h100-folded.toml"} <= set(names)
    assert not any("gbs1024" in n or "-1024-" in n for n in names)


def test_the_published_order_and_why_a_run_misses():
    placed = [{"config": "a", "tokens_per_s_per_gpu": 100.0, "published": [{"unit": "mfu", "value": 0.3, "id": "A"}]},
              {"config": "b", "tokens_per_s_per_gpu": 120.0, "published": [{"unit": "mfu", "value": 0.4, "id": "B"}]},
              {"config": "c", "tokens_per_s_per_gpu": 110.0, "published": [{"unit": "mfu", "value": 0.5, "id": "C"}]}]
    (o,) = published_order(placed)
    assert o["published_order"] == ["a", "b", "c"] and o["plan_order"] == ["a", "c", "b"] and not o["agrees"]
    e = {"stage_time_s": {"experts": 2.0, "dispatch": 1.0}, "gap_to_best": 0.25, "bubble_fraction": 0.2,
         "layout": {"parallelism.pp_size": 8}}
    best = {"stage_time_s": {"experts": 1.9, "dispatch": 0.4}, "bubble_fraction": 0.05, "label": "pp_size=4",
            "layout": {"parallelism.pp_size": 4}}
    text = why_slower(e, best)
    assert "25.0% faster" in text and "published layout spends 0.600 s more a step in dispatch" in text
    assert "pp_size 8 -> 4" in text


def test_bad_input_names_the_option(tmp_path):
    with pytest.raises(ScenarioError, match=r"^MODEL = 'no-such-model': not a preset"):
        plan_base("no-such-model", 8, "h100")
    with pytest.raises(ScenarioError, match=r"^--gpus = 12: must be a multiple of the 8 GPUs"):
        plan_base("mixtral-8x7b", 12, "h100")
    with pytest.raises(ScenarioError, match=r"^--knob = 'parallelism.vpp'"):
        run_plan(tiny_base(tmp_path), "tiny", PlanOptions(knobs={"parallelism.vpp": [1]}, progress=False))


def test_virtual_chunks_need_pipeline_stages(tmp_path):
    """PP 1 or 2 x 1 or 2 chunks (4 layers: one a chunk at PP 2 x 2): Megatron-Core interleaves only
    over pipeline stages, so PP 1 with 2 chunks is refused on parallelism.pp_chunks."""
    base = tiny_base(tmp_path)
    knobs = {"parallelism.pp_size": [1, 2], "parallelism.pp_chunks": [1, 2], "parallelism.ep_size": [1]}
    space = enumerate_layouts(base, knobs, derive=lambda p: cluster_of(2, p))
    assert len(space.valid) == 3 and space.refused == {"parallelism.pp_chunks": 1}


def test_one_step_is_the_steady_step_where_nothing_pages(tmp_path):
    """The plan runs one step a layout (``STEPS``): without paging or a heat map the first step
    takes what the second does (routing's sampling aside, 1% at these 512 tokens a GPU), so a
    warm-up would change no ranking; a paged layout gets one (``steps_of``)."""
    from sim.backend import SimBackend
    from testbed.study.plan import PAGED_STEPS, STEPS, steps_of

    base = tiny_base(tmp_path)
    for point in ({"parallelism.tp_size": 2, "parallelism.pp_size": 1, "parallelism.ep_size": 2},
                  {"parallelism.tp_size": 1, "parallelism.pp_size": 2, "parallelism.ep_size": 2}):
        s = layout_scenario(base, {**point, "run.steps": 2, "run.warmup_steps": 0})
        first, second = (r.step_time_s for r in SimBackend().run(s).records)
        assert first == pytest.approx(second, rel=0.01)
    assert STEPS == {"run.steps": 1, "run.warmup_steps": 0}
    assert steps_of({"pager.enabled": True}) == PAGED_STEPS and steps_of({"pager.enabled": False}) == {}


def test_a_published_run_whose_knobs_alone_make_no_layout_is_still_placed(tmp_path, monkeypatch):
    """A published file with an uneven pipeline (a layout string): its knobs on the plan's base
    are refused (the layers do not split evenly), so it is placed as its file runs it, its
    layout named outside the space, with the reason."""
    import testbed.study.plan as plan_module
    from testbed.study.plan import place_published

    base = tiny_base(tmp_path)
    r = run_plan(base, "tiny", opts())
    uneven = layout_scenario(base, {"parallelism.pp_size": 2, "parallelism.tp_size": 1, "parallelism.ep_size": 2})
    uneven = uneven.replace(parallelism={"pipeline_layout": "Ettt|tL"}, model={"num_layers": 4})
    monkeypatch.setattr(plan_module, "matching_published", lambda b: [("uneven.toml", uneven)])
    # the layers split 3 | 1: with its knobs alone the plan's base takes pp 2 and an even split, which
    # it runs; a base of 3 layers could not, so refuse it there
    base3 = base.replace(model={"num_layers": 3})
    (p,) = place_published(base3, "tiny-published", r["ranking"], r["knob_keys"], opts(), r["shown_keys"])
    assert p["config"] == "uneven.toml" and p["rank"] >= 1 and "outside_space_because" in p
    assert "model.num_layers" in p["outside_space_because"]


def test_the_base_takes_a_layout_its_global_batch_derives_for():
    """720 sequences on 480 GPUs: TP 1 x PP 1 leaves DP 480, which does not divide them; the
    base takes TP 2 (DP 240, 3 micro-batches), which every layout then replaces."""
    base = plan_base("megascale-352b", 480, "h800", 720, 8192)
    assert (base.parallelism.tp_size, base.parallelism.pp_size) == (2, 1)
    assert base.workload.global_batch == 720
    with pytest.raises(ScenarioError, match="--gpus"):
        plan_base("megascale-352b", 484, "h800", 720, 8192)
