"""Fused kernels of the layers, with the NumPy reference of each, behind one setting.

The layers hand everything between their matrix products to the functions here: the causal
softmax with scale and mask (forward, a backward from the probabilities the forward left,
and their recomputation from its log-sum-exp), layer norm, GELU with the bias add folded in,
cross-entropy with its log-softmax, and the embedding's scatter-add. Each runs
as one Numba kernel (:mod:`mpidist.nn.fused_cpu`; NumPy arrays) or one ``numba.cuda`` kernel
(:mod:`mpidist.nn.fused_cuda`; arrays with ``__cuda_array_interface__``), or as the NumPy
transcription below, which is the reference the kernels are tested against.

Which one runs is set by the environment variable ``MPIDIST_NN_KERNELS`` (``numba``, the
default, or ``numpy``) or at run time by :func:`set_kernels` / :func:`use_kernels`. Without
Numba the NumPy path runs. The Numba kernels run serial unless ``MPIDIST_NN_PARALLEL=1`` (see
:mod:`mpidist.nn.fused_cpu`). No function here communicates.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from mpidist.optim.kernels import is_device_array

from . import blas as _blas

__all__ = [
    "GELU_A",
    "GELU_C",
    "HAVE_NUMBA",
    "attention_backward",
    "attention_forward",
    "attention_kernel_applies",
    "bias_gelu",
    "bias_gelu_backward",
    "causal_softmax",
    "causal_softmax_backward",
    "causal_softmax_recompute",
    "cross_entropy",
    "cross_entropy_backward",
    "embedding_backward",
    "gelu_tanh_backward",
    "get_kernels",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_backward_input",
    "layer_norm_backward_weight",
    "set_kernels",
    "tanh_term",
    "use_kernels",
    "warm_up",
]

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715
_CHOICES = ("numba", "numpy")


def _initial_choice() -> str:
    choice = os.environ.get("MPIDIST_NN_KERNELS", "numba").strip().lower() or "numba"
    if choice not in _CHOICES:
        raise ValueError(f"MPIDIST_NN_KERNELS={choice!r} is not one of {list(_CHOICES)}")
    return choice


try:  # Numba is a dependency of mpidist, but keep the layers usable without it.
    from . import fused_cpu as _cpu
except ImportError:  # pragma: no cover - exercised only without numba
    _cpu = None  # type: ignore[assignment]

HAVE_NUMBA = _cpu is not None
# The attention kernels also need a BLAS they can call (AVAILABLE is False without Numba).
if _blas.AVAILABLE:
    from . import attention_cpu as _attn
else:  # pragma: no cover - exercised only without a callable BLAS
    _attn = None  # type: ignore[assignment]
_choice = _initial_choice()


def get_kernels() -> str:
    """``"numba"`` or ``"numpy"``: the implementation the layers use now."""
    return _choice if HAVE_NUMBA else "numpy"


def set_kernels(name: str) -> None:
    """Choose the implementation for NumPy arrays: ``"numba"`` (fused kernels) or ``"numpy"``.

    Raises ``ValueError`` for another name. Device arrays always take the CUDA kernels.
    """
    global _choice
    if name not in _CHOICES:
        raise ValueError(f"kernels={name!r} is not one of {list(_CHOICES)}")
    _choice = name


@contextlib.contextmanager
def use_kernels(name: str) -> Iterator[None]:
    """Context manager: :func:`set_kernels` ``(name)`` inside the block, then restore."""
    old = _choice
    set_kernels(name)
    try:
        yield
    finally:
        set_kernels(old)


def _on_device(*arrays: Any) -> bool:
    return any(not isinstance(a, np.ndarray) and is_device_array(a) for a in arrays)


def _numba(*arrays: np.ndarray) -> bool:
    """True when the Numba CPU kernels apply: chosen, and one float dtype throughout."""
    if _choice != "numba" or not HAVE_NUMBA:
        return False
    dt = arrays[0].dtype
    return dt in (np.float32, np.float64) and all(a.dtype == dt for a in arrays)


def _c(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a)


def _cuda() -> Any:
    from . import fused_cuda

    return fused_cuda


# -- causal softmax -------------------------------------------------------------------------
_ABOVE: dict[int, np.ndarray] = {}


def _above(t: int) -> np.ndarray:
    """Boolean (T, T): True above the diagonal (the entries the causal mask removes)."""
    m = _ABOVE.get(t)
    if m is None:
        m = _ABOVE[t] = np.triu(np.ones((t, t), dtype=bool), k=1)
    return m


def causal_softmax(s: Any, scale: float) -> Any:
    """In place on scores ``s`` of shape ``(..., T, T)``: row ``i`` of each matrix becomes
    ``softmax(scale * s[i, :i+1])`` followed by zeros (the probabilities P, which
    :func:`causal_softmax_backward` takes). Returns the log-sum-exp of each scaled row,
    shape ``(..., T)``. Entries above the diagonal are never read (they may be left
    uninitialised), here and in the two functions below."""
    if _on_device(s):
        return _cuda().causal_softmax(s, scale)
    t = s.shape[-1]
    if _numba(s) and s.flags.c_contiguous:
        lse = np.empty(s.shape[:-1], dtype=s.dtype)
        _cpu.causal_softmax(s.reshape(-1, t, t), s.dtype.type(scale), lse.reshape(-1, t))
        return lse
    # Every row keeps its diagonal, so the row max is finite and the softmax well defined.
    np.copyto(s, -np.inf, where=_above(t))
    s *= scale
    m = s.max(axis=-1, keepdims=True)
    s -= m
    np.exp(s, out=s)
    acc = s.sum(axis=-1, keepdims=True)
    s /= acc
    np.log(acc, out=acc)
    acc += m
    return acc[..., 0]


def causal_softmax_backward(p: Any, dp: Any, scale: float) -> None:
    """In place: from the probabilities ``p`` that :func:`causal_softmax` left (zero above
    the diagonal) and their gradient ``dp``, ``dp`` becomes the gradient of the unscaled
    scores, ``scale * P * (dp - rowsum(P * dp))``, zero above the diagonal."""
    if _on_device(p, dp):
        return _cuda().causal_softmax_backward(p, dp, scale)
    t = p.shape[-1]
    if _numba(p, dp) and p.flags.c_contiguous and dp.flags.c_contiguous:
        _cpu.causal_softmax_backward(p.reshape(-1, t, t), dp.reshape(-1, t, t),
                                     p.dtype.type(scale))
        return None
    np.copyto(dp, 0, where=_above(t))
    dot = np.sum(p * dp, axis=-1, keepdims=True)
    dp -= dot
    dp *= p
    dp *= scale


def causal_softmax_recompute(s: Any, lse: Any, scale: float) -> None:
    """In place on raw scores ``s`` (..., T, T): the probabilities that
    :func:`causal_softmax` left, from the log-sum-exp it returned (for a caller that kept
    that instead of the T x T probabilities)."""
    if _on_device(s, lse):
        return _cuda().causal_softmax_recompute(s, lse, scale)
    t = s.shape[-1]
    if _numba(s, lse) and s.flags.c_contiguous:
        _cpu.causal_softmax_recompute(s.reshape(-1, t, t), _c(lse).reshape(-1, t),
                                      s.dtype.type(scale))
        return None
    np.copyto(s, -np.inf, where=_above(t))
    s *= scale
    s -= lse[..., None]
    np.exp(s, out=s)


# -- causal attention (one kernel per direction) -------------------------------------------
#: Query rows per block of the attention kernels' scores and softmax, and per block of their
#: products with the probabilities: smaller blocks skip more of the masked products, but
#: products of fewer rows run further from the BLAS's peak, and softmax rows of a length
#: that is no multiple of 64 float32 lanes leave the rest to scalar code.
ATTENTION_ROWS = 64
ATTENTION_PRODUCT_ROWS = 32


def attention_kernel_applies(*arrays: Any) -> bool:
    """Whether :func:`attention_forward`/:func:`attention_backward` run for these arrays: the
    Numba kernels are chosen, a callable BLAS was found (:mod:`mpidist.nn.blas`), and the
    arrays are C-contiguous NumPy arrays of one float dtype. Elsewhere the attention runs as
    NumPy products around :func:`causal_softmax` and :func:`causal_softmax_backward`."""
    return (_attn is not None and _numba(*arrays)
            and all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in arrays))


def _transposed_heads(qkv: np.ndarray, n_head: int, which: int) -> np.ndarray:
    """Block ``which`` (0 q, 1 k, 2 v) of ``qkv`` (B, T, 3 H D) as (B, H, D, T), contiguous:
    one NumPy copy for all heads, twice as fast as a transpose per head in the kernel."""
    b, t, c3 = qkv.shape
    blk = qkv.reshape(b, t, 3, n_head, c3 // (3 * n_head))[:, :, which]
    return np.ascontiguousarray(blk.transpose(0, 2, 3, 1))


def attention_forward(qkv: np.ndarray, n_head: int, scale: float,
                      keep_probabilities: bool) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention of ``qkv`` (B, T, 3 H D) by :mod:`mpidist.nn.attention_cpu`: the
    output (B, T, H D) and what backward needs, the probabilities P (B, H, T, T), zero
    above the diagonal, if ``keep_probabilities``, else each score row's log-sum-exp
    (B, H, T). Only where :func:`attention_kernel_applies`."""
    b, t, c3 = qkv.shape
    dt = qkv.dtype
    p = np.empty((b, n_head, t, t) if keep_probabilities else (1, 1, t, t), dtype=dt)
    lse = np.empty((b, n_head, t), dtype=dt)
    y = np.empty((b, t, c3 // 3), dtype=dt)
    _attn.attention_forward(qkv, _transposed_heads(qkv, n_head, 1), n_head, dt.type(scale), p,
                            keep_probabilities, lse, y, ATTENTION_ROWS,
                            ATTENTION_PRODUCT_ROWS)
    return y, p if keep_probabilities else lse


def attention_backward(dy: np.ndarray, qkv: np.ndarray, kept: np.ndarray, n_head: int,
                       scale: float) -> np.ndarray:
    """Gradient (B, T, 3 H D) of :func:`attention_forward`'s ``qkv`` from that of its output
    ``dy``, given what the forward kept (P or the log-sum-exp). Only where
    :func:`attention_kernel_applies`."""
    t = qkv.shape[1]
    dt = qkv.dtype
    keep = kept.ndim == 4
    p = kept if keep else np.empty((1, 1, t, t), dtype=dt)
    lse = kept if not keep else np.empty((1, 1, t), dtype=dt)
    vt = _transposed_heads(qkv, n_head, 2)
    kt = vt if keep else _transposed_heads(qkv, n_head, 1)
    da = np.empty(qkv.shape, dtype=dt)
    _attn.attention_backward(qkv, kt, vt, _c(dy), n_head, dt.type(scale), p, keep, lse,
                             np.empty((t, t), dtype=dt), da, ATTENTION_ROWS,
                             ATTENTION_PRODUCT_ROWS)
    return da


# -- layer norm -----------------------------------------------------------------------------
def layer_norm(x: Any, w: Any, b: Any, eps: float) -> tuple[Any, Any, Any]:
    """Layer norm of the rows of ``x`` (N, C): ``(out, mean, rstd)``, the last two (N,)."""
    if _on_device(x, w, b):
        return _cuda().layer_norm(x, w, b, eps)
    n = x.shape[0]
    if _numba(x, w, b):
        out = np.empty(x.shape, dtype=x.dtype)
        mean = np.empty(n, dtype=x.dtype)
        rstd = np.empty(n, dtype=x.dtype)
        _cpu.layer_norm(_c(x), _c(w), _c(b), x.dtype.type(eps), out, mean, rstd)
        return out, mean, rstd
    mean = x.mean(axis=-1)
    xc = x - mean[:, None]
    var = np.mean(xc * xc, axis=-1)
    rstd = 1.0 / np.sqrt(var + eps)
    xc *= rstd[:, None]
    xc *= w
    xc += b
    return xc, mean, rstd


def layer_norm_backward(dy: Any, x: Any, w: Any, mean: Any, rstd: Any,
                        dw: Any, db: Any) -> Any:
    """Input gradient of :func:`layer_norm` (a new array); ``dw``, ``db`` accumulate the
    parameter gradients in place."""
    dx, kept = layer_norm_backward_input(dy, x, w, mean, rstd)
    layer_norm_backward_weight(kept, dw, db)
    return dx


def _layer_norm_backward_numpy(dy: Any, x: Any, w: Any, mean: Any, rstd: Any
                               ) -> tuple[Any, Any, Any]:
    """NumPy layer-norm backward: the input gradient and the weight and bias gradients of
    this call (to be added to the accumulated ones)."""
    xhat = x - mean[:, None]
    xhat *= rstd[:, None]
    dw_part, db_part = np.einsum("ij,ij->j", dy, xhat), dy.sum(axis=0)
    g = dy * w
    m2 = np.mean(g * xhat, axis=-1, keepdims=True)
    g -= g.mean(axis=-1, keepdims=True)
    xhat *= m2
    g -= xhat
    g *= rstd[:, None]
    return g, dw_part, db_part


def layer_norm_backward_input(dy: Any, x: Any, w: Any, mean: Any,
                              rstd: Any) -> tuple[Any, tuple]:
    """:func:`layer_norm_backward` split in two: the input gradient (a new array) and what
    :func:`layer_norm_backward_weight` needs to add the parameter gradients later, which
    then equal :func:`layer_norm_backward`'s bit for bit. On the CPU that is the partial
    column sums the fused pass computes anyway (a few rows of C numbers); on a GPU, whose
    two kernels are separate, ``dy`` and the forward's ``x``, ``mean``, ``rstd``."""
    if _on_device(dy, x, w):
        return _cuda().layer_norm_backward_dx(dy, x, w, mean, rstd), ("cuda", dy, x, mean, rstd)
    n, c = x.shape
    if _numba(dy, x, w, mean, rstd):
        dx = np.empty(x.shape, dtype=x.dtype)
        part = np.zeros((_cpu.chunks(n), 2, c))
        unused = np.zeros((2, c), dtype=x.dtype)  # the kernel's own sums of ``part``
        _cpu.layer_norm_backward(_c(dy), _c(x), _c(w), _c(mean), _c(rstd), dx, unused[0],
                                 unused[1], part)
        return dx, ("chunks", part)
    g, dw_part, db_part = _layer_norm_backward_numpy(dy, x, w, mean, rstd)
    return g, ("sums", dw_part, db_part)


def layer_norm_backward_weight(kept: tuple, dw: Any, db: Any) -> None:
    """``dw``, ``db`` accumulate in place the parameter gradients of the
    :func:`layer_norm_backward_input` call that returned ``kept``, in the order
    :func:`layer_norm_backward` adds them."""
    if kept[0] == "cuda":
        _cuda().layer_norm_backward_dwdb(*kept[1:], dw, db)
    elif kept[0] == "chunks":
        part = kept[1]
        for k in range(part.shape[0]):  # as the kernel's last loop: chunk by chunk
            dw += part[k, 0]
            db += part[k, 1]
    else:
        dw += kept[1]
        db += kept[2]


# -- GELU (tanh approximation) with the bias add --------------------------------------------
def tanh_term(h: np.ndarray) -> np.ndarray:
    """``tanh(sqrt(2/pi) (h + 0.044715 h^3))``, a new array (NumPy)."""
    t = h * h
    t *= GELU_A
    t += 1.0
    t *= h
    t *= GELU_C
    np.tanh(t, out=t)
    return t


def bias_gelu(h: Any, b: Any | None = None) -> Any:
    """``gelu_tanh(h + b)`` as a new array; with a bias, ``h`` is overwritten with ``h + b``
    (the pre-activation that :func:`bias_gelu_backward` takes). ``h`` is (N, F)."""
    if _on_device(h):
        return _cuda().bias_gelu(h, b)
    if _numba(h, *(() if b is None else (b,))) and h.flags.c_contiguous:
        y = np.empty(h.shape, dtype=h.dtype)
        k = _cpu.gelu_constants(h.dtype)
        if b is None:
            _cpu.gelu(h, y, k)
        else:
            _cpu.bias_gelu(h, _c(b), y, k)
        return y
    if b is not None:
        h += b
    y = tanh_term(h)
    y += 1.0
    y *= h
    y *= 0.5
    return y


def bias_gelu_backward(h: Any, dy: Any, db: Any | None = None, inplace: bool = False,
                       output: bool = False) -> Any:
    """Gradient of the pre-activation ``h`` (as left by :func:`bias_gelu`) from ``dy``;
    ``db`` (if given) accumulates its sum over rows. With ``inplace`` the result overwrites
    ``dy`` (which is returned). With ``output``, returns ``(gradient, gelu_tanh(h))``: the
    forward's output recomputed in the same pass, for a caller that did not keep it."""
    if _on_device(h, dy):
        return _cuda().bias_gelu_backward(h, dy, db, inplace, output)
    if _numba(h, dy) and h.flags.c_contiguous and dy.flags.c_contiguous:
        out = dy if inplace else dy.copy()
        k = _cpu.gelu_constants(h.dtype)
        if output:
            y = np.empty(h.shape, dtype=h.dtype)
            _cpu.gelu_backward_output(h, out, y, k)
        else:
            _cpu.gelu_backward(h, out, k)
        if db is not None:
            db += out.sum(axis=0)
        return (out, y) if output else out
    t = tanh_term(h)
    d = gelu_tanh_backward(h, t, dy)
    if db is not None:
        db += d.sum(axis=0)
    if inplace:
        dy[...] = d
        d = dy
    if not output:
        return d
    t += 1.0
    t *= h
    t *= 0.5
    return d, t


def gelu_tanh_backward(x: np.ndarray, t: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """``dy * gelu_tanh'(x)`` given ``t = tanh(sqrt(2/pi) (x + 0.044715 x^3))`` (NumPy)."""
    # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)
    inner = x * x
    inner *= 3.0 * GELU_A
    inner += 1.0
    inner *= GELU_C
    sech2 = t * t
    np.subtract(1.0, sech2, out=sech2)
    d = x * sech2
    d *= inner
    d += 1.0
    d += t
    d *= 0.5
    d *= dy
    return d


# -- cross-entropy --------------------------------------------------------------------------
def cross_entropy(z: Any, targets: Any) -> tuple[float, Any]:
    """``(sum_i (lse_i - z[i, targets[i]]), lse)`` for logits ``z`` (N, V): the summed
    negative log-likelihood (in float64) and each row's log-sum-exp (N,)."""
    if _on_device(z):
        return _cuda().cross_entropy(z, targets)
    n = z.shape[0]
    if _numba(z):
        lse = np.empty(n, dtype=z.dtype)
        total = _cpu.cross_entropy(_c(z), _c(targets).astype(np.int64, copy=False), lse)
        return float(total), lse
    m = z.max(axis=-1, keepdims=True)
    e = np.exp(z - m)
    lse = np.log(e.sum(axis=-1)) + m[:, 0]
    nll = lse - z[np.arange(n), targets]
    return float(np.sum(nll, dtype=np.float64)), lse


def cross_entropy_backward(z: Any, targets: Any, lse: Any, scale: float) -> Any:
    """``scale * (softmax(z) - onehot(targets))`` as a new (N, V) array."""
    if _on_device(z):
        return _cuda().cross_entropy_backward(z, targets, lse, scale)
    if _numba(z, lse):
        out = np.empty(z.shape, dtype=z.dtype)
        _cpu.cross_entropy_backward(_c(z), _c(targets).astype(np.int64, copy=False), _c(lse),
                                    z.dtype.type(scale), out)
        return out
    p = z - lse[:, None]
    np.exp(p, out=p)
    p[np.arange(z.shape[0]), targets] -= 1.0
    p *= scale
    return p


# -- embedding ------------------------------------------------------------------------------
def embedding_backward(g: Any, ids: Any, dy: Any) -> None:
    """``g[ids[i]] += dy[i]`` for every row ``i`` of ``dy`` (N, C); repeated ids add up."""
    if _on_device(g, dy):
        return _cuda().embedding_backward(g, ids, dy)
    if _numba(g, dy) and g.flags.c_contiguous:
        _cpu.embedding_backward(g, _c(ids).astype(np.int64, copy=False), _c(dy),
                                _cpu.chunks(g.shape[1]))
        return None
    np.add.at(g, ids, dy)


def warm_up() -> None:
    """Compile the Numba kernels for float32 and float64 (fills Numba's on-disk cache)."""
    if not HAVE_NUMBA:
        return
    try:
        for force in (False, True):
            _cpu.FORCE_PARALLEL = force
            _warm_up_once()
    finally:
        _cpu.FORCE_PARALLEL = None


def _warm_up_once() -> None:
    with use_kernels("numba"):
        for dt in (np.float32, np.float64):
            rng = np.random.default_rng(0)
            s = rng.standard_normal((2, 3, 3)).astype(dt)
            raw = s.copy()
            lse = causal_softmax(s, 0.5)
            causal_softmax_backward(s, np.ones_like(s), 0.5)
            causal_softmax_recompute(raw, lse, 0.5)
            x, w, b = np.ones((2, 4), dt), np.ones(4, dt), np.zeros(4, dt)
            _, mean, rstd = layer_norm(x, w, b, 1e-5)
            layer_norm_backward(x, x, w, mean, rstd, w.copy(), b.copy())
            bias_gelu(x.copy(), b)
            bias_gelu(x.copy())
            bias_gelu_backward(x, x.copy(), b.copy(), inplace=True)
            bias_gelu_backward(x, x)
            bias_gelu_backward(x, x.copy(), inplace=True, output=True)
            ids = np.array([0, 3])
            _, lse = cross_entropy(x, ids)
            cross_entropy_backward(x, ids, lse, 0.5)
            embedding_backward(x, np.array([1, 1]), x.copy())
            qkv = rng.standard_normal((1, 2, 6)).astype(dt)
            if attention_kernel_applies(qkv):
                for keep in (True, False):
                    y, kept = attention_forward(qkv, 1, 0.5, keep)
                    attention_backward(y, qkv, kept, 1, 0.5)
