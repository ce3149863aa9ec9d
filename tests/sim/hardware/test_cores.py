"""CPU cores shared by CPU ranks (sim.hardware.cores): processor sharing per core, ranks pinned to
core rank % cores, and what it does to a step's compute."""

import pytest
import simpy

from sim.hardware.cores import CorePool


def finish_times(jobs, cores):
    """{rank: finish time} of jobs (rank, start s, core-seconds) on a fresh pool."""
    env = simpy.Environment()
    pool = CorePool(env, cores)
    out = {}

    def job(rank, start, seconds):
        yield env.timeout(start)
        yield pool.run(rank, seconds)
        out[rank] = env.now

    for j in jobs:
        env.process(job(*j))
    env.run()
    return out


def test_a_rank_alone_on_its_core_takes_its_own_time():
    assert finish_times([(0, 0.0, 2.0), (1, 0.0, 3.0)], cores=2) == {0: 2.0, 1: 3.0}


def test_ranks_on_one_core_share_it_equally():
    # ranks 0 and 2 on core 0: each gets half until the shorter ends at 2 s (1 core-s each),
    # then rank 2 finishes its last 1 core-s alone
    got = finish_times([(0, 0.0, 1.0), (2, 0.0, 2.0)], cores=2)
    assert got[0] == pytest.approx(2.0) and got[2] == pytest.approx(3.0)


def test_a_rank_that_starts_later_slows_the_other_only_while_both_compute():
    got = finish_times([(0, 0.0, 2.0), (2, 1.0, 0.5)], cores=2)
    # rank 0 alone 1 s (1 left), then both at half speed: rank 2 done at 2.0, rank 0 at 2.5
    assert got[2] == pytest.approx(2.0) and got[0] == pytest.approx(2.5)


def test_eight_ranks_on_two_cores_computing_at_once_take_four_times_as_long():
    got = finish_times([(r, 0.0, 1.0) for r in range(8)], cores=2)
    assert all(t == pytest.approx(4.0) for t in got.values())


def test_nothing_to_compute_is_done_at_once_and_a_pool_needs_a_core():
    assert finish_times([(0, 1.0, 0.0)], cores=1) == {0: 1.0}
    with pytest.raises(ValueError):
        CorePool(simpy.Environment(), 0)


def test_a_cpu_profile_shares_its_cores_between_the_ranks_of_a_step(tmp_path):
    """Experts of 8 ranks on 2 cores: slower than alone (they compute together), but no
    slower than 4x alone (ranks that wait for the network leave their core to others);
    the analytic model, which cannot share, scales compute by ranks per core."""
    import dataclasses

    from testbed.run.runner import run_scenario
    from testbed.scenario.profile import load_profile, save_profile
    from testbed.scenario.scenario import Scenario

    base = load_profile("emulated")
    alone = save_profile(base, tmp_path / "alone.toml")
    shared = save_profile(dataclasses.replace(base, compute=dataclasses.replace(base.compute, host_cores=2.0)),
                          tmp_path / "shared.toml")

    def experts(profile, model="flow"):
        s = Scenario.from_dict({
            "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 2, "microclusters": 2, "profile": str(profile)},
            "parallelism": {"ep_size": 4}, "sim": {"network_model": model},
            "run": {"steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path / "runs")}})
        return run_scenario(s, "sim")["stage_time_s"]["experts"]

    a, b = experts(alone), experts(shared)
    assert a < b <= 4 * a * (1 + 1e-9)
    assert experts(shared, "analytic") == pytest.approx(4 * experts(alone, "analytic"), rel=1e-9)
