"""Hierarchical checkpoints (M23): a run killed and resumed from its latest complete
checkpoint continues bit-identically to one that was never stopped - losses, bytes,
page moves, group-cache hits and the final weights - and a resumed run folder continues
its steps.jsonl and routing trace."""

import json
import shutil

import pytest
import torch

from real.backend import RealBackend
from real.rank.checkpoint import _NAME
from testbed.core.errors import RunError, ScenarioError
from testbed.run.runner import run_scenario
from testbed.scenario.scenario import Scenario

SAME = ("loss", "aux_loss", "bytes_by_stage", "bytes_by_level", "page_moves", "page_bytes", "routed_slots",
        "dropped_slots", "cache_hits", "cache_lookups", "expert_states")


def scenario(tmp_path, **run):
    # 4 ranks, EP 2 x 2 replicas, two-stage sync (cached groups to recreate), a tight page
    # budget and heat updates every 2 steps (evictions, cold migration, stale replicas)
    return Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 64},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": "4KiB", "gpu_budget_bytes": "40KiB", "cold_consecutive_updates": 1},
        "heat": {"update_interval": 2, "window_steps": 2},
        "comm": {"expert_sync": "two_stage", "group_cache_size": 3},
        "workload": {"tokens_per_rank": 64},
        "checkpoint": {"enabled": True, "optimizer_interval": 2, "expert_interval": 4},
        "run": {"steps": 8, "warmup_steps": 1, "output_dir": str(tmp_path / "runs"), **run},
        "real": {"check_weights": True},
    })


def same_records(a, b):
    for ra, rb in zip(a, b, strict=True):
        assert ra.step == rb.step
        for name in SAME:
            assert getattr(ra, name) == getattr(rb, name), (ra.step, name)


def same_final_weights(a, b):
    for ca, cb in zip(a.captured, b.captured, strict=True):
        assert ca["final_experts"].keys() == cb["final_experts"].keys()
        for inst, w in ca["final_experts"].items():
            assert torch.equal(w, cb["final_experts"][inst]), inst
        for (wa, ba), (wb, bb) in zip(ca["final_router"], cb["final_router"], strict=True):
            assert torch.equal(wa, wb) and torch.equal(ba, bb)


@pytest.mark.slow
@pytest.mark.parametrize("deferred", [False, True])
def test_killed_run_resumes_bit_identically(tmp_path, deferred):
    """With heat.deferred (M18) every checkpoint (after steps 2, 4, 6: heat updates are due
    after steps 1, 3, 5) holds an update the next step applies at its first layer."""
    s = scenario(tmp_path).replace(heat={"deferred": deferred})
    straight = RealBackend().run(s, run_dir=tmp_path / "straight", debug={"capture": True})
    with pytest.raises(RunError, match="rank 1 died"):
        RealBackend().run(s, run_dir=tmp_path / "killed", debug={"fail_at": {"rank": 1, "after_steps": 7}})
    resumed = RealBackend().run(s, run_dir=tmp_path / "killed", resume=True, debug={"capture": True})
    first = resumed.extra["resumed_from"]
    # the optimizer checkpoint after 6 steps (a full expert snapshot at 4 + pages changed
    # since), or the one at 4 if rank 1 died before the writer thread got to it
    assert first in (4, 6)
    same_records(straight.records[first:], resumed.records)
    same_final_weights(straight, resumed)
    names = [p.name for p in (tmp_path / "killed" / "checkpoints" / "rank0").iterdir()]
    assert all(_NAME.match(n) for n in names), names  # no half-written files left
    assert "experts-00000004.pt" in names and "optimizer-00000008-from-00000006.pt" in names


@pytest.mark.slow
def test_resumed_run_folder_continues_its_steps_and_routing(tmp_path):
    s = scenario(tmp_path)
    done = run_scenario(s, "real")
    run_dir = tmp_path / "runs" / done["run_dir"].split("/")[-1]
    steps = (run_dir / "steps.jsonl").read_text().splitlines()
    # stop it after 3 steps, as a kill would: the checkpoint at 2 (the initial weights plus
    # the pages changed since) is the newest complete one, the record of step 2 was written
    stopped = tmp_path / "stopped"
    shutil.copytree(run_dir, stopped)
    for ckpt in (stopped / "checkpoints").glob("rank*/*.pt"):
        if int(_NAME.match(ckpt.name).group(2)) > 2:
            ckpt.unlink()
    (stopped / "steps.jsonl").write_text("\n".join(steps[:3]) + "\n")
    (stopped / "routing.npz").unlink()
    with pytest.raises(ScenarioError, match="model.hidden_size = 32, this scenario 64"):
        run_scenario(s.replace(model={"hidden_size": 64}), "real", resume=stopped)
    summary = run_scenario(s, "real", resume=stopped)
    assert summary["resumed_from"] == 2 and summary["steps"] == 8
    assert json.loads((stopped / "summary.json").read_text())["complete"] is True
    again = (stopped / "steps.jsonl").read_text().splitlines()
    assert len(again) == 8
    for old, new in zip(steps, again):
        old, new = json.loads(old), json.loads(new)
        for name in SAME:
            assert old[name] == new[name], (old["step"], name)
    assert summary["loss_last"] == done["loss_last"] and summary["bytes_by_stage"] == done["bytes_by_stage"]
    replay = run_scenario(s.replace(workload={"trace": str(stopped)}, checkpoint={"enabled": False}), "sim")
    assert replay["bytes_by_stage"] == summary["bytes_by_stage"]  # the routing trace covers all 8 steps
