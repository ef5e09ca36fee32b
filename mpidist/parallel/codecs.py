"""Gradient codecs of :mod:`mpidist.parallel.compression`: 16-bit floats (``fp16`` with a
per-chunk power-of-two scale, ``bf16``), top-k with error feedback and PowerSGD with error
feedback. Pure NumPy, no communication; tested on their own."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

__all__ = ["PowerSGDCodec", "TopKCodec", "bf16_decode", "bf16_encode", "decode16", "encode16"]


# -- 16-bit codecs ------------------------------------------------------------------------------
def bf16_encode(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of ``x``, rounded to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bits."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


# fp16 chunks carry a power-of-two scale so that small gradients (the global normaliser
# makes them ~1/B) do not underflow the 6e-8 subnormal floor: scaled so |max| ~ 2**14.
_FP16_TARGET = 14


def encode16(x: np.ndarray, kind: str, out: np.ndarray) -> None:
    """Encode ``x`` into ``out[:-1]`` (uint16) with its scale exponent in ``out[-1]``."""
    if kind == "bf16":
        out[:-1] = bf16_encode(x)
        out[-1] = 0
        return
    amax = float(np.max(np.abs(x))) if x.size else 0.0
    e = 0
    if amax > 0 and math.isfinite(amax):
        e = int(np.clip(_FP16_TARGET - math.frexp(amax)[1], -30000, 30000))
    out[:-1] = np.ldexp(x, e).astype(np.float16).view(np.uint16)
    out[-1] = np.array(e, dtype=np.int16).view(np.uint16)


def decode16(bits: np.ndarray, kind: str, dtype: np.dtype) -> np.ndarray:
    if kind == "bf16":
        return bf16_decode(bits[:-1]).astype(dtype)
    e = int(bits[-1:].view(np.int16)[0])
    return np.ldexp(bits[:-1].view(np.float16).astype(dtype), -e)


# -- error-feedback codecs (pure NumPy, no communication; tested on their own) -----------------
class TopKCodec:
    """Top-k sparsification with error feedback for one bucket.

    ``compress(grad)`` adds the residual to ``grad``, keeps the ``k`` entries of largest
    magnitude, and stores what was not sent as the new residual, so over any number of
    steps ``sum(sent) + residual == sum(grads)`` (exactly, per element). Indices are int32
    (int64 for buckets of 2**31 elements or more).
    """

    def __init__(self, size: int, ratio: float, dtype: np.dtype) -> None:
        self.size = int(size)
        self.k = max(1, min(self.size, int(math.ceil(ratio * self.size))))
        self.index_dtype = np.dtype(np.int32 if self.size < 2**31 else np.int64)
        self.residual = np.zeros(self.size, dtype=dtype)

    def compress(self, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        acc = self.residual
        acc += grad
        if self.k == self.size:
            idx = np.arange(self.size, dtype=self.index_dtype)
        else:
            idx = np.argpartition(np.abs(acc), self.size - self.k)[self.size - self.k:]
            idx = np.sort(idx).astype(self.index_dtype)
        vals = acc[idx]
        acc[idx] = 0
        return idx, vals

    def decompress_sum(self, idx: np.ndarray, vals: np.ndarray, out: np.ndarray) -> None:
        """``out`` = the dense sum of every rank's (index, value) pairs, in rank order."""
        dense = np.bincount(idx, weights=vals, minlength=self.size)
        out[:] = dense[: self.size]


