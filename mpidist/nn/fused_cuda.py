"""``numba.cuda`` counterparts of the layer kernels in :mod:`mpidist.nn.fused_cpu`.

Same functions, same arguments and results as :mod:`mpidist.nn.fused` (which dispatches
here for arrays with ``__cuda_array_interface__``), same formulas, laid out for a GPU:

- **Row-wise chains** (causal softmax forward, backward and recomputation, layer norm and
  its input gradient, cross-entropy and its gradient): one thread block per row (the grid
  strides over the rows when there are more rows than blocks), the block's threads strided
  over the row's columns, so that neighbouring threads read neighbouring elements. Row
  maxima, sums, the layer norm's mean and variance (two passes, as on the CPU) and the dot
  products are tree reductions over the block in shared memory.
- **Column sums** (the layer norm's weight and bias gradients, the bias gradient of GELU):
  2-D blocks of :data:`TILE_COLS` columns by :data:`TILE_ROWS` rows; each block sums
  :data:`PART_ROWS` rows of its columns into one partial row (a tree over the block's rows
  in shared memory), and a second kernel adds the partial rows up column by column in
  their order. No floating-point atomics: a result does not depend on the scheduling.
- **Element-wise** GELU and its gradient: a grid-stride loop over the elements.
- **Embedding scatter-add**: atomic adds (repeated ids in one batch make the summation
  order unspecified, the one kernel here whose result may vary in the last bits). Atomic
  adds of float16 do not exist in numba-cuda: a float16 table is updated by one thread per
  column walking the rows in order (deterministic, but parallel over the columns only).

Dtypes: float16, float32 and float64. float64 arrays accumulate in float64, float32 and
float16 arrays in float32 (a kernel is compiled per accumulator type); float16 outputs are
rounded once from the float32 result. The saved statistics of float16 inputs (the
log-sum-exps, the layer norm's mean and rstd) are float32, as the accumulator, so that
backward does not start from values rounded to 11 bits. Another dtype raises TypeError.

Outputs are new arrays of the input's library: CuPy arrays for CuPy input, Numba device
arrays for Numba device arrays, ``xp.empty`` of the input's ``__array_namespace__()`` for
any other array that has one (Numba device arrays where it has none). Launches are
asynchronous on the default stream except :func:`cross_entropy`, which copies its scalar
back. Under ``NUMBA_ENABLE_CUDASIM=1`` (the tests) the blocks and tiles are small, since the
simulator runs every CUDA thread as a Python thread. Not collective.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numba
import numpy as np

from mpidist.core import arrays, devices
from mpidist.optim.kernels import cuda as K
from mpidist.optim.kernels import is_device_array

from .fused_cpu import GELU_A, GELU_C

cuda = devices.numba_cuda()  # numba.cuda, with NumPy >= 2.5 too

__all__ = [
    "BLOCK",
    "PART_ROWS",
    "TILE_COLS",
    "TILE_ROWS",
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

_SIMULATED = bool(numba.config.ENABLE_CUDASIM)
#: Threads per block of the row-wise and element-wise kernels (a power of two).
BLOCK = 16 if _SIMULATED else 256
#: Columns (one warp: coalesced reads) and rows of a column-sum block (a power of two).
TILE_COLS, TILE_ROWS = (4, 4) if _SIMULATED else (32, 8)
#: Rows summed into one partial row of a column sum (a multiple of :data:`TILE_ROWS`).
PART_ROWS = 8 if _SIMULATED else 256
# Grid limits; the grid-stride loops cover the rest. Tiny under the simulator, so that the
# tests run those loops (and the simulator starts fewer threads).
_MAX_BLOCKS = 3 if _SIMULATED else 65535
_MAX_FLAT_BLOCKS = 3 if _SIMULATED else 4096

def _dev(x: Any) -> Any:
    # The engine's arrays (CuPy) and these kernels share the default stream: the kernels
    # queue behind the work that made their arguments, so no host wait per argument.
    return K.as_device_array(x, sync=False)


def _accumulator(dtype: Any) -> type:
    """The type the kernels compute in for arrays of ``dtype``."""
    dt = np.dtype(dtype)
    if dt == np.float64:
        return np.float64
    if dt in (np.float32, np.float16):
        return np.float32
    raise TypeError(f"dtype={dt} is not supported by the CUDA layer kernels "
                    "(float16, float32, float64)")


def _stat_dtype(dtype: Any) -> np.dtype:
    """dtype of saved per-row statistics: float32 for float16 data, else the data's."""
    return np.dtype(_accumulator(dtype)) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


