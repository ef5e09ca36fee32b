from __future__ import annotations

import numpy as np
import pytest

from mpidist.core.buffers import (
    FlatBuffer,
    TensorSpec,
    make_buckets,
    padded_length,
    row_range,
    shard_range,
    shard_size,
)


def make(pad_to=1, dtype=np.float64):
    return FlatBuffer([("a", (3, 4)), ("b", (5,)), ("c", (2, 2, 2))], dtype, pad_to=pad_to)


def test_views_share_storage():
    buf = make()
    assert buf.numel == 12 + 5 + 8
    buf["b"][:] = 7
    assert np.all(buf.data[12:17] == 7)
    buf.data[:12] = np.arange(12)
    np.testing.assert_array_equal(buf["a"], np.arange(12).reshape(3, 4))
    assert np.shares_memory(buf.view("c"), buf.data)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_padding_and_shards(n):
    buf = make(pad_to=n, dtype=np.float32)
    assert buf.data.shape[0] == padded_length(25, n)
    assert buf.data.shape[0] % n == 0
    pieces = [buf.shard(r, n) for r in range(n)]
    assert all(p.shape[0] == shard_size(25, n) for p in pieces)
    assert np.shares_memory(pieces[-1], buf.data)
    assert sum(p.shape[0] for p in pieces) == buf.data.shape[0]
    assert shard_range(25, n - 1, n)[1] == buf.data.shape[0]


def test_shard_requires_padding():
    buf = make(pad_to=1)
    with pytest.raises(ValueError, match="pad_to=3"):
        buf.shard(0, 3)


@pytest.mark.parametrize("bucket_bytes", [8, 40, 100, 1000, 10**6])
def test_buckets_cover_everything_in_reverse_order(bucket_bytes):
    buf = make(pad_to=4)
    buckets = buf.buckets(bucket_bytes)
    assert buckets[0].stop == buf.data.shape[0]
    assert buckets[-1].start == 0
    for a, b in zip(buckets, buckets[1:], strict=False):
        assert a.start == b.stop
    names = [n for b in buckets for n in b.names]
    assert names == ["c", "b", "a"]
    limit = bucket_bytes // 8
    for b in buckets:
        assert b.size <= max(limit, max(buf.specs[n].size for n in b.names)) + 3  # + padding


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_bad_bucket_size(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        make().buckets(bad)


def test_bad_specs():
    with pytest.raises(ValueError, match="'w' is registered twice"):
        FlatBuffer([("w", (2,)), ("w", (3,))])
    with pytest.raises(ValueError, match="negative dimension"):
        FlatBuffer([("w", (2, -1))])
    with pytest.raises(ValueError, match="pad_to=0"):
        FlatBuffer([("w", (2,))], pad_to=0)


def test_like_and_external_storage():
    buf = make(pad_to=2)
    g = buf.like()
    assert g.names == buf.names and g.data.shape == buf.data.shape
    assert not np.shares_memory(g.data, buf.data)
    store = np.zeros(100)
    ext = FlatBuffer([("x", (10,))], np.float64, data=store)
    ext["x"][:] = 1
    assert store[:10].sum() == 10


@pytest.mark.parametrize("rows,n", [(10, 3), (7, 4), (3, 5), (0, 2), (8, 4)])
def test_row_range_splits_as_torch_chunk(rows, n):
    torch = pytest.importorskip("torch")
    pieces = torch.arange(rows).chunk(n) if rows else ()
    for rank in range(n):
        lo, hi = row_range(rows, rank, n)
        expected = pieces[rank].tolist() if rank < len(pieces) else []
        assert list(range(lo, hi)) == expected
    with pytest.raises(ValueError, match="rank=3"):
        row_range(rows, 3, 3)


def test_first_bucket_may_be_smaller():
    specs = [TensorSpec(f"t{i}", (100,), 100 * i) for i in range(10)]
    plain = make_buckets(specs, 1000, 400 * 8, 8)
    early = make_buckets(specs, 1000, 400 * 8, 8, first_bytes=100 * 8)
    assert [b.size for b in plain] == [400, 400, 200]
    assert [b.size for b in early] == [100, 400, 400, 100]
    assert early[0].names == ("t9",)
    with pytest.raises(ValueError, match="first_bytes=0"):
        make_buckets(specs, 1000, 400, 8, first_bytes=0)
