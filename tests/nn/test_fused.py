"""The fused Numba kernels of mpidist.nn against their NumPy references, and the layers with
either implementation (float64 to round-off, float32 to float32 round-off)."""

from __future__ import annotations

import numpy as np
import pytest

from mpidist.nn import GPT, CrossEntropyLoss, GPTConfig
from mpidist.nn import fused as F

pytestmark = pytest.mark.skipif(not F.HAVE_NUMBA, reason="needs numba")

DTYPES = [np.float64, np.float32]
IDS = ["f64", "f32"]


def tol(dtype: type, scale: float = 1.0) -> dict[str, float]:
    if dtype == np.float64:
        return {"rtol": 1e-12, "atol": 1e-13 * scale}
    return {"rtol": 2e-5, "atol": 2e-6 * scale}


def both(fn):
    """``fn()`` with the NumPy reference and with the Numba kernels."""
    with F.use_kernels("numpy"):
        ref = fn()
    with F.use_kernels("numba"):
        got = fn()
    return ref, got


def assert_same(ref, got, dtype, scale: float = 1.0) -> None:
    for r, g in zip(ref, got, strict=True):
        g = np.asarray(g)
        assert g.dtype == np.asarray(r).dtype
        np.testing.assert_allclose(g, r, **tol(dtype, scale))


def test_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="kernels='cuda'"):
        F.set_kernels("cuda")
    with F.use_kernels("numpy"):
        assert F.get_kernels() == "numpy"
    assert F.get_kernels() == "numba"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("t", [1, 7, 33])
