"""Causal attention as one Numba kernel per direction: a head's products and softmax in cache.

The loop runs over heads, and for each head over blocks of ``rows`` query rows
(:data:`mpidist.nn.fused.ATTENTION_ROWS`): the block's scores (one BLAS product through
:func:`blas.gemm <mpidist.nn.blas.gemm>`, against the head's keys transposed beforehand:
BLAS runs ``A @ B`` of these shapes half as fast again as ``A @ B.T``), their softmax while
they are still in cache, then the block's output rows. Backward likewise: the block's
``dP``, the softmax backward in place, its ``dQ``; then ``dK`` and ``dV`` of the head. Every
product only covers the keys at or before the last query of its rows (the causal mask); the
products with P or dS run in sub-blocks of ``sub`` rows
(:data:`mpidist.nn.fused.ATTENTION_PRODUCT_ROWS`). Why and how fast: docs/performance.md.

The softmax loops of a block's rows run to the block's last key, masking the entries above
the diagonal with a select rather than stopping at the diagonal, so that LLVM vectorises
them (64 float32 lanes at a time; rows stopping at the diagonal ran mostly scalar). Row
maxima use :func:`fmax <mpidist.nn.fused_cpu.fmax>`, which vectorises.

The probabilities P of every head are written (zero above the diagonal) where the caller
keeps them for backward; otherwise the forward leaves only each row's log-sum-exp and the
backward recomputes the head's P into a (T, T) scratch array. Results equal those of the NumPy
code to float round-off: the same products in the same blocks, the same softmax formulas.
Only called where :data:`mpidist.nn.blas.AVAILABLE`. The kernels run without the GIL
(``nogil``). Not collective.
"""

from __future__ import annotations

import math

from numba import njit

from .blas import NO_TRANS, TRANS, gemm
from .fused_cpu import FASTMATH, exp_fast, fmax

__all__ = ["attention_backward", "attention_forward"]

_OPTS = {"cache": True, "error_model": "numpy", "fastmath": FASTMATH, "nogil": True}


@njit(**_OPTS)
def _softmax_rows(s, lo, hi, scale, lse):  # pragma: no cover - compiled
    """Rows ``lo:hi`` of the scores ``s`` (T, T), valid in columns ``[0, hi)``: row i becomes
    ``softmax(scale * s[i, :i+1])``, then zeros to the end of the row; ``lse[i]`` its
    log-sum-exp."""
    t = s.shape[1]
    zero = s.dtype.type(0)
    low = s.dtype.type(-math.inf)
    for i in range(lo, hi):
        row = s[i]
        m = low
        for j in range(hi):
            m = fmax(m, row[j] if j <= i else low)
        ms = m * scale
        acc = zero
        for j in range(hi):
            e = exp_fast(row[j] * scale - ms)
            e = e if j <= i else zero
            row[j] = e
            acc += e
        inv = 1 / acc
        for j in range(hi):
            row[j] *= inv
        for j in range(hi, t):
            row[j] = zero
        lse[i] = ms + math.log(acc)


@njit(**_OPTS)
def _recompute_rows(s, lo, hi, scale, lse):  # pragma: no cover - compiled
    """Rows ``lo:hi`` of the raw scores ``s`` become the probabilities that
    :func:`_softmax_rows` left, from its log-sum-exp."""
    t = s.shape[1]
    zero = s.dtype.type(0)
    for i in range(lo, hi):
        row = s[i]
        c = lse[i]
        for j in range(hi):
            e = exp_fast(row[j] * scale - c)
            row[j] = e if j <= i else zero
        for j in range(hi, t):
            row[j] = zero


@njit(**_OPTS)
def _softmax_backward_rows(p, dp, lo, hi, scale):  # pragma: no cover - compiled
    """Rows ``lo:hi`` of ``dp`` (valid in columns ``[0, hi)``) become the gradient of the
    unscaled scores, ``scale * P * (dp - rowsum(P * dp))``, zero above the diagonal."""
    zero = p.dtype.type(0)
    for i in range(lo, hi):
        prow = p[i]
        drow = dp[i]
        dot = zero
        for j in range(hi):
            dot += prow[j] * drow[j] if j <= i else zero
        for j in range(hi):
            g = scale * prow[j] * (drow[j] - dot)
            drow[j] = g if j <= i else zero


@njit(**_OPTS)
def _sizes(qkv, n_head):  # pragma: no cover - compiled
    """B, T, 3 C, C, D of ``qkv`` (B, T, 3 C) with ``n_head`` heads, and 1 and 0 in its
    dtype."""
    bsz, t, c3 = qkv.shape
    return bsz, t, c3, c3 // 3, c3 // 3 // n_head, qkv.dtype.type(1), qkv.dtype.type(0)


