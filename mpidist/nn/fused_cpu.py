"""Numba CPU kernels of the layers (``njit(cache=True)``), one pass per chain.

Each kernel fuses a chain that NumPy runs as several passes over memory: the causal softmax
with scale and mask (and its backward from the saved probabilities), layer norm, GELU with
the bias add folded in (and its backward, which can recompute the output), cross-entropy
with its log-softmax, and the embedding's scatter-add. Rows are independent, so the outer
loop is a ``prange``; per-column sums (the LayerNorm parameter gradients) go to one partial
row per chunk of rows, added up at the end in a fixed order, so a result does not depend on
the threads' scheduling. Each kernel is compiled twice, serial and with ``parallel=True``;
the serial one runs unless ``MPIDIST_NN_PARALLEL=1`` is set and Numba has more than one
thread (why: docs/performance.md). Kernels never allocate their outputs (the callers in
:mod:`mpidist.nn.fused` do), so the memory they use is visible to the caller. They run
without the GIL (``nogil``), so another thread of the process (an asynchronous
checkpoint's writer) is not kept waiting for it while they compute.

In float32, ``exp`` (softmax, cross-entropy, and GELU, computed as ``v sigmoid(2 z)`` rather
than with a tanh) is a polynomial with an exponent bit-cast (about 1 ulp): no libm call, so
the loops vectorise. float64 calls libm's ``exp``, accurate to round-off. Not collective.
"""

from __future__ import annotations

import math
import os
import types as pytypes
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

__all__ = [
    "bias_gelu",
    "chunks",
    "gelu",
    "gelu_constants",
    "kernel",
    "FASTMATH",
    "exp_fast",
    "fmax",
    "gelu_backward",
    "gelu_backward_output",
    "causal_softmax",
    "causal_softmax_backward",
    "causal_softmax_recompute",
    "cross_entropy",
    "cross_entropy_backward",
    "embedding_backward",
    "layer_norm",
    "layer_norm_backward",
]

#: The fast-math flags of every kernel. Reassociation lets LLVM vectorise the row
#: reductions; no nnan/ninf, so infinities and NaNs keep their IEEE meaning.
FASTMATH = {"nsz", "arcp", "contract", "reassoc"}
GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715

