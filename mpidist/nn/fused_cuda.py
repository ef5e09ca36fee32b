"""``numba.cuda`` counterparts of the layer kernels in :mod:`mpidist.nn.fused_cpu`.

Same functions, same arguments and results as :mod:`mpidist.nn.fused` (which dispatches
here for arrays with ``__cuda_array_interface__``), same formulas: one thread per row for
the row-wise chains (causal softmax, layer norm, cross-entropy), a grid-stride loop over the
elements for GELU, one thread per column for the parameter-gradient sums, and atomic adds
for the embedding's scatter-add (the only kernel whose summation order is not fixed).
Outputs are new device arrays; launches are asynchronous except :func:`cross_entropy`, which
copies its scalar back. Tested under ``NUMBA_ENABLE_CUDASIM=1``. Not collective.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

from mpidist.optim.kernels import cuda as K
from mpidist.optim.kernels import is_device_array

from .fused_cpu import GELU_A, GELU_C

__all__ = [
    "bias_gelu",
    "bias_gelu_backward",
    "causal_softmax",
    "causal_softmax_backward",
    "causal_softmax_recompute",
    "cross_entropy",
    "cross_entropy_backward",
    "embedding_backward",
    "layer_norm",
    "layer_norm_backward_dwdb",
    "layer_norm_backward_dx",
]

_THREADS = 128


def _grid(n: int) -> tuple[int, int]:
    return max(1, min(4096, (n + _THREADS - 1) // _THREADS)), _THREADS


_dev = K.as_device_array


# -- causal softmax -------------------------------------------------------------------------
@cuda.jit
def _softmax_rows(s, scale, lse):  # pragma: no cover - device code
    t = s.shape[1]
    for row in range(cuda.grid(1), s.shape[0], cuda.gridsize(1)):
        i = row % t
        m = s[row, 0]
        for j in range(1, i + 1):
            m = max(m, s[row, j])
        ms = m * scale
        acc = 0.0
        for j in range(i + 1):
            e = math.exp(s[row, j] * scale - ms)
            s[row, j] = e
            acc += e
        for j in range(i + 1):
            s[row, j] /= acc
        for j in range(i + 1, t):
            s[row, j] = 0.0
        lse[row] = ms + math.log(acc)


@cuda.jit
def _softmax_rows_backward(p, dp, scale):  # pragma: no cover - device code
    t = p.shape[1]
    for row in range(cuda.grid(1), p.shape[0], cuda.gridsize(1)):
        i = row % t
        dot = 0.0
        for j in range(i + 1):
            dot += p[row, j] * dp[row, j]
        for j in range(i + 1):
            dp[row, j] = scale * p[row, j] * (dp[row, j] - dot)
        for j in range(i + 1, t):
            dp[row, j] = 0.0


@cuda.jit
def _softmax_rows_recompute(s, lse, scale):  # pragma: no cover - device code
    t = s.shape[1]
    for row in range(cuda.grid(1), s.shape[0], cuda.gridsize(1)):
        i = row % t
        c = lse[row]
        for j in range(i + 1):
            s[row, j] = math.exp(s[row, j] * scale - c)
        for j in range(i + 1, t):
            s[row, j] = 0.0


def causal_softmax(s: Any, scale: float) -> Any:
    """See :func:`mpidist.nn.fused.causal_softmax` (``s``: contiguous device array)."""
    s = _dev(s)
    shape = tuple(s.shape)
    t = shape[-1]
    rows = s.size // t
    lse = cuda.device_array(shape[:-1], dtype=s.dtype)
    _softmax_rows[_grid(rows)](s.reshape(rows, t), scale, lse.reshape(rows))
    return lse


def causal_softmax_backward(p: Any, dp: Any, scale: float) -> None:
    """See :func:`mpidist.nn.fused.causal_softmax_backward`."""
    p, dp = _dev(p), _dev(dp)
    t = tuple(p.shape)[-1]
    rows = p.size // t
    _softmax_rows_backward[_grid(rows)](p.reshape(rows, t), dp.reshape(rows, t), scale)


def causal_softmax_recompute(s: Any, lse: Any, scale: float) -> None:
    """See :func:`mpidist.nn.fused.causal_softmax_recompute`."""
    s, lse = _dev(s), _dev(lse)
    t = tuple(s.shape)[-1]
    rows = s.size // t
    _softmax_rows_recompute[_grid(rows)](s.reshape(rows, t), lse.reshape(rows), scale)


# -- layer norm -----------------------------------------------------------------------------
@cuda.jit
def _layer_norm(x, w, b, eps, out, mean, rstd):  # pragma: no cover - device code
    n, c = x.shape
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        acc = 0.0
        for j in range(c):
            acc += x[i, j]
        mu = acc / c
        var = 0.0
        for j in range(c):
            d = x[i, j] - mu
            var += d * d
        rs = 1.0 / math.sqrt(var / c + eps)
        for j in range(c):
            out[i, j] = (x[i, j] - mu) * rs * w[j] + b[j]
        mean[i] = mu
        rstd[i] = rs


@cuda.jit
def _layer_norm_dx(dy, x, w, mean, rstd, dx):  # pragma: no cover - device code
    n, c = x.shape
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        mu = mean[i]
        rs = rstd[i]
        m1 = 0.0
        m2 = 0.0
        for j in range(c):
            gw = dy[i, j] * w[j]
            m1 += gw
            m2 += gw * (x[i, j] - mu) * rs
        m1 /= c
        m2 /= c
        for j in range(c):
            dx[i, j] = (dy[i, j] * w[j] - m1 - (x[i, j] - mu) * rs * m2) * rs


@cuda.jit
def _layer_norm_dwdb(dy, x, mean, rstd, dw, db):  # pragma: no cover - device code
    n, c = x.shape
    for j in range(cuda.grid(1), c, cuda.gridsize(1)):
        sw = 0.0
        sb = 0.0
        for i in range(n):
            sw += dy[i, j] * (x[i, j] - mean[i]) * rstd[i]
            sb += dy[i, j]
        dw[j] += sw
        db[j] += sb


def layer_norm(x: Any, w: Any, b: Any, eps: float) -> tuple[Any, Any, Any]:
    """See :func:`mpidist.nn.fused.layer_norm`."""
    x, w, b = _dev(x), _dev(w), _dev(b)
    n = x.shape[0]
    out = cuda.device_array(x.shape, dtype=x.dtype)
    mean = cuda.device_array(n, dtype=x.dtype)
    rstd = cuda.device_array(n, dtype=x.dtype)
    _layer_norm[_grid(n)](x, w, b, float(eps), out, mean, rstd)
    return out, mean, rstd


def layer_norm_backward_dx(dy: Any, x: Any, w: Any, mean: Any, rstd: Any) -> Any:
    """The input gradient of :func:`mpidist.nn.fused.layer_norm_backward`."""
    dy, x, w, mean, rstd = _dev(dy), _dev(x), _dev(w), _dev(mean), _dev(rstd)
    dx = cuda.device_array(x.shape, dtype=x.dtype)
    _layer_norm_dx[_grid(x.shape[0])](dy, x, w, mean, rstd, dx)
    return dx


def layer_norm_backward_dwdb(dy: Any, x: Any, mean: Any, rstd: Any, dw: Any, db: Any) -> None:
    """Its parameter gradients (``+=``), a kernel of its own."""
    _layer_norm_dwdb[_grid(x.shape[1])](_dev(dy), _dev(x), _dev(mean), _dev(rstd), _dev(dw),
                                        _dev(db))


# -- GELU with the bias add -----------------------------------------------------------------
@cuda.jit
def _bias_gelu(h, b, has_bias, y):  # pragma: no cover - device code
    n, f = h.shape
    for e in range(cuda.grid(1), n * f, cuda.gridsize(1)):
        i = e // f
        j = e - i * f
        v = h[i, j]
        if has_bias:
            v += b[j]
            h[i, j] = v
        t = math.tanh(GELU_C * (v + GELU_A * v * v * v))
        y[i, j] = 0.5 * v * (1.0 + t)


@cuda.jit
def _gelu_backward(h, dy, out, y, want_y):  # pragma: no cover - device code
    n, f = h.shape
    for e in range(cuda.grid(1), n * f, cuda.gridsize(1)):
        i = e // f
        j = e - i * f
        v = h[i, j]
        t = math.tanh(GELU_C * (v + GELU_A * v * v * v))
        if want_y:
            y[i, j] = 0.5 * v * (1.0 + t)
        out[i, j] = dy[i, j] * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * GELU_C
                                * (1.0 + 3.0 * GELU_A * v * v))


@cuda.jit
def _column_sums(a, out):  # pragma: no cover - device code
    n, c = a.shape
    for j in range(cuda.grid(1), c, cuda.gridsize(1)):
        acc = 0.0
        for i in range(n):
            acc += a[i, j]
        out[j] += acc


def bias_gelu(h: Any, b: Any | None = None) -> Any:
    """See :func:`mpidist.nn.fused.bias_gelu`."""
    h = _dev(h)
    y = cuda.device_array(h.shape, dtype=h.dtype)
    bb = _dev(b) if b is not None else cuda.device_array(1, dtype=h.dtype)
    _bias_gelu[_grid(h.size)](h, bb, b is not None, y)
    return y


def bias_gelu_backward(h: Any, dy: Any, db: Any | None = None, inplace: bool = False,
                       output: bool = False) -> Any:
    """See :func:`mpidist.nn.fused.bias_gelu_backward`."""
    h, dy = _dev(h), _dev(dy)
    out = dy if inplace else cuda.device_array(dy.shape, dtype=dy.dtype)
    y = cuda.device_array(h.shape if output else (1, 1), dtype=h.dtype)
    _gelu_backward[_grid(h.size)](h, dy, out, y, output)
    if db is not None:
        _column_sums[_grid(h.shape[1])](out, _dev(db))
    return (out, y) if output else out


# -- cross-entropy --------------------------------------------------------------------------
@cuda.jit
def _cross_entropy(z, targets, lse, nll):  # pragma: no cover - device code
    n, v = z.shape
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        m = z[i, 0]
        for j in range(1, v):
            m = max(m, z[i, j])
        acc = 0.0
        for j in range(v):
            acc += math.exp(z[i, j] - m)
        c = m + math.log(acc)
        lse[i] = c
        nll[i] = c - z[i, targets[i]]


@cuda.jit
def _cross_entropy_backward(z, targets, lse, scale, out):  # pragma: no cover - device code
    n, v = z.shape
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        c = lse[i]
        for j in range(v):
            out[i, j] = scale * math.exp(z[i, j] - c)
        out[i, targets[i]] -= scale


def _targets(t: Any) -> Any:
    return _dev(t) if is_device_array(t) else cuda.to_device(np.asarray(t, dtype=np.int64))


def cross_entropy(z: Any, targets: Any) -> tuple[float, Any]:
    """See :func:`mpidist.nn.fused.cross_entropy`; synchronises to return the sum."""
    z = _dev(z)
    n = z.shape[0]
    lse = cuda.device_array(n, dtype=z.dtype)
    nll = cuda.device_array(n, dtype=np.float64)
    _cross_entropy[_grid(n)](z, _targets(targets), lse, nll)
    return float(np.sum(nll.copy_to_host(), dtype=np.float64)), lse


def cross_entropy_backward(z: Any, targets: Any, lse: Any, scale: float) -> Any:
    """See :func:`mpidist.nn.fused.cross_entropy_backward`."""
    z = _dev(z)
    out = cuda.device_array(z.shape, dtype=z.dtype)
    _cross_entropy_backward[_grid(z.shape[0])](z, _targets(targets), _dev(lse), float(scale),
                                               out)
    return out


# -- embedding ------------------------------------------------------------------------------
@cuda.jit
def _scatter_add(g, ids, dy):  # pragma: no cover - device code
    n, c = dy.shape
    for e in range(cuda.grid(1), n * c, cuda.gridsize(1)):
        i = e // c
        j = e - i * c
        cuda.atomic.add(g, (ids[i], j), dy[i, j])


def embedding_backward(g: Any, ids: Any, dy: Any) -> None:
    """See :func:`mpidist.nn.fused.embedding_backward`."""
    dy = _dev(dy)
    _scatter_add[_grid(dy.size)](_dev(g), _targets(ids), dy)
