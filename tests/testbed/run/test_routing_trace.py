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