@intrinsic
def _f32_from_bits(typingctx, bits):  # pragma: no cover - compiled
    """The float32 whose bit pattern is the int32 ``bits`` (an LLVM bitcast)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


def exp_fast(x):  # pragma: no cover - replaced by the overload below in compiled code
    """``exp`` for compiled code: a vectorisable polynomial in float32 (about 1 ulp, inputs
    clamped to [-87.3, 88.3]), ``math.exp`` in float64."""
    return math.exp(x)


_E_LO, _E_HI = np.float32(-87.3), np.float32(88.3)
_ONE = np.float32(1.0)
_LOG2E, _HALF = np.float32(1.4426950408889634), np.float32(0.5)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(
    8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(
    5.0000001201e-1)


@overload(exp_fast, jit_options={"fastmath": FASTMATH, "error_model": "numpy"})
def _exp_fast_impl(x):  # pragma: no cover - compiled
    if isinstance(x, types.Float) and x.bitwidth == 32:

        def impl32(x):
            # Cephes expf: exp(x) = 2^k exp(r), r = x - k ln2 in [-ln2/2, ln2/2].
            v = min(max(x, _E_LO), _E_HI)
            k = np.floor(v * _LOG2E + _HALF)
            r = v - k * _LN2_HI - k * _LN2_LO
            p = _P0 * r + _P1
            p = p * r + _P2
            p = p * r + _P3
            p = p * r + _P4
            p = p * r + _P5
            p = p * r * r + r + _ONE
            return p * _f32_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))

        return impl32

    def impl64(x):
        return math.exp(x)

    return impl64


@intrinsic
def fmax(typingctx, a, b):  # pragma: no cover - compiled
    """``max(a, b)`` of two floats of one type as LLVM's ``maxnum``: a running maximum over
    a loop then vectorises (Python's ``max`` compiles to a compare and branch that LLVM
    leaves scalar: 12x slower over a float32 row here; the cross-entropy's rows of 256
    logits 0.39 -> 0.32 ms for 2048 rows). A NaN operand yields the other."""
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, signature, args):
        ft = context.get_value_type(signature.return_type)
        name = "llvm.maxnum.f32" if a.bitwidth == 32 else "llvm.maxnum.f64"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ft, [ft, ft]), name)
        return builder.call(fn, args)

    return a(a, b), codegen


class _Kernel:
    """A kernel compiled serial and parallel (each with its own cache entry); a call runs
    the parallel one only when Numba has more than one thread."""

    def __init__(self, fn: Callable[..., Any], fastmath: Any) -> None:
        opts = {"cache": True, "error_model": "numpy", "fastmath": fastmath, "nogil": True}
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__
        self.serial = njit(**opts)(fn)
        # A copy under another qualified name, so the two compilations do not share an
        # entry in Numba's on-disk cache.
        par = pytypes.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_parallel",
                                   fn.__defaults__, fn.__closure__)
        par.__qualname__ = fn.__qualname__ + "_parallel"
        self.parallel = njit(parallel=True, **opts)(par)

    def __call__(self, *args: Any) -> Any:
        use_parallel = FORCE_PARALLEL
        if use_parallel is None:
            use_parallel = PARALLEL and numba.get_num_threads() > 1
        return (self.parallel if use_parallel else self.serial)(*args)


#: Whether the parallel kernels may run (``MPIDIST_NN_PARALLEL=1``; then only when Numba has
#: more than one thread).
PARALLEL = os.environ.get("MPIDIST_NN_PARALLEL", "0") == "1"
#: ``None``: as :data:`PARALLEL` says; ``True``/``False``: always or never (``warm_up``
#: compiles both).
FORCE_PARALLEL: bool | None = None


def kernel(fastmath: Any = FASTMATH) -> Callable[[Callable[..., Any]], _Kernel]:
    """Decorator: :class:`_Kernel` of the function."""
    return lambda fn: _Kernel(fn, fastmath)


def chunks(n: int) -> int:
    """Number of row chunks for partial column sums: one per Numba thread, at most ``n``."""
    return max(1, min(n, numba.get_num_threads()))


# -- causal softmax -------------------------------------------------------------------------
@kernel()
def causal_softmax(s, scale, lse):  # pragma: no cover - compiled
    """In place on ``s`` (R, T, T): row i of each matrix becomes softmax(scale * s[:i+1])
    followed by zeros; ``lse`` (R, T) receives each row's log-sum-exp of the scaled row.
    Sums run in the dtype of ``s`` (a float64 sum of float32 terms halves the vector width)."""
    nmat, t = s.shape[0], s.shape[1]
    zero = s.dtype.type(0)
    for r in prange(nmat):
        for i in range(t):
            row = s[r, i]
            m = row[0]
            # Python's max here: with rows that stop at the diagonal, fmax (which vectorises)
            # measured 10% slower over (64, 128, 128) scores, the vector loop rarely entered.
            for j in range(1, i + 1):
                m = max(m, row[j])
            ms = m * scale
            acc = zero
            for j in range(i + 1):
                e = exp_fast(row[j] * scale - ms)
                row[j] = e
                acc += e
            inv = 1 / acc
            for j in range(i + 1):
                row[j] *= inv
            for j in range(i + 1, t):
                row[j] = zero
            lse[r, i] = ms + math.log(acc)


@kernel()
def causal_softmax_backward(p, dp, scale):  # pragma: no cover - compiled
    """From the probabilities ``p`` (R, T, T; zero above the diagonal) and ``dp = dL/dP``:
    ``dp`` becomes ``scale * P * (dp - rowsum(P * dp))``, the gradient of the unscaled
    scores, zero above the diagonal."""
    nmat, t = p.shape[0], p.shape[1]
    zero = p.dtype.type(0)
    for r in prange(nmat):
        for i in range(t):
            prow = p[r, i]
            drow = dp[r, i]
            dot = zero
            for j in range(i + 1):
                dot += prow[j] * drow[j]
            for j in range(i + 1):
                drow[j] = scale * prow[j] * (drow[j] - dot)
            for j in range(i + 1, t):
                drow[j] = zero


@kernel()
def causal_softmax_recompute(s, lse, scale):  # pragma: no cover - compiled
    """In place on the raw scores ``s`` (R, T, T): row i becomes the probabilities
    ``exp(scale * s[:i+1] - lse[i])`` followed by zeros (what :func:`causal_softmax` left)."""
    nmat, t = s.shape[0], s.shape[1]
    zero = s.dtype.type(0)
    for r in prange(nmat):
        for i in range(t):
            row = s[r, i]
            c = lse[r, i]
            for j in range(i + 1):
                row[j] = exp_fast(row[j] * scale - c)
            for j in range(i + 1, t):
                row[j] = zero


# -- layer norm -----------------------------------------------------------------------------
@kernel()
def layer_norm(x, w, b, eps, out, mean, rstd):  # pragma: no cover - compiled
    """``out = (x - mean) * rstd * w + b`` over the rows of ``x`` (N, C); saves mean, rstd.
    Sums run in the dtype of ``x``, as in the other kernels."""
    n, c = x.shape
    zero = x.dtype.type(0)
    for i in prange(n):
        row = x[i]
        acc = zero
        for j in range(c):
            acc += row[j]
        mu = acc / c
        var = zero
        for j in range(c):
            d = row[j] - mu
            var += d * d
        rs = 1 / math.sqrt(var / c + eps)
        o = out[i]
        for j in range(c):
            o[j] = (row[j] - mu) * rs * w[j] + b[j]
        mean[i] = mu
        rstd[i] = rs


@kernel()
def layer_norm_backward(dy, x, w, mean, rstd, dx, dw, db, part):  # pragma: no cover
    """``dx`` from ``dy``; ``dw += sum(dy * xhat)``, ``db += sum(dy)`` over rows. ``part``
    (chunks, 2, C) holds zeros on entry (one partial row per chunk of rows)."""
    n, c = x.shape
    nch = part.shape[0]
    zero = x.dtype.type(0)
    for k in prange(nch):
        pw = part[k, 0]
        pb = part[k, 1]
        for i in range(k * n // nch, (k + 1) * n // nch):
            mu = mean[i]
            rs = rstd[i]
            xr = x[i]
            g = dy[i]
            m1 = zero
            m2 = zero
            for j in range(c):
                xh = (xr[j] - mu) * rs
                gj = g[j]
                pw[j] += gj * xh
                pb[j] += gj
                gw = gj * w[j]
                m1 += gw
                m2 += gw * xh
            m1 /= c
            m2 /= c
            d = dx[i]
            for j in range(c):
                xh = (xr[j] - mu) * rs
                d[j] = (g[j] * w[j] - m1 - xh * m2) * rs
    for k in range(nch):
        for j in range(c):
            dw[j] += part[k, 0, j]
            db[j] += part[k, 1, j]


# -- GELU with the bias add -----------------------------------------------------------------
# gelu_tanh(v) = 0.5 v (1 + tanh(z)) = v sigmoid(2 z), z = c (v + a v^3): one exp_fast and one
# division, no tanh and no branch. Saturation needs no special case: for large 2 z,
# 1 + exp(-2 z) rounds to 1 and s is exactly 1 (so the derivative's 1 - s is 0, as NumPy's
# 1 - tanh^2 is). The exponent is clamped to [-80, 80], which keeps exp(-2 z) and s normal
# numbers (arithmetic on subnormals is slow).
_GELU_LIM = 80.0


def gelu_constants(dtype: np.dtype) -> np.ndarray:
    """``[2c, a, 3a, 1, 80]`` in ``dtype``: read from an array, they keep float32 kernels in
    float32 (a Python float literal would promote every operation to float64)."""
    return np.array([2.0 * GELU_C, GELU_A, 3.0 * GELU_A, 1.0, _GELU_LIM], dtype=dtype)


@njit(fastmath=FASTMATH, error_model="numpy", cache=True, nogil=True)
def _sigmoid_2z(v, k):  # pragma: no cover - compiled
    """``sigmoid(2 c (v + a v^3)) = (1 + tanh(c (v + a v^3))) / 2``."""
    z2 = k[0] * (v + k[1] * v * v * v)
    return k[3] / (k[3] + exp_fast(min(max(-z2, -k[4]), k[4])))


@njit(fastmath=FASTMATH, error_model="numpy", cache=True, nogil=True)
def _gelu_slope(v, s, k):  # pragma: no cover - compiled
    """``gelu_tanh'(v) = s + 2c v s (1 - s) (1 + 3a v^2)`` given ``s = _sigmoid_2z(v, k)``."""
    return s + k[0] * v * s * (k[3] - s) * (k[3] + k[2] * v * v)


