"""The CUDA layer kernels against the CPU ones, under the Numba CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim``). Tiny sizes: the simulator is slow."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mpidist.nn import fused as F

pytestmark = [
    pytest.mark.cudasim,
    pytest.mark.skipif(
        os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="needs NUMBA_ENABLE_CUDASIM=1"
    ),
]

TOL = {"rtol": 1e-11, "atol": 1e-12}  # float64: the same formulas, to round-off


def dev(a: np.ndarray):
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(a))


def host(a) -> np.ndarray:
    return np.asarray(a.copy_to_host() if hasattr(a, "copy_to_host") else a)


def test_causal_softmax_matches_cpu() -> None:
    rng = np.random.default_rng(0)
    s0 = rng.standard_normal((2, 5, 5))
    dp0 = rng.standard_normal(s0.shape)
    s = s0.copy()
    lse = F.causal_softmax(s, 0.7)
    dp = dp0.copy()
    F.causal_softmax_backward(s, dp, 0.7)
    ds, ddp = dev(s0), dev(dp0)
    dlse = F.causal_softmax(ds, 0.7)
    np.testing.assert_allclose(host(ds), s, **TOL)
    np.testing.assert_allclose(host(dlse), lse, **TOL)
    F.causal_softmax_backward(ds, ddp, 0.7)
    np.testing.assert_allclose(host(ddp), dp, **TOL)
    dp2 = dev(s0)
    F.causal_softmax_recompute(dp2, dlse, 0.7)
    np.testing.assert_allclose(host(dp2), s, **TOL)


def test_layer_norm_matches_cpu() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 7))
    w, b = rng.standard_normal((2, 7))
    dy = rng.standard_normal(x.shape)
    out, mean, rstd = F.layer_norm(x, w, b, 1e-5)
    dw, db = np.ones(7), np.ones(7)
    dx = F.layer_norm_backward(dy, x, w, mean, rstd, dw, db)
    gout, gmean, grstd = F.layer_norm(dev(x), dev(w), dev(b), 1e-5)
    gdw, gdb = dev(np.ones(7)), dev(np.ones(7))
    gdx = F.layer_norm_backward(dev(dy), dev(x), dev(w), gmean, grstd, gdw, gdb)
    for got, ref in [(gout, out), (gmean, mean), (grstd, rstd), (gdx, dx), (gdw, dw),
                     (gdb, db)]:
        np.testing.assert_allclose(host(got), ref, **TOL)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_bias_gelu_matches_cpu(with_bias: bool) -> None:
    rng = np.random.default_rng(2)
    h0 = 2 * rng.standard_normal((3, 9))
    b = rng.standard_normal(9) if with_bias else None
    dy = rng.standard_normal(h0.shape)
    h = h0.copy()
    y = F.bias_gelu(h, b)
    db = np.zeros(9)
    dh = F.bias_gelu_backward(h, dy, db)
    gh = dev(h0)
    gy = F.bias_gelu(gh, None if b is None else dev(b))
    gdb = dev(np.zeros(9))
    gdy = dev(dy)
    gdh = F.bias_gelu_backward(gh, gdy, gdb, inplace=True)
    gdh2, gy2 = F.bias_gelu_backward(gh, dev(dy), output=True)
    for got, ref in [(gh, h), (gy, y), (gdh, dh), (gdy, dh), (gdb, db), (gdh2, dh), (gy2, y)]:
        np.testing.assert_allclose(host(got), ref, **TOL)


def test_cross_entropy_and_embedding_match_cpu() -> None:
    rng = np.random.default_rng(3)
    z = 3 * rng.standard_normal((4, 6))
    t = np.array([5, 0, 2, 5])
    total, lse = F.cross_entropy(z, t)
    g = F.cross_entropy_backward(z, t, lse, 0.5)
    gtotal, glse = F.cross_entropy(dev(z), t)
    assert gtotal == pytest.approx(total, rel=1e-12)
    np.testing.assert_allclose(host(glse), lse, **TOL)
    np.testing.assert_allclose(host(F.cross_entropy_backward(dev(z), dev(t), glse, 0.5)), g,
                               **TOL)
    table = np.ones((6, 4))
    F.embedding_backward(table, t, z[:, :4])
    gtable = dev(np.ones((6, 4)))
    F.embedding_backward(gtable, t, dev(z[:, :4]))
    np.testing.assert_allclose(host(gtable), table, **TOL)
