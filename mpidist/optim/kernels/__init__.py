"""Fused kernels with dispatch by array type.

An optimizer's update is an :class:`Update`: its element body, written once in its module of
:mod:`mpidist.optim`, run as ONE fused kernel: NumPy arrays by its CPU loop (Numba ``njit``,
parallel, :mod:`mpidist.optim.kernels.cpu`), arrays exposing ``__cuda_array_interface__`` (or Numba
device arrays) by a CUDA grid-stride loop over the same body (:mod:`mpidist.optim.kernels.cuda`).
Every call checks its arrays (1-D, one length, one dtype: float32 or float64, all on the
host or all on a CUDA device) and casts the scalar arguments to the arrays' dtype.
``numba.cuda`` is imported only when a device array first appears, so the CPU path works on
machines without CUDA.

The scalars are those the element needs, already derived from the hyperparameters (bias
corrections, ``1 - beta``, the AdamW decay factor...); the formulas are in
``docs/optimizers.md``. Arrays are modified in place.

All functions are local computations: not collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from mpidist.core import devices
from mpidist.optim.kernels import cpu

__all__ = [
    "Update",
    "device_module",
    "is_device_array",
    "sum_of_squares",
    "warm_up",
]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def is_device_array(x: Any) -> bool:
    """True for CUDA arrays: objects exposing ``__cuda_array_interface__`` or Numba device
    arrays (including the simulator's). NumPy arrays are host arrays
    (:func:`mpidist.core.devices.is_device`)."""
    return devices.is_device(x)


def device_module() -> ModuleType:
    """:mod:`mpidist.optim.kernels.cuda` (device arrays: allocation, copies, kernels), imported on
    first use so that machines without CUDA never import ``numba.cuda``. Not collective."""
    from mpidist.optim.kernels import cuda as cuda_kernels

    return cuda_kernels


def _prepare(
    name: str, arrays: dict[str, Any], written: tuple[str, ...]
) -> tuple[ModuleType, list[Any], type]:
    """Check ``arrays``; return the backend module, the arrays as it takes them, and the
    scalar type (the arrays' dtype)."""
    items = list(arrays.items())
    on_device = [is_device_array(a) for _, a in items]
    if any(on_device) and not all(on_device):
        where = ", ".join(
            f"{k}={'device' if d else 'host'}" for (k, _), d in zip(items, on_device, strict=True)
        )
        raise TypeError(f"{name}: arrays must all be on the host or all on a device ({where})")
    if on_device[0]:
        backend = device_module()
        out = [backend.as_device_array(a) for _, a in items]
    else:
        backend = cpu
        out = []
        for key, a in items:
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{name}: {key} is a {type(a).__name__}, not an array")
            if not a.flags.c_contiguous:
                raise ValueError(f"{name}: {key} must be C-contiguous")
            if key in written and not a.flags.writeable:
                raise ValueError(f"{name}: {key} is read-only")
            out.append(a)
    first_key, first = items[0][0], out[0]
    dtype = np.dtype(first.dtype)
    if dtype not in _FLOATS:
        raise ValueError(f"{name}: dtype {dtype} of {first_key} is not float32 or float64")
    n = first.shape
    if len(n) != 1:
        raise ValueError(f"{name}: {first_key} must be 1-D (a flat shard), got shape {n}")
    for (key, _), a in zip(items[1:], out[1:], strict=True):
        if np.dtype(a.dtype) != dtype:
            raise ValueError(f"{name}: {key} has dtype {a.dtype}, {first_key} has {dtype}")
        if tuple(a.shape) != tuple(n):
            raise ValueError(f"{name}: {key} has shape {tuple(a.shape)}, {first_key} has {n}")
    return backend, out, dtype.type


class Update:
    """One optimizer's fused update, written once for every device.

    ``element(i, *arrays, *scalars)`` updates element ``i`` of the optimizer's flat arrays
    (a function made with ``numba.extending.register_jitable``, so that both the CPU and the
    CUDA compiler can call it); ``cpu`` is the CPU kernel, a loop over ``element`` compiled
    with :func:`mpidist.optim.kernels.cpu.loop` beside it (so Numba's on-disk cache keeps it); the
    CUDA kernel is built from ``element`` when a device array first comes
    (:func:`mpidist.optim.kernels.cuda.elementwise`). ``arrays`` names the array arguments in
    order, ``written`` those the update writes, ``optional`` those that may be None (an
    empty placeholder is passed; the element's flags must keep it from reading them).

    Calling it checks the arrays (1-D, one length, one float dtype, all on the host or all
    on one device), casts the scalars to the arrays' dtype (bools stay bools) and runs ONE
    kernel. Not collective.
    """

    def __init__(self, name: str, element: Callable[..., None], cpu: Callable[..., None], *,
                 arrays: tuple[str, ...], written: tuple[str, ...],
                 optional: tuple[str, ...] = ()) -> None:
        self.name, self.element, self.cpu = name, element, cpu
        self.arrays, self.written, self.optional = arrays, written, optional

    def __call__(self, arrays: Sequence[Any], scalars: Sequence[Any]) -> None:
        if len(arrays) != len(self.arrays):
            raise TypeError(f"{self.name}: {len(arrays)} arrays given, need {self.arrays}")
        given = {}
        for key, a in zip(self.arrays, arrays, strict=True):
            if a is None and key not in self.optional:
                raise TypeError(f"{self.name}: {key} is required")
            if a is not None:
                given[key] = a
        backend, checked, t = _prepare(self.name, given, self.written)
        got = iter(checked)
        empty = np.empty(0, t) if backend is cpu else backend.empty(0, t)
        full = [next(got) if a is not None else empty for a in arrays]
        values = [v if isinstance(v, bool) else t(v) for v in scalars]
        if backend is cpu:
            self.cpu(*full, *values)
        else:
            backend.launch(self.element, *full, *values)


def sum_of_squares(x: Any) -> float:
    """Sum of squares of a 1-D float32/float64 array, accumulated in float64 (a parallel
    reduction on the CPU; a block reduction with one atomic per block on CUDA). Not
    collective; combine shards with one allreduce (see ``mpidist.optim.clip_scale``)."""
    backend, (a,), _ = _prepare("sum_of_squares", {"x": x}, ())
    return float(backend.sum_of_squares(a))


def warm_up(dtypes: tuple[Any, ...] = (np.float32, np.float64)) -> None:
    """Compile the CPU kernels of this package (the sum of squares) for each dtype, filling
    Numba's on-disk cache; :func:`mpidist.optim.warm_up` does the optimizers' kernels too.
    Not collective."""
    for dt in dtypes:
        sum_of_squares(np.ones(4, dt))