@kernel()
def gelu(x, y, k):  # pragma: no cover - compiled
    """``y = gelu_tanh(x)``; ``k`` is :func:`gelu_constants` of the dtype."""
    n, f = x.shape
    for i in prange(n):
        xr = x[i]
        yr = y[i]
        for j in range(f):
            v = xr[j]
            yr[j] = v * _sigmoid_2z(v, k)


@kernel()
def bias_gelu(h, b, y, k):  # pragma: no cover - compiled
    """``h += b`` in place (the pre-activation, kept for backward), ``y = gelu_tanh(h)``;
    ``k`` is :func:`gelu_constants` of the dtype."""
    n, f = h.shape
    for i in prange(n):
        hr = h[i]
        yr = y[i]
        for j in range(f):
            v = hr[j] + b[j]
            hr[j] = v
            yr[j] = v * _sigmoid_2z(v, k)


@kernel()
def gelu_backward(h, dy, k):  # pragma: no cover - compiled
    """``dy`` becomes ``dy * gelu_tanh'(h)`` in place (:func:`_gelu_slope`, the sigmoid
    recomputed from ``h``); ``k`` is :func:`gelu_constants`. The bias gradient, a column
    sum, is left to the caller: accumulating it here costs more than a separate pass."""
    n, f = h.shape
    for i in prange(n):
        hr = h[i]
        g = dy[i]
        for j in range(f):
            v = hr[j]
            g[j] = g[j] * _gelu_slope(v, _sigmoid_2z(v, k), k)