def _is_numba(x: Any) -> bool:
    # Before asking for a namespace: the simulator's arrays forward every attribute,
    # __array_namespace__ included, to the NumPy array they hold.
    return hasattr(x, "copy_to_host") and hasattr(x, "copy_to_device")


def _empty(like: Any, shape: Any, dtype: Any) -> tuple[Any, Any]:
    """A new array of ``like``'s library (see the module docstring) and its Numba view."""
    if not _is_numba(like):
        try:
            xp = arrays.namespace(like)
        except TypeError:  # a device array of a library with no namespace (torch tensors)
            xp = None
        if xp is not None and xp is not np:
            a = xp.empty(tuple(shape), dtype=np.dtype(dtype))
            return a, _dev(a)
    a = cuda.device_array(tuple(shape), dtype=np.dtype(dtype))
    return a, a


def _rows_grid(rows: int) -> tuple[int, int]:
    return max(1, min(_MAX_BLOCKS, rows)), BLOCK


def _flat_grid(n: int) -> tuple[int, int]:
    return max(1, min(_MAX_FLAT_BLOCKS, (n + BLOCK - 1) // BLOCK)), BLOCK


def _tile_grid(n: int, c: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(number of partial rows, grid, block) of a column sum over ``n`` rows, ``c`` columns."""
    parts = max(1, (n + PART_ROWS - 1) // PART_ROWS)
    tiles = max(1, (c + TILE_COLS - 1) // TILE_COLS)
    return parts, (min(_MAX_BLOCKS, tiles), min(_MAX_BLOCKS, parts)), (TILE_COLS, TILE_ROWS)


# -- block reductions (every thread of the block calls them, and gets the result) ----------
@cuda.jit(device=True)
def _block_sum(sh, v):  # pragma: no cover - device code
    tid = cuda.threadIdx.x
    sh[tid] = v
    cuda.syncthreads()
    w = BLOCK // 2
    while w > 0:
        if tid < w:
            sh[tid] += sh[tid + w]
        cuda.syncthreads()
        w //= 2
    r = sh[0]
    cuda.syncthreads()  # every thread has read sh[0] before the next reduction writes sh
    return r


@cuda.jit(device=True)
def _block_sum2(sh, sh2, v, v2):  # pragma: no cover - device code
    tid = cuda.threadIdx.x
    sh[tid] = v
    sh2[tid] = v2
    cuda.syncthreads()
    w = BLOCK // 2
    while w > 0:
        if tid < w:
            sh[tid] += sh[tid + w]
            sh2[tid] += sh2[tid + w]
        cuda.syncthreads()
        w //= 2
    r, r2 = sh[0], sh2[0]
    cuda.syncthreads()
    return r, r2


@cuda.jit(device=True)
def _block_max(sh, v):  # pragma: no cover - device code
    tid = cuda.threadIdx.x
    sh[tid] = v
    cuda.syncthreads()
    w = BLOCK // 2
    while w > 0:
        if tid < w:
            sh[tid] = max(sh[tid], sh[tid + w])
        cuda.syncthreads()
        w //= 2
    r = sh[0]
    cuda.syncthreads()
    return r


@cuda.jit(device=True)
def _tile_sum(sh, sh2, v, v2):  # pragma: no cover - device code
    """Sums over threadIdx.y of a (TILE_ROWS, TILE_COLS) block, per column (threadIdx.x)."""
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    sh[ty, tx] = v
    sh2[ty, tx] = v2
    cuda.syncthreads()
    w = TILE_ROWS // 2
    while w > 0:
        if ty < w:
            sh[ty, tx] += sh[ty + w, tx]
            sh2[ty, tx] += sh2[ty + w, tx]
        cuda.syncthreads()
        w //= 2
    r, r2 = sh[0, tx], sh2[0, tx]
    cuda.syncthreads()
    return r, r2


@cuda.jit(device=True)
def _tile_sum1(sh, v):  # pragma: no cover - device code
    """:func:`_tile_sum` of one value."""
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    sh[ty, tx] = v
    cuda.syncthreads()
    w = TILE_ROWS // 2
    while w > 0:
        if ty < w:
            sh[ty, tx] += sh[ty + w, tx]
        cuda.syncthreads()
        w //= 2
    r = sh[0, tx]
    cuda.syncthreads()
    return r


@cuda.jit
def _add_parts(part, q, out):  # pragma: no cover - device code
    """``out[j] += sum_p part[p, q, j]``, the partial rows added in their order."""
    nparts, c = part.shape[0], part.shape[2]
    for j in range(cuda.grid(1), c, cuda.gridsize(1)):
        acc = part[0, q, j]
        for p in range(1, nparts):
            acc += part[p, q, j]
        out[j] = out[j] + acc


@cuda.jit
def _sum_all(x, out):  # pragma: no cover - device code
    """``out[0] = sum(x)`` by one block, in a fixed order (float64)."""
    sh = cuda.shared.array(BLOCK, dtype=np.float64)
    acc = 0.0
    for i in range(cuda.threadIdx.x, x.shape[0], BLOCK):
        acc += x[i]
    total = _block_sum(sh, acc)
    if cuda.threadIdx.x == 0:
        out[0] = total


# -- causal softmax -------------------------------------------------------------------------
@functools.cache
def _softmax_kernels(A: type) -> tuple[Any, Any, Any]:
    """Forward, backward and recomputation kernels accumulating in ``A``; rows of
    (rows, T) scores, row r being query r % T."""

    @cuda.jit
    def forward(s, scale, lse):  # pragma: no cover - device code
        sh = cuda.shared.array(BLOCK, dtype=A)
        tid = cuda.threadIdx.x
        rows, t = s.shape
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            n = row % t + 1
            m = A(-math.inf)
            for j in range(tid, n, BLOCK):
                m = max(m, A(s[row, j]))
            ms = _block_max(sh, m) * scale
            part = A(0)
            for j in range(tid, n, BLOCK):
                part += math.exp(A(s[row, j]) * scale - ms)
            acc = _block_sum(sh, part)
            inv = A(1) / acc
            # exp again rather than a store and a reload: one write, rounded once
            for j in range(tid, n, BLOCK):
                s[row, j] = math.exp(A(s[row, j]) * scale - ms) * inv
            for j in range(n + tid, t, BLOCK):
                s[row, j] = A(0)
            if tid == 0:
                lse[row] = ms + math.log(acc)

    @cuda.jit
    def backward(p, dp, scale):  # pragma: no cover - device code
        sh = cuda.shared.array(BLOCK, dtype=A)
        tid = cuda.threadIdx.x
        rows, t = p.shape
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            n = row % t + 1
            part = A(0)
            for j in range(tid, n, BLOCK):
                part += A(p[row, j]) * A(dp[row, j])
            dot = _block_sum(sh, part)
            for j in range(tid, n, BLOCK):
                dp[row, j] = scale * A(p[row, j]) * (A(dp[row, j]) - dot)
            for j in range(n + tid, t, BLOCK):
                dp[row, j] = A(0)

    @cuda.jit
    def recompute(s, lse, scale):  # pragma: no cover - device code
        tid = cuda.threadIdx.x
        rows, t = s.shape
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            n = row % t + 1
            c = A(lse[row])
            for j in range(tid, n, BLOCK):
                s[row, j] = math.exp(A(s[row, j]) * scale - c)
            for j in range(n + tid, t, BLOCK):
                s[row, j] = A(0)

    return forward, backward, recompute


def _rows(a: Any) -> tuple[int, int]:
    t = int(tuple(a.shape)[-1])
    return (a.size // t if t else 0), t


def causal_softmax(s: Any, scale: float) -> Any:
    """See :func:`mpidist.nn.fused.causal_softmax` (``s``: contiguous device array)."""
    sd = _dev(s)
    A = _accumulator(sd.dtype)
    rows, t = _rows(sd)
    lse, lsed = _empty(s, tuple(sd.shape)[:-1], _stat_dtype(sd.dtype))
    if rows:
        _softmax_kernels(A)[0][_rows_grid(rows)](sd.reshape(rows, t), A(scale),
                                                 lsed.reshape(rows))
    return lse


def causal_softmax_backward(p: Any, dp: Any, scale: float) -> None:
    """See :func:`mpidist.nn.fused.causal_softmax_backward`."""
    pd, dpd = _dev(p), _dev(dp)
    A = _accumulator(dpd.dtype)
    rows, t = _rows(pd)
    if rows:
        _softmax_kernels(A)[1][_rows_grid(rows)](pd.reshape(rows, t), dpd.reshape(rows, t),
                                                 A(scale))


def causal_softmax_recompute(s: Any, lse: Any, scale: float) -> None:
    """See :func:`mpidist.nn.fused.causal_softmax_recompute`."""
    sd, lsed = _dev(s), _dev(lse)
    A = _accumulator(sd.dtype)
    rows, t = _rows(sd)
    if rows:
        _softmax_kernels(A)[2][_rows_grid(rows)](sd.reshape(rows, t), lsed.reshape(rows),
                                                 A(scale))


# -- layer norm -----------------------------------------------------------------------------
@functools.cache
def _layer_norm_kernels(A: type) -> tuple[Any, Any, Any]:
    """Forward, input-gradient and partial parameter-gradient kernels accumulating in ``A``."""

    @cuda.jit
    def forward(x, w, b, eps, out, mean, rstd):  # pragma: no cover - device code
        sh = cuda.shared.array(BLOCK, dtype=A)
        tid = cuda.threadIdx.x
        rows, c = x.shape
        cn = A(c)
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            part = A(0)
            for j in range(tid, c, BLOCK):
                part += A(x[row, j])
            mu = _block_sum(sh, part) / cn
            # a second pass for the variance, as on the CPU: no cancellation of E[x^2]-mu^2
            part = A(0)
            for j in range(tid, c, BLOCK):
                d = A(x[row, j]) - mu
                part += d * d
            rs = A(1) / math.sqrt(_block_sum(sh, part) / cn + eps)
            for j in range(tid, c, BLOCK):
                out[row, j] = (A(x[row, j]) - mu) * rs * A(w[j]) + A(b[j])
            if tid == 0:
                mean[row] = mu
                rstd[row] = rs

    @cuda.jit
    def dx_kernel(dy, x, w, mean, rstd, dx):  # pragma: no cover - device code
        sh = cuda.shared.array(BLOCK, dtype=A)
        sh2 = cuda.shared.array(BLOCK, dtype=A)
        tid = cuda.threadIdx.x
        rows, c = x.shape
        cn = A(c)
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            mu = A(mean[row])
            rs = A(rstd[row])
            p1 = A(0)
            p2 = A(0)
            for j in range(tid, c, BLOCK):
                gw = A(dy[row, j]) * A(w[j])
                p1 += gw
                p2 += gw * ((A(x[row, j]) - mu) * rs)
            m1, m2 = _block_sum2(sh, sh2, p1, p2)
            m1 /= cn
            m2 /= cn
            for j in range(tid, c, BLOCK):
                xh = (A(x[row, j]) - mu) * rs
                dx[row, j] = (A(dy[row, j]) * A(w[j]) - m1 - xh * m2) * rs

    @cuda.jit
    def dwdb_parts(dy, x, mean, rstd, part):  # pragma: no cover - device code
        shw = cuda.shared.array((TILE_ROWS, TILE_COLS), dtype=A)
        shb = cuda.shared.array((TILE_ROWS, TILE_COLS), dtype=A)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        n, c = x.shape
        ntiles = (c + TILE_COLS - 1) // TILE_COLS
        for p in range(cuda.blockIdx.y, part.shape[0], cuda.gridDim.y):
            hi = min(n, (p + 1) * PART_ROWS)
            for tile in range(cuda.blockIdx.x, ntiles, cuda.gridDim.x):
                j = tile * TILE_COLS + tx
                sw = A(0)
                sb = A(0)
                if j < c:
                    for i in range(p * PART_ROWS + ty, hi, TILE_ROWS):
                        g = A(dy[i, j])
                        sw += g * ((A(x[i, j]) - A(mean[i])) * A(rstd[i]))
                        sb += g
                sw, sb = _tile_sum(shw, shb, sw, sb)
                if ty == 0 and j < c:
                    part[p, 0, j] = sw
                    part[p, 1, j] = sb

    return forward, dx_kernel, dwdb_parts


def layer_norm(x: Any, w: Any, b: Any, eps: float) -> tuple[Any, Any, Any]:
    """See :func:`mpidist.nn.fused.layer_norm` (mean and rstd are float32 for float16 x)."""
    xd = _dev(x)
    A = _accumulator(xd.dtype)
    n = xd.shape[0]
    out, outd = _empty(x, xd.shape, xd.dtype)
    mean, meand = _empty(x, (n,), _stat_dtype(xd.dtype))
    rstd, rstdd = _empty(x, (n,), _stat_dtype(xd.dtype))
    _layer_norm_kernels(A)[0][_rows_grid(n)](xd, _dev(w), _dev(b), A(eps), outd, meand, rstdd)
    return out, mean, rstd


def layer_norm_backward_dx(dy: Any, x: Any, w: Any, mean: Any, rstd: Any) -> Any:
    """The input gradient of :func:`mpidist.nn.fused.layer_norm_backward`."""
    xd = _dev(x)
    A = _accumulator(xd.dtype)
    dx, dxd = _empty(x, xd.shape, xd.dtype)
    _layer_norm_kernels(A)[1][_rows_grid(xd.shape[0])](_dev(dy), xd, _dev(w), _dev(mean),
                                                       _dev(rstd), dxd)
    return dx


def layer_norm_backward_dwdb(dy: Any, x: Any, mean: Any, rstd: Any, dw: Any, db: Any) -> None:
    """Its parameter gradients (``+=``), kernels of their own: partial column sums over
    :data:`PART_ROWS` rows each, then added up in a fixed order."""
    xd = _dev(x)
    A = _accumulator(xd.dtype)
    n, c = xd.shape
    parts, grid, block = _tile_grid(n, c)
    part = _empty(x, (parts, 2, c), A)[1]
    _layer_norm_kernels(A)[2][grid, block](_dev(dy), xd, _dev(mean), _dev(rstd), part)
    _add_parts[_flat_grid(c)](part, 0, _dev(dw))
    _add_parts[_flat_grid(c)](part, 1, _dev(db))


# -- GELU with the bias add -----------------------------------------------------------------
@functools.cache
def _gelu_kernels(A: type) -> tuple[Any, Any, Any]:
    """Forward, backward and bias-gradient partial-sum kernels computing in ``A``."""

    @cuda.jit
    def forward(h, b, has_bias, y):  # pragma: no cover - device code
        n, f = h.shape
        for e in range(cuda.grid(1), n * f, cuda.gridsize(1)):
            i = e // f
            j = e - i * f
            v = A(h[i, j])
            if has_bias:
                v += A(b[j])
                h[i, j] = v
            t = math.tanh(A(GELU_C) * (v + A(GELU_A) * v * v * v))
            y[i, j] = A(0.5) * v * (A(1) + t)

    @cuda.jit
    def backward(h, dy, out, y, want_y):  # pragma: no cover - device code
        n, f = h.shape
        for e in range(cuda.grid(1), n * f, cuda.gridsize(1)):
            i = e // f
            j = e - i * f
            v = A(h[i, j])
            t = math.tanh(A(GELU_C) * (v + A(GELU_A) * v * v * v))
            if want_y:
                y[i, j] = A(0.5) * v * (A(1) + t)
            out[i, j] = A(dy[i, j]) * (A(0.5) * (A(1) + t) + A(0.5) * v * (A(1) - t * t)
                                       * A(GELU_C) * (A(1) + A(3.0 * GELU_A) * v * v))

    @cuda.jit
    def column_parts(a, part):  # pragma: no cover - device code
        sh = cuda.shared.array((TILE_ROWS, TILE_COLS), dtype=A)
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        n, c = a.shape
        ntiles = (c + TILE_COLS - 1) // TILE_COLS
        for p in range(cuda.blockIdx.y, part.shape[0], cuda.gridDim.y):
            hi = min(n, (p + 1) * PART_ROWS)
            for tile in range(cuda.blockIdx.x, ntiles, cuda.gridDim.x):
                j = tile * TILE_COLS + tx
                s = A(0)
                if j < c:
                    for i in range(p * PART_ROWS + ty, hi, TILE_ROWS):
                        s += A(a[i, j])
                s = _tile_sum1(sh, s)
                if ty == 0 and j < c:
                    part[p, 0, j] = s

    return forward, backward, column_parts


def bias_gelu(h: Any, b: Any | None = None) -> Any:
    """See :func:`mpidist.nn.fused.bias_gelu`."""
    hd = _dev(h)
    A = _accumulator(hd.dtype)
    y, yd = _empty(h, hd.shape, hd.dtype)
    # without a bias the kernel reads none: any 1-D array of the dtype stands in for it
    bd = _dev(b) if b is not None else hd.reshape(hd.size)
    _gelu_kernels(A)[0][_flat_grid(hd.size)](hd, bd, b is not None, yd)
    return y


def bias_gelu_backward(h: Any, dy: Any, db: Any | None = None, inplace: bool = False,
                       output: bool = False) -> Any:
    """See :func:`mpidist.nn.fused.bias_gelu_backward`."""
    hd, dyd = _dev(h), _dev(dy)
    A = _accumulator(hd.dtype)
    out, outd = (dy, dyd) if inplace else _empty(dy, dyd.shape, dyd.dtype)
    y, yd = _empty(h, hd.shape, hd.dtype) if output else (None, outd)  # outd: not written
    forward, backward, column_parts = _gelu_kernels(A)
    backward[_flat_grid(hd.size)](hd, dyd, outd, yd, output)
    if db is not None:
        n, c = outd.shape
        parts, grid, block = _tile_grid(n, c)
        part = _empty(h, (parts, 1, c), A)[1]
        column_parts[grid, block](outd, part)
        _add_parts[_flat_grid(c)](part, 0, _dev(db))
    return (out, y) if output else out


# -- cross-entropy --------------------------------------------------------------------------
@functools.cache
def _cross_entropy_kernels(A: type) -> tuple[Any, Any]:
    """Forward (per-row log-sum-exp and NLL) and backward kernels accumulating in ``A``."""

    @cuda.jit
    def forward(z, targets, lse, nll):  # pragma: no cover - device code
        sh = cuda.shared.array(BLOCK, dtype=A)
        tid = cuda.threadIdx.x
        rows, v = z.shape
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            m = A(-math.inf)
            for j in range(tid, v, BLOCK):
                m = max(m, A(z[row, j]))
            m = _block_max(sh, m)
            part = A(0)
            for j in range(tid, v, BLOCK):
                part += math.exp(A(z[row, j]) - m)
            c = m + math.log(_block_sum(sh, part))
            if tid == 0:
                lse[row] = c
                nll[row] = np.float64(c - A(z[row, targets[row]]))

    @cuda.jit
    def backward(z, targets, lse, scale, out):  # pragma: no cover - device code
        tid = cuda.threadIdx.x
        rows, v = z.shape
        for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
            c = A(lse[row])
            t = targets[row]
            for j in range(tid, v, BLOCK):
                g = scale * math.exp(A(z[row, j]) - c)
                if j == t:
                    g -= scale
                out[row, j] = g

    return forward, backward


def _targets(t: Any) -> Any:
    return _dev(t) if is_device_array(t) else cuda.to_device(np.asarray(t, dtype=np.int64))


def cross_entropy(z: Any, targets: Any) -> tuple[float, Any]:
    """See :func:`mpidist.nn.fused.cross_entropy`; synchronises to return the sum, which
    is each row's NLL (float64) added up by one block in a fixed order. The log-sum-exps
    are float32 for float16 ``z``."""
    zd = _dev(z)
    A = _accumulator(zd.dtype)
    n = zd.shape[0]
    lse, lsed = _empty(z, (n,), _stat_dtype(zd.dtype))
    nll = _empty(z, (n,), np.float64)[1]
    total = _empty(z, (1,), np.float64)[1]
    _cross_entropy_kernels(A)[0][_rows_grid(n)](zd, _targets(targets), lsed, nll)
    _sum_all[1, BLOCK](nll, total)
    return float(total.copy_to_host()[0]), lse


def cross_entropy_backward(z: Any, targets: Any, lse: Any, scale: float) -> Any:
    """See :func:`mpidist.nn.fused.cross_entropy_backward`."""
    zd = _dev(z)
    A = _accumulator(zd.dtype)
    out, outd = _empty(z, zd.shape, zd.dtype)
    _cross_entropy_kernels(A)[1][_rows_grid(zd.shape[0])](zd, _targets(targets), _dev(lse),
                                                          A(scale), outd)
    return out


# -- embedding ------------------------------------------------------------------------------
@cuda.jit
def _scatter_add(g, ids, dy):  # pragma: no cover - device code
    n, c = dy.shape
    for e in range(cuda.grid(1), n * c, cuda.gridsize(1)):
        i = e // c
        j = e - i * c
        cuda.atomic.add(g, (ids[i], j), dy[i, j])


@cuda.jit
def _scatter_add_columns(g, ids, dy):  # pragma: no cover - device code
    # float16 tables (no float16 atomics): a thread owns a column and walks the rows in order
    n, c = dy.shape
    for j in range(cuda.grid(1), c, cuda.gridsize(1)):
        for i in range(n):
            r = ids[i]
            g[r, j] = np.float32(g[r, j]) + np.float32(dy[i, j])


def embedding_backward(g: Any, ids: Any, dy: Any) -> None:
    """See :func:`mpidist.nn.fused.embedding_backward` (atomic adds: the order in which
    repeated ids add up is unspecified, except for a float16 ``g``)."""
    gd, dyd = _dev(g), _dev(dy)
    for a in (gd, dyd):
        _accumulator(a.dtype)  # raises for a dtype the other kernels refuse too
    if np.dtype(gd.dtype) == np.float16:
        _scatter_add_columns[_flat_grid(dyd.shape[1])](gd, _targets(ids), dyd)
    else:
        _scatter_add[_flat_grid(dyd.size)](gd, _targets(ids), dyd)