class PowerSGDCodec:
    """PowerSGD (Vogels et al., 2019) state for one bucket: rank-r factors with warm start.

    Two-dimensional tensors whose factors are smaller than the tensor (``r*(a+b) < a*b``)
    are compressed; everything else in the bucket (biases, norms, padding, small matrices)
    is sent dense, as in the paper. For a compressed matrix M (gradient + residual):
    ``P = M Q`` (summed over ranks), ``P̂ = orth(P)``, ``Q = Mᵀ P̂`` (summed), result
    ``P̂ Qᵀ``; the residual keeps ``M - P̂ (Mᵀ P̂)ᵀ``, this rank's unsent part, and the
    summed Q is the next step's warm start.
    """

    def __init__(self, layout: Any, bucket: Any, rank: int, dtype: np.dtype, seed: int) -> None:
        self.start = bucket.start
        self.size = bucket.stop - bucket.start
        self.rank = int(rank)
        self.residual = np.zeros(self.size, dtype=dtype)
        self.matrices: list[tuple[str, int, int, int]] = []  # name, offset in bucket, a, b
        self.qs: list[np.ndarray] = []
        covered = np.zeros(self.size, dtype=bool)
        for name in sorted(bucket.names, key=lambda n: layout.spec(n).offset):
            spec = layout.spec(name)
            if len(spec.shape) < 2:
                continue
            a, b = spec.shape[0], int(np.prod(spec.shape[1:]))
            if self.rank * (a + b) >= a * b:
                continue
            off = spec.offset - self.start
            self.matrices.append((name, off, a, b))
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            self.qs.append(rng.standard_normal((b, self.rank)).astype(dtype))
            covered[off:off + a * b] = True
        self.dense_index = np.flatnonzero(~covered)
        self._dense_runs = _runs(self.dense_index)
        self.p_size = sum(a * self.rank for _, _, a, _ in self.matrices)
        self.q_size = sum(b * self.rank for _, _, _, b in self.matrices)

    def _views(self, flat: np.ndarray) -> list[np.ndarray]:
        return [flat[off:off + a * b].reshape(a, b) for _, off, a, b in self.matrices]

    def gather_dense(self, grad: np.ndarray) -> np.ndarray:
        return np.concatenate([grad[s:e] for s, e in self._dense_runs]) if self._dense_runs \
            else np.zeros(0, dtype=grad.dtype)

    def scatter_dense(self, dense: np.ndarray, out: np.ndarray) -> None:
        pos = 0
        for s, e in self._dense_runs:
            out[s:e] = dense[pos:pos + e - s]
            pos += e - s

    def compute_p(self, grad: np.ndarray) -> np.ndarray:
        """Add the gradient to the residual (error feedback) and return the packed M Q."""
        self.residual += grad
        ps = [m @ q for m, q in zip(self._views(self.residual), self.qs, strict=True)]
        return np.concatenate([p.reshape(-1) for p in ps]) if ps \
            else np.zeros(0, dtype=grad.dtype)

    def compute_q(self, p_sum: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """Orthonormalise the summed P factors; return them and the packed local Mᵀ P̂."""
        phats, qs, pos = [], [], 0
        for m, (_, _, a, _) in zip(self._views(self.residual), self.matrices, strict=True):
            p = p_sum[pos:pos + a * self.rank].reshape(a, self.rank)
            pos += a * self.rank
            # Householder QR: deterministic (same bits on every rank) and stable for
            # rank-deficient P, unlike Gram-Schmidt.
            phat = np.linalg.qr(p)[0]
            phats.append(phat)
            qs.append(m.T @ phat)
        packed = np.concatenate([q.reshape(-1) for q in qs]) if qs \
            else np.zeros(0, dtype=p_sum.dtype)
        return phats, packed

    def finish(self, phats: list[np.ndarray], q_local: np.ndarray, q_sum: np.ndarray,
               out: np.ndarray) -> None:
        """Write the summed low-rank gradients into ``out``; keep the residual and warm start.

        ``out`` is this bucket of the gradient buffer; its dense part is filled separately.
        """
        pos = 0
        for j, (m, phat, (_, off, a, b)) in enumerate(
                zip(self._views(self.residual), phats, self.matrices, strict=True)):
            ql = q_local[pos:pos + b * self.rank].reshape(b, self.rank)
            qs = q_sum[pos:pos + b * self.rank].reshape(b, self.rank)
            pos += b * self.rank
            m -= phat @ ql.T
            out[off:off + a * b] = (phat @ qs.T).reshape(-1)
            self.qs[j] = qs.copy()
        # Dense entries are sent exactly: nothing of them is left over.
        self.residual[self.dense_index] = 0


def _runs(index: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous [start, stop) runs of a sorted index array."""
    if index.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(index) != 1)
    starts = np.concatenate([[index[0]], index[breaks + 1]])
    stops = np.concatenate([index[breaks], [index[-1]]]) + 1
    return [(int(s), int(e)) for s, e in zip(starts, stops, strict=True)]