@njit(**_OPTS)
def _head(b, h, t, c3, n_head, keep):  # pragma: no cover - compiled
    """Element offsets of head ``h`` of sequence ``b``: its queries in ``qkv`` (keys and
    values follow at +C and +2C), its rows of the (B, T, C) output or output gradient, its
    (B, H, T, T) probabilities (index and offset; the one scratch block unless ``keep``)
    and its (B, H, D, T) transposed keys or values."""
    c = c3 // 3
    d = c // n_head
    ph = b * n_head + h if keep else 0
    return (b * t * c3 + h * d, b * t * c + h * d, ph, ph * t * t,
            (b * n_head + h) * d * t)


@njit(**_OPTS)
def attention_forward(qkv, kt, n_head, scale, p, keep, lse, y, rows,
                      sub):  # pragma: no cover - compiled
    """Causal attention of ``qkv`` (B, T, 3 C; columns q | k | v, head-major) into ``y``
    (B, T, C), the scores and softmax in blocks of ``rows`` query rows, the products with
    P in blocks of ``sub`` rows; ``kt`` (B, H, D, T) holds the keys of every head
    transposed. ``p`` is (B, H, T, T) and receives every head's probabilities when
    ``keep``; otherwise it is one (1, 1, T, T) scratch block. ``lse`` (B, H, T) receives
    each score row's log-sum-exp. All arrays C-contiguous, of one dtype."""
    bsz, t, c3, c, d, one, zero = _sizes(qkv, n_head)
    for b in range(bsz):
        for h in range(n_head):
            q0, y0, ph, p0, kt0 = _head(b, h, t, c3, n_head, keep)
            v0 = q0 + 2 * c
            ps = p[ph // n_head, ph % n_head]
            for lo in range(0, t, rows):
                hi = min(t, lo + rows)
                gemm(NO_TRANS, NO_TRANS, hi - lo, hi, d, one, qkv, q0 + lo * c3, c3, kt, kt0,
                     t, zero, p, p0 + lo * t, t)
                _softmax_rows(ps, lo, hi, scale, lse[b, h])
                for a in range(lo, hi, sub):
                    e = min(hi, a + sub)
                    gemm(NO_TRANS, NO_TRANS, e - a, d, e, one, p, p0 + a * t, t, qkv, v0, c3,
                         zero, y, y0 + a * c, c)


@njit(**_OPTS)
def attention_backward(qkv, kt, vt, dy, n_head, scale, p, keep, lse, dp, da, rows,
                       sub):  # pragma: no cover - compiled
    """Gradient ``da`` (B, T, 3 C) of :func:`attention_forward`'s ``qkv`` from that of its
    output ``dy`` (B, T, C), in the blocks of the forward. ``vt`` (B, H, D, T): the values
    transposed; ``kt``: the keys transposed where ``keep`` is False (else unused). ``p``:
    the kept probabilities (B, H, T, T) when ``keep``, else a (1, 1, T, T) scratch block
    that the head's P is recomputed into from ``lse``; ``dp``: a (T, T) scratch block. All
    arrays C-contiguous, of one dtype."""
    bsz, t, c3, c, d, one, zero = _sizes(qkv, n_head)
    for b in range(bsz):
        for h in range(n_head):
            q0, g0, ph, p0, t0 = _head(b, h, t, c3, n_head, keep)
            k0 = q0 + c
            v0 = q0 + 2 * c
            ps = p[ph // n_head, ph % n_head]
            if not keep:
                for lo in range(0, t, rows):
                    hi = min(t, lo + rows)
                    gemm(NO_TRANS, NO_TRANS, hi - lo, hi, d, one, qkv, q0 + lo * c3, c3, kt,
                         t0, t, zero, p, lo * t, t)
                    _recompute_rows(ps, lo, hi, scale, lse[b, h])
            for lo in range(0, t, rows):
                hi = min(t, lo + rows)
                # dP = dY V^T, then dS in its place, then dQ = dS K
                gemm(NO_TRANS, NO_TRANS, hi - lo, hi, d, one, dy, g0 + lo * c, c, vt, t0, t,
                     zero, dp, lo * t, t)
                _softmax_backward_rows(ps, dp, lo, hi, scale)
                for a in range(lo, hi, sub):
                    e = min(hi, a + sub)
                    gemm(NO_TRANS, NO_TRANS, e - a, d, e, one, dp, a * t, t, qkv, k0, c3, zero,
                         da, q0 + a * c3, c3)
            for a in range(0, t, sub):
                e = min(t, a + sub)
                # Keys a:e get gradient from queries a: only: dK = dS^T Q, dV = P^T dY.
                gemm(TRANS, NO_TRANS, e - a, d, t - a, one, dp, a * t + a, t, qkv,
                     q0 + a * c3, c3, zero, da, k0 + a * c3, c3)
                gemm(TRANS, NO_TRANS, e - a, d, t - a, one, p, p0 + a * t + a, t, dy,
                     g0 + a * c, c, zero, da, v0 + a * c3, c3)
