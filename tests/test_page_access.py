"""C9's page-access model (testbed.policy.page_access): a dense FFN expert reads every page in
every forward, which real ranks' page-read counts show; and how skewed page accesses
would have to be for the first 3 pages to cover 87% of them."""

import pytest

from real.backend import RealBackend
from testbed.policy.page_access import dense_shares, first_pages_cover, zipf_exponent_for, zipf_shares
from testbed.scenario.scenario import Scenario


def test_a_dense_expert_spreads_its_accesses_over_its_pages_by_size():
    shares = dense_shares(10 * 2**20, 4 * 2**20)  # pages of 4, 4 and 2 MiB
    assert shares.tolist() == pytest.approx([0.4, 0.4, 0.2])
    assert first_pages_cover(dense_shares(23 * 2**20, 2**20)) == pytest.approx(3 / 23)
    assert first_pages_cover(dense_shares(23 * 2**20, 16 * 2**20)) == pytest.approx(1.0)


def test_the_zipf_exponent_that_makes_the_first_3_of_23_pages_cover_87_percent():
    s = zipf_exponent_for(23, 0.87)
    assert first_pages_cover(zipf_shares(23, s)) == pytest.approx(0.87, abs=1e-9)
    assert s == pytest.approx(2.10, abs=0.01)  # far from the uniform (s = 0) reads of a dense FFN
    assert zipf_exponent_for(3, 0.87) is None and zipf_exponent_for(23, 0.1) is None


@pytest.mark.slow
def test_real_ranks_read_every_page_of_an_expert_equally_often(tmp_path):
    """Pages of 1 KiB, experts of 12 KiB (12 pages): whatever the routing, each expert's
    pages are read the same number of times, so the first 3 take 3 / 12 of its reads."""
    s = Scenario.from_dict({
        "model": {"hidden_size": 32, "ffn_hidden_size": 48, "num_experts": 4, "num_layers": 2},
        "cluster": {"gpus_per_node": 2, "nodes_per_microcluster": 1, "microclusters": 1},
        "parallelism": {"ep_size": 2},
        "pager": {"page_size_bytes": 1024, "gpu_budget_bytes": 40960},
        "workload": {"tokens_per_rank": 64, "skew": 1.5},
        "run": {"steps": 3, "warmup_steps": 1, "output_dir": str(tmp_path)},
    })
    result = RealBackend().run(s, debug={"capture": True})
    pages = -(-s.model.expert_bytes // 1024)
    assert pages == 12
    for cap in result.captured:
        reads = cap["page_reads"].reshape(-1, pages)
        assert (reads > 0).any()
        assert (reads == reads[:, :1]).all()  # every page of an expert as often as its first
        used = reads[:, 0] > 0
        cover = reads[used, :3].sum() / reads[used].sum()
        assert cover == pytest.approx(first_pages_cover(dense_shares(s.model.expert_bytes, 1024)))