def test_causal_softmax(dtype: type, t: int) -> None:
    rng = np.random.default_rng(t)
    s0 = (3 * rng.standard_normal((2, 3, t, t))).astype(dtype)
    dp0 = rng.standard_normal(s0.shape).astype(dtype)
    above = np.triu(np.ones((t, t), bool), 1)
    s0[..., above] = np.nan  # never read: the attention leaves it uninitialised
    dp0[..., above] = np.inf

    def run():
        s = s0.copy()
        lse = F.causal_softmax(s, 0.37)
        dp = dp0.copy()
        F.causal_softmax_backward(s, dp, 0.37)
        p = s0.copy()
        F.causal_softmax_recompute(p, lse, 0.37)
        return s, lse, dp, p

    ref, got = both(run)
    assert_same(ref, got, dtype)
    s, lse, dp, p = got
    np.testing.assert_allclose(p, s, **tol(dtype))  # recomputed from lse: forward's P
    assert np.all(np.triu(s[0, 0], 1) == 0) and np.all(np.triu(dp[0, 0], 1) == 0)
    np.testing.assert_allclose(s.sum(axis=-1), 1.0, **tol(dtype))
    # Independent of both paths: lse and the gradient of the scaled, masked scores.
    z = np.where(np.tril(np.ones((t, t), bool)), 0.37 * s0.astype(np.float64), -np.inf)
    np.testing.assert_allclose(lse, np.log(np.exp(z).sum(axis=-1)), **tol(dtype, 4))
    p64 = np.exp(z - np.log(np.exp(z).sum(axis=-1, keepdims=True)))
    d64 = np.where(above, 0.0, dp0.astype(np.float64))
    ds = 0.37 * p64 * (d64 - (p64 * d64).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(dp, ds, **tol(dtype, 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_layer_norm(dtype: type) -> None:
    rng = np.random.default_rng(1)
    x = (2 + 3 * rng.standard_normal((37, 13))).astype(dtype)
    w, b = rng.standard_normal((2, 13)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)

    def run():
        out, mean, rstd = F.layer_norm(x, w, b, 1e-5)
        dw, db = np.ones(13, dtype), np.ones(13, dtype)
        dx = F.layer_norm_backward(dy, x, w, mean, rstd, dw, db)
        return out, mean, rstd, dx, dw, db

    ref, got = both(run)
    assert_same(ref, got, dtype, scale=10)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_bias_gelu(dtype: type, with_bias: bool) -> None:
    rng = np.random.default_rng(2)
    h0 = (2 * rng.standard_normal((19, 23))).astype(dtype)
    b = rng.standard_normal(23).astype(dtype) if with_bias else None
    dy = rng.standard_normal(h0.shape).astype(dtype)

    def run():
        h = h0.copy()
        y = F.bias_gelu(h, b)
        db = np.zeros(23, dtype)
        dh = F.bias_gelu_backward(h, dy, db)
        dy2 = dy.copy()
        dh2 = F.bias_gelu_backward(h, dy2, None, inplace=True)
        assert dh2 is dy2
        dy3 = dy.copy()
        dh3, y3 = F.bias_gelu_backward(h, dy3, None, inplace=True, output=True)
        assert dh3 is dy3
        return h, y, dh, db, dh2, dh3, y3

    ref, got = both(run)
    # float32: the kernel's exp-based form is within a few ulps of NumPy's tanh; near saturation
    # the derivative's 1 - t^2 amplifies that, hence an absolute tolerance of 1e-5.
    assert_same(ref, got, dtype, scale=5)
    np.testing.assert_array_equal(ref[0], h0 + (0 if b is None else b))
    for r in (ref, got):  # the recomputed output and its gradient are forward's and backward's
        assert_same(r[1:3], r[6:4:-1], dtype, scale=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_cross_entropy(dtype: type) -> None:
    rng = np.random.default_rng(3)
    z = (4 * rng.standard_normal((29, 11))).astype(dtype)
    t = rng.integers(0, 11, 29)

    def run():
        total, lse = F.cross_entropy(z, t)
        return np.float64(total), lse, F.cross_entropy_backward(z, t, lse, 0.25)

    ref, got = both(run)
    assert_same(ref, got, dtype, scale=10)
    np.testing.assert_allclose(got[2].sum(axis=-1), 0.0, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_embedding_scatter_add(dtype: type) -> None:
    rng = np.random.default_rng(4)
    ids = np.array([3, 0, 3, 3, 6, 0, 1])  # repeated ids accumulate
    dy = rng.standard_normal((7, 5)).astype(dtype)

    def run():
        g = np.ones((7, 5), dtype)
        F.embedding_backward(g, ids, dy)
        return (g,)

    ref, got = both(run)
    expect = np.ones((7, 5), dtype)
    for i, r in enumerate(ids):
        expect[r] += dy[i]
    assert_same((expect,), got, dtype)
    assert_same(ref, got, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gpt_step_same_with_either_kernels(dtype: type) -> None:
    """Loss and every gradient of a GPT step (odd sizes) agree between the two paths."""
    cfg = GPTConfig(vocab_size=37, block_size=9, n_layer=2, n_head=3, n_embd=12)
    rng = np.random.default_rng(5)
    x = rng.integers(0, 37, (3, 9))
    y = rng.integers(0, 37, (3, 9))

    def run():
        model = GPT(cfg)
        _, grads = model.build(dtype=dtype, seed=1)
        loss_fn = CrossEntropyLoss()
        loss = loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        return np.float64(loss), grads.data.copy()

    ref, got = both(run)
    assert_same(ref, got, dtype, scale=10)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("t", [5, 33, 40, 100, 131])
@pytest.mark.parametrize("d", [4, 40])
def test_causal_attention_matches_dense(kernels: str, t: int, d: int) -> None:
    """Attention (which skips the masked blocks of queries x keys from T = 32 on: 2, 3 or 4
    row blocks, uneven for 100 and 131) against a dense transcription, forward and backward,
    float64; keeping the probabilities (T <= 4 D) or recomputing them from the log-sum-exp."""
    from mpidist.nn.attention import (
        causal_attention,
        causal_attention_backward,
        keeps_probabilities,
    )

    b, h = 2, 3
    rng = np.random.default_rng(t)
    qkv = rng.standard_normal((b, t, 3 * h * d))
    dy = rng.standard_normal((b, t, h * d))
    with F.use_kernels(kernels):
        y, saved = causal_attention(qkv, h)
        assert saved[1].shape == ((b, h, t, t) if keeps_probabilities(t, d) else (b, h, t))
        dqkv = causal_attention_backward(dy, saved)

    a = qkv.reshape(b, t, 3, h, d).transpose(2, 0, 3, 1, 4)
    q, k, v = a[0], a[1], a[2]
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d) + np.triu(np.full((t, t), -np.inf), 1)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ref = (p @ v).transpose(0, 2, 1, 3).reshape(b, t, h * d)
    dyh = dy.reshape(b, t, h, d).transpose(0, 2, 1, 3)
    dp = dyh @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) / np.sqrt(d)
    dref = np.stack((ds @ k, ds.transpose(0, 1, 3, 2) @ q, p.transpose(0, 1, 3, 2) @ dyh))
    dref = dref.transpose(1, 3, 0, 2, 4).reshape(b, t, 3 * h * d)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dqkv, dref, rtol=1e-12, atol=1e-13)


def test_parallel_kernels_match_serial() -> None:
    """The ``parallel=True`` compilations (``MPIDIST_NN_PARALLEL=1``) give the serial ones'
    results (float64; the partial column sums may group differently)."""
    from mpidist.nn import fused_cpu

    cfg = GPTConfig(vocab_size=37, block_size=40, n_layer=1, n_head=2, n_embd=8)
    rng = np.random.default_rng(6)
    x = rng.integers(0, 37, (3, 40))
    y = rng.integers(0, 37, (3, 40))

    def run():
        model = GPT(cfg)
        _, grads = model.build(dtype=np.float64, seed=2)
        loss_fn = CrossEntropyLoss()
        loss = loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        return np.float64(loss), grads.data.copy()

    results = []
    try:
        for force in (False, True):
            fused_cpu.FORCE_PARALLEL = force
            results.append(run())
    finally:
        fused_cpu.FORCE_PARALLEL = None
    assert_same(results[0], results[1], np.float64, scale=10)


@pytest.mark.skipif(not F.attention_kernel_applies(np.zeros(1)),
                    reason="no BLAS callable from Numba (mpidist.nn.blas)")
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("t", [1, 31, 64, 65, 131])
@pytest.mark.parametrize("keep", [True, False], ids=["P", "lse"])
@pytest.mark.parametrize("rows", [32, 64])
def test_attention_kernels_match_numpy_path(dtype: type, t: int, keep: bool, rows: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention kernels (one per direction, head by head in row blocks, lengths that
    are and are not multiples of the block) against the NumPy path, forward and backward;
    what either forward keeps serves either backward; P is zero above the diagonal."""
    from mpidist.nn.attention import causal_attention, causal_attention_backward

    monkeypatch.setattr(F, "ATTENTION_ROWS", rows)
    b, h, d = 2, 3, 8
    rng = np.random.default_rng(t)
    qkv = (2 * rng.standard_normal((b, t, 3 * h * d))).astype(dtype)
    dy = rng.standard_normal((b, t, h * d)).astype(dtype)
    out = {}
    for kernels in ("numba", "numpy"):
        with F.use_kernels(kernels):
            y, saved = causal_attention(qkv, h, keep_probabilities=keep)
            out[kernels] = (y, saved[1], causal_attention_backward(dy, saved), saved)
    for ref, got in zip(out["numpy"][:3], out["numba"][:3], strict=True):
        np.testing.assert_allclose(got, ref, **tol(dtype, 10 * np.abs(ref).max()))
    if keep:
        p = out["numba"][1]
        assert np.all(p[..., np.triu(np.ones((t, t), bool), 1)] == 0)
        np.testing.assert_allclose(p.sum(axis=-1), 1.0, **tol(dtype))
    for forward, backward in (("numba", "numpy"), ("numpy", "numba")):
        with F.use_kernels(backward):
            da = causal_attention_backward(dy, out[forward][3])
        ref = out["numpy"][2]
        np.testing.assert_allclose(da, ref, **tol(dtype, 10 * np.abs(ref).max()))


def test_fmax_is_maxnum() -> None:
    """``fused_cpu.fmax``, the vectorisable maximum: a NaN operand gives the other one."""
    from numba import njit

    from mpidist.nn.fused_cpu import fmax

    @njit
    def running_max(x):
        m = x.dtype.type(-np.inf)
        for v in x:
            m = fmax(m, v)
        return m

    x = np.array([1.0, np.nan, 3.0, -2.0])
    assert running_max(x) == 3.0
    assert running_max(x.astype(np.float32)) == np.float32(3.0)
    assert running_max(np.array([np.nan])) == -np.inf
