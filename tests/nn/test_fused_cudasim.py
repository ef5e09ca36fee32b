"""The CUDA layer kernels against the CPU ones, under the Numba CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim``). Tiny sizes: the simulator is slow.

Under the simulator the kernels use blocks of :data:`~mpidist.nn.fused_cuda.BLOCK` (16)
threads and grids of at most 3 blocks, so the sizes here cover rows shorter than a block,
rows of several blocks' length that are no multiple of it, and more rows than blocks.
float64 and float32 are compared with the CPU kernels on the same inputs; float16 with the
float32 CPU kernels on the float16 inputs widened to float32."""

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


DTYPES = [np.float64, np.float32, np.float16]
IDS = ["f64", "f32", "f16"]


def dev(a: np.ndarray):
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(a))


def host(a) -> np.ndarray:
    if isinstance(a, HostDeviceArray):
        return a.a
    return np.asarray(a.copy_to_host() if hasattr(a, "copy_to_host") else a)


def inputs(dt, *arrays: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(the arrays in ``dt``, the CPU reference's inputs): the same arrays, except that
    float16 data is compared with the float32 kernels on its widened values."""
    data = [np.ascontiguousarray(a.astype(dt)) for a in arrays]
    ref = [a.astype(np.float32) if dt == np.float16 else a.copy() for a in data]
    return data, ref


def close(got, ref, dt, scale: float = 1.0) -> None:
    """Equal to round-off of ``dt`` (float16: of its float32 accumulation, then rounding);
    the absolute part is relative to ``scale``, the size of the values compared."""
    g = host(got).astype(np.float64)
    r = np.asarray(ref, dtype=np.float64)
    rtol = {np.float64: 1e-12, np.float32: 1e-6, np.float16: 1e-2}[dt]
    np.testing.assert_allclose(g, r, rtol=rtol, atol=rtol * scale)


def stat_dtype(dt):
    return np.float32 if dt == np.float16 else dt


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(2, 5, 5), (1, 33, 33)], ids=["short", "long"])
def test_causal_softmax_matches_cpu(dt, shape) -> None:
    rng = np.random.default_rng(0)
    (s0, dp0), (s, dp) = inputs(dt, 3 * rng.standard_normal(shape), rng.standard_normal(shape))
    raw = s.copy()
    lse = F.causal_softmax(s, 0.7)
    F.causal_softmax_backward(s, dp, 0.7)
    ds, ddp = dev(s0), dev(dp0)
    dlse = F.causal_softmax(ds, 0.7)
    assert host(ds).dtype == dt and host(dlse).dtype == stat_dtype(dt)
    close(ds, s, dt)
    close(dlse, lse, dt, scale=np.abs(lse).max())
    F.causal_softmax_backward(ds, ddp, 0.7)
    close(ddp, dp, dt)
    ds2 = dev(s0)
    F.causal_softmax_recompute(ds2, dlse, 0.7)
    close(ds2, s, dt)
    F.causal_softmax_recompute(raw, lse, 0.7)  # the CPU's own recomputation agrees too
    close(ds2, raw, dt)


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("n,c", [(5, 7), (9, 33), (41, 5)])
def test_layer_norm_matches_cpu(dt, n, c) -> None:
    rng = np.random.default_rng(1)
    (x, w, b, dy), (rx, rw, rb, rdy) = inputs(
        dt, 1.5 + rng.standard_normal((n, c)), 1 + 0.2 * rng.standard_normal(c),
        rng.standard_normal(c), rng.standard_normal((n, c)))
    out, mean, rstd = F.layer_norm(rx, rw, rb, 1e-5)
    dw, db = np.ones(c, rx.dtype), np.ones(c, rx.dtype)
    dx = F.layer_norm_backward(rdy, rx, rw, mean, rstd, dw, db)
    gout, gmean, grstd = F.layer_norm(dev(x), dev(w), dev(b), 1e-5)
    assert host(gout).dtype == dt and host(gmean).dtype == host(grstd).dtype == stat_dtype(dt)
    gdw, gdb = dev(np.ones(c, dt)), dev(np.ones(c, dt))
    gdx = F.layer_norm_backward(dev(dy), dev(x), dev(w), gmean, grstd, gdw, gdb)
    for got, ref in [(gout, out), (gmean, mean), (grstd, rstd), (gdx, dx), (gdw, dw),
                     (gdb, db)]:
        close(got, ref, dt, scale=np.abs(ref).max())


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("with_bias,n,f", [(True, 9, 33), (False, 9, 33), (True, 41, 5)],
                         ids=["bias", "nobias", "bias-tall"])
def test_bias_gelu_matches_cpu(dt, with_bias: bool, n: int, f: int) -> None:
    rng = np.random.default_rng(2)
    (h0, b, dy), (h, rb, rdy) = inputs(dt, 2 * rng.standard_normal((n, f)),
                                       rng.standard_normal(f), rng.standard_normal((n, f)))
    if not with_bias:
        b = rb = None
    y = F.bias_gelu(h, rb)
    db = np.zeros(f, h.dtype)
    dh = F.bias_gelu_backward(h, rdy, db)
    gh = dev(h0)
    gy = F.bias_gelu(gh, None if b is None else dev(b))
    gdb = dev(np.zeros(f, dt))
    gdy = dev(dy)
    gdh = F.bias_gelu_backward(gh, gdy, gdb, inplace=True)
    assert gdh is gdy
    gdh2, gy2 = F.bias_gelu_backward(gh, dev(dy), output=True)
    for got, ref in [(gh, h), (gy, y), (gdh, dh), (gdb, db), (gdh2, dh), (gy2, y)]:
        assert host(got).dtype == dt
        close(got, ref, dt, scale=np.abs(ref).max())


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
@pytest.mark.parametrize("n,v", [(4, 7), (5, 33)])
def test_cross_entropy_matches_cpu(dt, n, v) -> None:
    rng = np.random.default_rng(3)
    (z,), (rz,) = inputs(dt, 3 * rng.standard_normal((n, v)))
    t = rng.integers(0, v, n)
    t[0] = v - 1
    total, lse = F.cross_entropy(rz, t)
    g = F.cross_entropy_backward(rz, t, lse, 0.5)
    gtotal, glse = F.cross_entropy(dev(z), t)
    assert isinstance(gtotal, float) and host(glse).dtype == stat_dtype(dt)
    assert gtotal == pytest.approx(total, rel={np.float64: 1e-12, np.float32: 1e-6,
                                               np.float16: 1e-3}[dt])
    close(glse, lse, dt, scale=np.abs(lse).max())
    gg = F.cross_entropy_backward(dev(z), dev(t), glse, 0.5)
    assert host(gg).dtype == dt
    close(gg, g, dt, scale=0.5)


@pytest.mark.parametrize("dt", DTYPES, ids=IDS)
def test_embedding_backward_matches_cpu(dt) -> None:
    rng = np.random.default_rng(4)
    (table, dy), (rtable, rdy) = inputs(dt, rng.standard_normal((6, 33)),
                                        rng.standard_normal((9, 33)))
    ids = np.array([5, 0, 2, 5, 5, 1, 0, 3, 5])
    F.embedding_backward(rtable, ids, rdy)
    gtable = dev(table)
    F.embedding_backward(gtable, ids, dev(dy))
    close(gtable, rtable, dt, scale=np.abs(rtable).max())


def test_unsupported_dtype_is_named() -> None:
    with pytest.raises(TypeError, match="dtype=int32"):
        F.layer_norm(dev(np.ones((2, 3), np.int32)), dev(np.ones(3)), dev(np.ones(3)), 1e-5)


# -- outputs are arrays of the input's library ----------------------------------------------
class HostDeviceArray:
    """Stands for a CuPy array: a device-array interface (over host memory, which is the
    simulator's device memory) and an array namespace of its own."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = np.ascontiguousarray(a)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "strides": None,
                "data": (self.a.ctypes.data, False), "version": 3}

    def __array_namespace__(self, api_version=None):
        return _NAMESPACE

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)


class _Namespace:
    __name__ = "hostdevice"

    @staticmethod
    def empty(shape, dtype=None) -> HostDeviceArray:
        return HostDeviceArray(np.empty(shape, dtype=dtype))


_NAMESPACE = _Namespace()


@pytest.mark.parametrize("kind", ["namespace", "numba"])
def test_outputs_are_of_the_inputs_library(kind) -> None:
    from mpidist.nn import fused_cuda

    wrap = HostDeviceArray if kind == "namespace" else dev
    want = HostDeviceArray if kind == "namespace" else type(dev(np.zeros(1)))
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((2, 5, 5)), rng.standard_normal((2, 5, 5))
    lse = fused_cuda.causal_softmax(wrap(x), 0.5)
    out, mean, rstd = fused_cuda.layer_norm(wrap(x[0]), wrap(np.ones(5)), wrap(np.zeros(5)),
                                            1e-5)
    dx = fused_cuda.layer_norm_backward_dx(wrap(dy[0]), wrap(x[0]), wrap(np.ones(5)), mean,
                                           rstd)
    y = fused_cuda.bias_gelu(wrap(x[0]), wrap(np.ones(5)))
    gdy = wrap(dy[0])
    same = fused_cuda.bias_gelu_backward(wrap(x[0]), gdy, inplace=True)
    d2, y2 = fused_cuda.bias_gelu_backward(wrap(x[0]), wrap(dy[0]), output=True)
    total, zlse = fused_cuda.cross_entropy(wrap(x[0]), np.array([0, 1, 2, 3, 4]))
    g = fused_cuda.cross_entropy_backward(wrap(x[0]), np.arange(5), zlse, 1.0)
    for a in (lse, out, mean, rstd, dx, y, same, d2, y2, zlse, g):
        assert type(a) is want
    assert same is gdy
    ref_out, _, _ = F.layer_norm(x[0], np.ones(5), np.zeros(5), 1e-5)
    np.testing.assert_allclose(host(out), ref_out, rtol=1e-12, atol=1e-13)