@kernel()
def gelu_backward_output(h, dy, y, k):  # pragma: no cover - compiled
    """:func:`gelu_backward` that also writes the forward's output ``gelu_tanh(h)`` into
    ``y`` from the same sigmoid, for a caller that did not keep it."""
    n, f = h.shape
    for i in prange(n):
        hr = h[i]
        g = dy[i]
        yr = y[i]
        for j in range(f):
            v = hr[j]
            s = _sigmoid_2z(v, k)
            yr[j] = v * s
            g[j] = g[j] * _gelu_slope(v, s, k)


# -- cross-entropy --------------------------------------------------------------------------
@kernel()
def cross_entropy(z, targets, lse):  # pragma: no cover - compiled
    """Sum over rows of ``lse - z[target]`` (float64); ``lse`` (N,) receives each row's
    log-sum-exp."""
    n, v = z.shape
    zero = z.dtype.type(0)
    total = 0.0
    for i in prange(n):
        row = z[i]
        m = row[0]
        for j in range(1, v):
            m = fmax(m, row[j])
        acc = zero
        for j in range(v):
            acc += exp_fast(row[j] - m)
        c = m + math.log(acc)
        lse[i] = c
        total += c - row[targets[i]]
    return total


@kernel()
def cross_entropy_backward(z, targets, lse, scale, out):  # pragma: no cover - compiled
    """``out = scale * (softmax(z) - onehot(targets))`` from the saved log-sum-exp."""
    n, v = z.shape
    for i in prange(n):
        row = z[i]
        o = out[i]
        c = lse[i]
        for j in range(v):
            o[j] = scale * exp_fast(row[j] - c)
        o[targets[i]] -= scale


# -- embedding ------------------------------------------------------------------------------
@kernel(fastmath=False)
def embedding_backward(g, ids, dy, nch):  # pragma: no cover - compiled
    """``g[ids[i]] += dy[i]`` for every row i, in row order (repeated ids accumulate).
    Threads split the columns into ``nch`` blocks, so no two write the same element."""
    n, c = dy.shape
    for k in prange(nch):
        lo = k * c // nch
        hi = (k + 1) * c // nch
        for i in range(n):
            gr = g[ids[i]]
            dr = dy[i]
            for j in range(lo, hi):
                gr[j] += dr[j]
