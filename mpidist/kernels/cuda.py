"""Fused optimizer kernels for CUDA devices: ``numba.cuda.jit`` with grid-stride loops.

The math is line for line that of :mod:`mpidist.kernels.cpu` (same argument order, same
operation order, scalars already of the arrays' dtype), so CPU and GPU runs agree to
round-off. Arrays are anything exposing ``__cuda_array_interface__`` (Numba device arrays,
CuPy, PyTorch CUDA tensors); under ``NUMBA_ENABLE_CUDASIM=1`` the simulator's device arrays.

This module imports ``numba.cuda`` at import time; :mod:`mpidist.kernels` imports it only when
a device array first shows up, so the CPU path works without CUDA.

Each launch is asynchronous on the default stream, except :func:`sum_of_squares`, which
copies its scalar result back and therefore synchronises. Not collective.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

__all__ = [
    "adagrad",
    "adam",
    "adam_amsgrad",
    "as_device_array",
    "empty",
    "full",
    "lion",
    "rmsprop",
    "sgd",
    "sgd_momentum",
    "sum_of_squares",
    "to_device",
    "to_host",
    "zeros",
]

_THREADS = 256
# Enough blocks to fill any current GPU several times over; the grid-stride loop covers the rest.
_MAX_BLOCKS = 4096


def _grid(n: int) -> tuple[int, int]:
    blocks = max(1, min(_MAX_BLOCKS, (n + _THREADS - 1) // _THREADS))
    return blocks, _THREADS


@cuda.jit
def _sgd(p, g, grad_scale, weight_decay, lr):  # pragma: no cover - device code
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, p.shape[0], stride):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        p[i] = pi - lr * d


@cuda.jit
def _sgd_momentum(
    p, g, buf, grad_scale, weight_decay, lr, momentum, one_minus_dampening, nesterov, first
):  # pragma: no cover - device code
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, p.shape[0], stride):
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


@cuda.jit
def _adam(
    p, g, m, v, grad_scale, weight_decay, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
    step_size, bias_correction2_sqrt, eps,
):  # pragma: no cover - device code
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, p.shape[0], stride):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        mi = beta1 * m[i] + one_minus_beta1 * d
        vi = beta2 * v[i] + one_minus_beta2 * d * d
        m[i] = mi
        v[i] = vi
        denom = math.sqrt(vi) / bias_correction2_sqrt + eps
        p[i] = pi * decay - step_size * (mi / denom)


@cuda.jit
def _adam_amsgrad(
    p, g, m, v, vmax, grad_scale, weight_decay, decay, beta1, one_minus_beta1, beta2,
    one_minus_beta2, step_size, bias_correction2_sqrt, eps,
):  # pragma: no cover - device code
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, p.shape[0], stride):
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
        denom = math.sqrt(mx) / bias_correction2_sqrt + eps
        p[i] = pi * decay - step_size * (mi / denom)


@cuda.jit
def _rmsprop(
    p, g, square_avg, grad_avg, buf, grad_scale, weight_decay, lr, alpha, one_minus_alpha, eps,
    momentum, centered, use_momentum,
):  # pragma: no cover - device code
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, p.shape[0], stride):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        s = alpha * square_avg[i] + one_minus_alpha * d * d
        square_avg[i] = s
        if centered:
            ga = alpha * grad_avg[i] + one_minus_alpha * d
            grad_avg[i] = ga
            avg = math.sqrt(s - ga * ga) + eps
        else:
            avg = math.sqrt(s) + eps
        if use_momentum:
            b = momentum * buf[i] + d / avg
            buf[i] = b
            p[i] = pi - lr * b
        else:
            p[i] = pi - lr * (d / avg)


@cuda.jit
def _adagrad(p, g, state_sum, grad_scale, weight_decay, clr, eps):  # pragma: no cover
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, p.shape[0], stride):
        pi = p[i]
        d = grad_scale * g[i] + weight_decay * pi
        s = state_sum[i] + d * d
        state_sum[i] = s
        std = math.sqrt(s) + eps
        p[i] = pi - clr * (d / std)


@cuda.jit
def _lion(
    p, g, m, grad_scale, decay, lr, beta1, one_minus_beta1, beta2, one_minus_beta2
):  # pragma: no cover - device code
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, p.shape[0], stride):
        d = grad_scale * g[i]
        mi = m[i]
        c = beta1 * mi + one_minus_beta1 * d
        pi = p[i] * decay
        if c > 0:
            pi = pi - lr
        elif c < 0:
            pi = pi + lr
        p[i] = pi
        m[i] = beta2 * mi + one_minus_beta2 * d


@cuda.jit
def _sum_of_squares(x, out):  # pragma: no cover - device code
    # Per-thread float64 partial sums, a shared-memory tree per block, one atomic per block.
    partial = cuda.shared.array(_THREADS, dtype=np.float64)
    tid = cuda.threadIdx.x
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    acc = 0.0
    for i in range(start, x.shape[0], stride):
        xi = np.float64(x[i])
        acc += xi * xi
    partial[tid] = acc
    cuda.syncthreads()
    width = _THREADS // 2
    while width > 0:
        if tid < width:
            partial[tid] += partial[tid + width]
        cuda.syncthreads()
        width //= 2
    if tid == 0:
        cuda.atomic.add(out, 0, partial[0])


def _launch(kernel: Any, p: Any, *args: Any) -> None:
    blocks, threads = _grid(p.shape[0])
    kernel[blocks, threads](p, *args)


def sgd(p: Any, *args: Any) -> None:
    """Launch the SGD kernel (see :func:`mpidist.kernels.cpu.sgd`)."""
    _launch(_sgd, p, *args)


def sgd_momentum(p: Any, *args: Any) -> None:
    """Launch the SGD-momentum kernel (see :func:`mpidist.kernels.cpu.sgd_momentum`)."""
    _launch(_sgd_momentum, p, *args)


def adam(p: Any, *args: Any) -> None:
    """Launch the Adam/AdamW kernel (see :func:`mpidist.kernels.cpu.adam`)."""
    _launch(_adam, p, *args)


def adam_amsgrad(p: Any, *args: Any) -> None:
    """Launch the AMSGrad kernel (see :func:`mpidist.kernels.cpu.adam_amsgrad`)."""
    _launch(_adam_amsgrad, p, *args)


def rmsprop(p: Any, *args: Any) -> None:
    """Launch the RMSprop kernel (see :func:`mpidist.kernels.cpu.rmsprop`)."""
    _launch(_rmsprop, p, *args)


def adagrad(p: Any, *args: Any) -> None:
    """Launch the Adagrad kernel (see :func:`mpidist.kernels.cpu.adagrad`)."""
    _launch(_adagrad, p, *args)


def lion(p: Any, *args: Any) -> None:
    """Launch the Lion kernel (see :func:`mpidist.kernels.cpu.lion`)."""
    _launch(_lion, p, *args)


def sum_of_squares(x: Any) -> float:
    """Float64 sum of squares of a device array; synchronises to return the scalar."""
    out = cuda.to_device(np.zeros(1, dtype=np.float64))
    if x.shape[0]:
        _sum_of_squares[_grid(x.shape[0])](x, out)
    return float(out.copy_to_host()[0])


def zeros(n: int, dtype: Any) -> Any:
    """A zero-filled device array of ``n`` elements."""
    return cuda.to_device(np.zeros(n, dtype=dtype))


def full(n: int, value: float, dtype: Any) -> Any:
    """A device array of ``n`` elements all equal to ``value``."""
    return cuda.to_device(np.full(n, value, dtype=dtype))


def empty(n: int, dtype: Any) -> Any:
    """An uninitialised device array (placeholders for arguments a kernel does not read)."""
    return cuda.device_array(n, dtype=dtype)


def as_device_array(x: Any) -> Any:
    """``x`` as a Numba device array: itself when it is one, else a view of its
    ``__cuda_array_interface__`` (no copy)."""
    if hasattr(x, "copy_to_host"):
        # Numba device arrays, including the simulator's, which lack the interface.
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x)
    raise TypeError(f"{type(x).__name__} does not expose __cuda_array_interface__")


def to_host(x: Any) -> np.ndarray:
    """Copy a device array to a new NumPy array (synchronises)."""
    return np.asarray(as_device_array(x).copy_to_host())


def to_device(x: np.ndarray) -> Any:
    """Copy a NumPy array to a new device array."""
    return cuda.to_device(np.ascontiguousarray(x))
