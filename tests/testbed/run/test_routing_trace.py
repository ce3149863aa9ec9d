"""The routing trace file: compact counts (smallest unsigned dtype, fast deflate), read
back as int32, and traces written the old way (int32, np.savez_compressed) still read."""

import io
import json
import zipfile

import numpy as np
import pytest

from testbed.run.routing_trace import FILE, RoutingTrace, compact_counts


def stored_dtype(run_dir):
    with np.load(run_dir / FILE) as data:
        return data["routed"].dtype


@pytest.mark.parametrize("top, dtype", [(255, np.uint8), (256, np.uint16), (70000, np.uint32)])
def test_counts_are_stored_in_the_smallest_unsigned_dtype_and_read_back_as_int32(tmp_path, top, dtype):
    routed = np.random.default_rng(0).integers(0, top, size=(2, 3, 4, 8))
    routed[0, 0, 0, 0] = top
    RoutingTrace(routed, 64, 2).save(tmp_path)
    assert stored_dtype(tmp_path) == dtype
    t = RoutingTrace.load(tmp_path)
    assert t.routed.dtype == np.int32 and np.array_equal(t.routed, routed)
    with zipfile.ZipFile(tmp_path / FILE) as z:
        assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist())


def test_a_trace_written_the_old_way_still_reads(tmp_path):
    routed = np.arange(2 * 2 * 4 * 8, dtype=np.int32).reshape(2, 2, 4, 8)
    meta = {"tokens_per_rank": 32, "top_k": 2, "shape": ["steps", "layers", "ranks", "experts"]}
    buf = io.BytesIO()
    np.savez_compressed(buf, routed=routed, meta=json.dumps(meta))
    (tmp_path / FILE).write_bytes(buf.getvalue())
    t = RoutingTrace.load(tmp_path)
    assert np.array_equal(t.routed, routed) and (t.tokens_per_rank, t.top_k) == (32, 2)


def test_negative_counts_are_refused():
    with pytest.raises(ValueError):
        compact_counts(np.array([1, -1]))


def test_each_micro_batchs_counts_are_kept_beside_their_sum(tmp_path):
    """A pipelined run's [steps, m, layers, ranks, experts]: stored as micro_routed, with routed
    their sum over the micro-batches; both read back as int32."""
    micro = np.random.default_rng(1).integers(0, 40, size=(2, 4, 3, 2, 8))
    t = RoutingTrace(micro, 64, 2)
    assert t.micro_batches == 4 and np.array_equal(t.routed, micro.sum(axis=1))
    t.save(tmp_path)
    back = RoutingTrace.load(tmp_path)
    assert back.micro_routed.dtype == np.int32 and np.array_equal(back.micro_routed, micro)
    assert np.array_equal(back.routed, micro.sum(axis=1)) and back.micro_batches == 4


def test_one_micro_batch_writes_the_same_file_as_the_steps_counts(tmp_path):
    """A run of one micro-batch keeps no micro_routed: its trace holds, member for member and byte
    for byte, the arrays of its [steps, layers, ranks, experts] counts, as written before
    micro-batches were kept (routed and meta only)."""
    routed = np.random.default_rng(2).integers(0, 40, size=(2, 3, 2, 8))
    for name, counts in (("a", routed), ("b", routed[:, None])):
        (tmp_path / name).mkdir()
        RoutingTrace(counts, 64, 2).save(tmp_path / name)
    members = []
    for name in ("a", "b"):
        with zipfile.ZipFile(tmp_path / name / FILE) as z:
            members.append({i.filename: z.read(i) for i in z.infolist()})
    assert members[0] == members[1] and set(members[0]) == {"routed.npy", "meta.npy"}
    assert RoutingTrace.load(tmp_path / "b").micro_routed is None


def test_micro_counts_that_do_not_match_the_steps_are_refused(tmp_path):
    """A file whose micro_routed does not have routed's steps, layers, ranks and experts is a
    ScenarioError naming both shapes."""
    from testbed.core.errors import ScenarioError

    routed = np.ones((2, 3, 2, 8), dtype=np.int32)
    meta = {"tokens_per_rank": 32, "top_k": 2, "shape": ["steps", "layers", "ranks", "experts"]}
    buf = io.BytesIO()
    np.savez_compressed(buf, routed=routed, micro_routed=np.ones((2, 4, 3, 1, 8), dtype=np.int32),
                        meta=json.dumps(meta))
    (tmp_path / FILE).write_bytes(buf.getvalue())
    with pytest.raises(ScenarioError, match=r"micro_routed \[2, 4, 3, 1, 8\].*routed \[2, 3, 2, 8\]"):
        RoutingTrace.load(tmp_path)
