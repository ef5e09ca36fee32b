"""Fused optimizer kernels for the CPU: ``numba.njit(parallel=True)`` loops over flat shards.

Each kernel makes one pass over its arrays: every element of every array is read once and
written once, so an update costs the memory traffic of its arrays and nothing more.

Calling convention (shared with :mod:`mpidist.kernels.cuda`): arrays are 1-D, C-contiguous,
of one dtype (float32 or float64) and one length; every scalar argument is already of the
arrays' dtype. The dispatcher in :mod:`mpidist.kernels` does the casting. Passing scalars
of the array dtype keeps float32 math in float32 (a float64 scalar would promote the whole
expression), and it keeps the number of compiled specialisations to one per dtype. For the
same reason the kernel bodies contain no float literals; ``1 - beta`` and friends arrive
precomputed.

``grad_scale`` multiplies the gradient inside the kernel: it carries the 1/N of gradient
averaging, the clipping factor and, negated, ``maximize``.

``fastmath=False`` so that LLVM neither contracts ``a*b + c`` into an FMA nor reorders
operations: results match an unfused NumPy implementation of the same formulas.

Not collective. These functions do no argument checking; use :mod:`mpidist.kernels`.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

__all__ = [
    "adagrad",
    "adam",
    "adam_amsgrad",
    "lion",
    "rmsprop",
    "sgd",
    "sgd_momentum",
    "sum_of_squares",
    "triad",
]

_JIT = {"parallel": True, "cache": True, "fastmath": False, "nogil": True}


@numba.njit(**_JIT)
def sgd(p, g, grad_scale, weight_decay, lr):  # pragma: no cover - compiled
    """SGD without momentum: ``p -= lr * (s*g + wd*p)``."""
    for i in prange(p.shape[0]):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        p[i] = pi - lr * d


@numba.njit(**_JIT)
def sgd_momentum(
    p, g, buf, grad_scale, weight_decay, lr, momentum, one_minus_dampening, nesterov, first
):  # pragma: no cover - compiled
    """SGD with a momentum buffer; on the first step the buffer is set to the gradient."""
    for i in prange(p.shape[0]):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        if first:
            b = d
        else:
            b = momentum * buf[i] + one_minus_dampening * d
        buf[i] = b
        if nesterov:
            d = d + momentum * b
        else:
            d = b
        p[i] = pi - lr * d


@numba.njit(**_JIT)
def adam(
    p, g, m, v, grad_scale, weight_decay, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
    step_size, bias_correction2_sqrt, eps,
):  # pragma: no cover - compiled
    """Adam / AdamW: L2 ``weight_decay`` enters the gradient, ``decay`` (AdamW) scales p."""
    for i in prange(p.shape[0]):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        mi = beta1 * m[i] + one_minus_beta1 * d
        vi = beta2 * v[i] + one_minus_beta2 * d * d
        m[i] = mi
        v[i] = vi
        denom = np.sqrt(vi) / bias_correction2_sqrt + eps
        p[i] = pi * decay - step_size * (mi / denom)


@numba.njit(**_JIT)
def adam_amsgrad(
    p, g, m, v, vmax, grad_scale, weight_decay, decay, beta1, one_minus_beta1, beta2,
    one_minus_beta2, step_size, bias_correction2_sqrt, eps,
):  # pragma: no cover - compiled
    """Adam / AdamW with AMSGrad: the denominator uses the running maximum of ``v``."""
    for i in prange(p.shape[0]):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        mi = beta1 * m[i] + one_minus_beta1 * d
        vi = beta2 * v[i] + one_minus_beta2 * d * d
        mx = vmax[i]
        if vi > mx:
            mx = vi
        m[i] = mi
        v[i] = vi
        vmax[i] = mx
        denom = np.sqrt(mx) / bias_correction2_sqrt + eps
        p[i] = pi * decay - step_size * (mi / denom)


@numba.njit(**_JIT)
def rmsprop(
    p, g, square_avg, grad_avg, buf, grad_scale, weight_decay, lr, alpha, one_minus_alpha, eps,
    momentum, centered, use_momentum,
):  # pragma: no cover - compiled
    """RMSprop; ``grad_avg`` is read only when centered, ``buf`` only with momentum."""
    for i in prange(p.shape[0]):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        s = alpha * square_avg[i] + one_minus_alpha * d * d
        square_avg[i] = s
        if centered:
            ga = alpha * grad_avg[i] + one_minus_alpha * d
            grad_avg[i] = ga
            avg = np.sqrt(s - ga * ga) + eps
        else:
            avg = np.sqrt(s) + eps
        if use_momentum:
            b = momentum * buf[i] + d / avg
            buf[i] = b
            p[i] = pi - lr * b
        else:
            p[i] = pi - lr * (d / avg)


@numba.njit(**_JIT)
def adagrad(p, g, state_sum, grad_scale, weight_decay, clr, eps):  # pragma: no cover - compiled
    """Adagrad with the step's decayed learning rate ``clr``."""
    for i in prange(p.shape[0]):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        s = state_sum[i] + d * d
        state_sum[i] = s
        std = np.sqrt(s) + eps
        p[i] = pi - clr * (d / std)


@numba.njit(**_JIT)
def lion(
    p, g, m, grad_scale, decay, lr, beta1, one_minus_beta1, beta2, one_minus_beta2
):  # pragma: no cover - compiled
    """Lion: ``p = p*decay - lr*sign(b1*m + (1-b1)*g)``; then ``m = b2*m + (1-b2)*g``."""
    for i in prange(p.shape[0]):
        d = grad_scale * g[i]
        mi = m[i]
        c = beta1 * mi + one_minus_beta1 * d
        pi = p[i] * decay
        # Branches instead of np.sign: p - lr*sign(c) is exactly one of these three values.
        if c > 0:
            pi = pi - lr
        elif c < 0:
            pi = pi + lr
        p[i] = pi
        m[i] = beta2 * mi + one_minus_beta2 * d


@numba.njit(**_JIT)
def sum_of_squares(x):  # pragma: no cover - compiled
    """Sum of ``x[i]**2`` accumulated in float64 (a parallel reduction)."""
    acc = 0.0
    for i in prange(x.shape[0]):
        xi = np.float64(x[i])
        acc += xi * xi
    return acc


@numba.njit(**_JIT)
def triad(a, b, c, s):  # pragma: no cover - compiled
    """STREAM triad ``a = b + s*c``: the memory-bandwidth yardstick of the benchmarks."""
    for i in prange(a.shape[0]):
        a[i] = b[i] + s * c[i]
