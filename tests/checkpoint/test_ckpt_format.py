"""Pure parts of the checkpoint format: flat-range blocks, checksums, names, attrs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpidist.checkpoint import TensorInfo, checksum
from mpidist.checkpoint.format import (
    _bits,
    compare_tensors,
    encode_attrs,
    flat_blocks,
    validate_names,
)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 3, 1, 4), (1, 1, 6), (5, 1)])
def test_flat_blocks_cover_range_in_order(shape):
    rng = np.random.default_rng(1)
    n = math.prod(shape)
    idx = np.arange(n).reshape(shape)
    for _ in range(60):
        a, b = sorted(rng.integers(0, n + 1, 2))
        blocks = flat_blocks(shape, int(a), int(b))
        assert len(blocks) <= 2 * len(shape) - 1
        got = [idx[tuple(slice(o, o + c) for o, c in zip(off, cnt, strict=True))].ravel()
               for off, cnt in blocks]
        flat = np.concatenate(got) if got else np.empty(0, dtype=idx.dtype)
        np.testing.assert_array_equal(flat, np.arange(a, b))


def test_flat_blocks_edge_cases():
    assert flat_blocks((), 0, 1) == [((), ())]
    assert flat_blocks((3, 4), 2, 2) == []
    assert flat_blocks((0, 4), 0, 0) == []
    assert flat_blocks((3, 4), 4, 12) == [((1, 0), (2, 4))]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint16", "int64",
                                   "bool", "complex64"])
def test_checksum_is_additive_and_matches_reference(dtype):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(1001) * 100).astype(dtype)
    whole = checksum(x)
    bits = [int(b) for b in _bits(x)]  # the definition, in Python integers
    assert whole == (sum(bits) % 2**64, sum((i + 1) * b for i, b in enumerate(bits)) % 2**64)
    s1 = s2 = 0
    for a, b in [(0, 10), (10, 500), (500, 1001)]:
        p1, p2 = checksum(x[a:b], a)
        s1, s2 = (s1 + p1) % 2**64, (s2 + p2) % 2**64
    assert (s1, s2) == whole


def test_checksum_detects_swaps_and_flips():
    x = np.arange(100, dtype=np.float32)
    y = x.copy()
    y[[3, 4]] = y[[4, 3]]
    assert checksum(x)[0] == checksum(y)[0]  # S1 is order-blind, S2 is not
    assert checksum(x) != checksum(y)
    z = x.copy()
    z.view(np.uint32)[50] ^= 1 << 7
    assert checksum(x) != checksum(z)


def test_checksum_big_endian_same_as_little():
    x = np.linspace(-1, 1, 33)
    assert checksum(x.astype(">f8")) == checksum(x)


def test_validate_names():
    ok = {"params/a.w": TensorInfo((2,), "float32"), "params/b": TensorInfo((), "float64")}
    validate_names(ok)
    for bad in ["", "/a", "a/", "a//b", "a/./b"]:
        with pytest.raises(ValueError, match="tensor name"):
            validate_names({bad: TensorInfo((1,), "float32")})
    with pytest.raises(ValueError, match=r"\['a/b'\]"):
        validate_names({"a/b": TensorInfo((1,), "float32"), "a/b/c": TensorInfo((1,), "f4")})
    with pytest.raises(ValueError, match="dtype 'object'"):
        validate_names({"a": TensorInfo((1,), "object")})


def test_encode_attrs():
    plain, whole = encode_attrs({"step": 3, "lr": 0.1, "name": "x", "ok": True,
                                 "mesh": [1, 2], "opt": {"b": [0.9, 0.99]}, "none": None})
    assert plain["step"] == 3 and plain["lr"] == 0.1 and plain["name"] == "x"
    assert plain["mesh"] == "[1, 2]" and plain["none"] == "null"
    assert '"opt": {"b": [0.9, 0.99]}' in whole
    with pytest.raises(ValueError, match="'format' is reserved"):
        encode_attrs({"format": "x"})
    with pytest.raises(ValueError, match="attribute 'f'"):
        encode_attrs({"f": object()})


def test_compare_tensors_lists_every_difference():
    found = {"a": TensorInfo((2, 3), "float32"), "b": TensorInfo((4,), "float32"),
             "x": TensorInfo((1,), "float32")}
    exp = {"a": TensorInfo((3, 2), "float32"), "b": TensorInfo((4,), "float32"),
           "c": TensorInfo((1,), "float32")}
    msg = compare_tensors(found, exp)
    assert "missing from the checkpoint (1): c" in msg
    assert "unexpected in the checkpoint (1): x" in msg
    assert "a: checkpoint has (2, 3) float32, expected (3, 2) float32" in msg
    assert "unexpected" not in compare_tensors(found, exp, strict=False)
    assert compare_tensors(found, dict(found)) is None
