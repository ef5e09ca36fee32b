"""Kernels for CUDA devices: ``numba.cuda.jit`` with grid-stride loops.

An optimizer's CUDA kernel is a grid-stride loop over the same element body as its CPU
kernel (:func:`elementwise`; same argument order, same operations, scalars already of the
arrays' dtype), so CPU and GPU runs agree to round-off. Arrays are anything exposing
``__cuda_array_interface__`` (Numba device arrays, CuPy, PyTorch CUDA tensors); under
``NUMBA_ENABLE_CUDASIM=1`` the simulator's device arrays.

This module imports ``numba.cuda`` at import time; :mod:`mpidist.optim.kernels` imports it only when
a device array first shows up, so the CPU path works without CUDA.

Each launch is asynchronous on the default stream, except :func:`sum_of_squares`, which
copies its scalar result back and therefore synchronises. Not collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpidist.core import devices

cuda = devices.numba_cuda()  # numba.cuda, with NumPy >= 2.5 too

__all__ = [
    "as_device_array",
    "elementwise",
    "empty",
    "full",
    "launch",
    "sum_of_squares",
    "to_device",
    "to_host",
]

_THREADS = 256
# Enough blocks to fill any current GPU several times over; the grid-stride loop covers the rest.
_MAX_BLOCKS = 4096


_LOOPS: dict[tuple[Any, int], Any] = {}


def _grid(n: int) -> tuple[int, int]:
    blocks = max(1, min(_MAX_BLOCKS, (n + _THREADS - 1) // _THREADS))
    return blocks, _THREADS


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


def elementwise(element: Callable[..., None], n_args: int) -> Any:
    """The CUDA kernel of an optimizer's element body: a grid-stride loop that calls
    ``element(i, a0, ..., a{n-1})`` for every index ``i`` of its first argument (an array).
    Built once per body (Numba CUDA kernels take no ``*args``, so the loop's source is
    written for the body's number of arguments)."""
    kernel = _LOOPS.get((element, n_args))
    if kernel is None:
        names = ", ".join(f"a{k}" for k in range(n_args))
        source = (f"def loop({names}):\n"
                  f"    for i in range(cuda.grid(1), a0.shape[0], cuda.gridsize(1)):\n"
                  f"        element(i, {names})\n")
        scope: dict[str, Any] = {"cuda": cuda, "element": element}
        exec(compile(source, f"<elementwise {element.__name__}>", "exec"), scope)  # noqa: S102
        kernel = _LOOPS[(element, n_args)] = cuda.jit(scope["loop"])
    return kernel


def launch(element: Callable[..., None], *args: Any) -> None:
    """Run ``element`` over the elements of ``args[0]`` on the device (asynchronous on
    the default stream)."""
    elementwise(element, len(args))[_grid(args[0].shape[0])](*args)


def sum_of_squares(x: Any) -> float:
    """Float64 sum of squares of a device array; synchronises to return the scalar."""
    out = cuda.to_device(np.zeros(1, dtype=np.float64))
    if x.shape[0]:
        _sum_of_squares[_grid(x.shape[0])](x, out)
    return float(out.copy_to_host()[0])


def full(n: int, value: float, dtype: Any) -> Any:
    """A device array of ``n`` elements all equal to ``value``."""
    return cuda.to_device(np.full(n, value, dtype=dtype))


def empty(n: int, dtype: Any) -> Any:
    """An uninitialised device array (placeholders for arguments a kernel does not read)."""
    return cuda.device_array(n, dtype=dtype)


def as_device_array(x: Any, *, sync: bool = True) -> Any:
    """``x`` as a Numba device array: itself when it is one, else a view of its
    ``__cuda_array_interface__`` (no copy; :func:`mpidist.core.devices.view`, ``sync``
    as there)."""
    if not devices.is_device(x):
        raise TypeError(f"{type(x).__name__} does not expose __cuda_array_interface__")
    return devices.view(x, sync=sync)


def to_host(x: Any) -> np.ndarray:
    """Copy a device array to a new NumPy array (synchronises)."""
    return np.asarray(as_device_array(x).copy_to_host())


def to_device(x: np.ndarray) -> Any:
    """Copy a NumPy array to a new device array."""
    return cuda.to_device(np.ascontiguousarray(x))
