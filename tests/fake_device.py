"""A fake device array library for the tests: arrays that behave like CuPy's where it matters.

:class:`FakeArray` holds a NumPy array but, like a CuPy array, refuses to become a NumPy
array implicitly (``np.asarray``, a Numba CPU kernel, mixing it with a NumPy array in an
operation), answers ``__array_namespace__`` with :data:`xp` (a namespace that makes and
combines FakeArrays, as ``cupy`` does), and exposes ``__cuda_array_interface__`` over its
host memory, so that under ``NUMBA_ENABLE_CUDASIM=1`` the CUDA kernels and the device
staging of the collectives run on it. A NumPy-only call that creeps into a layer's device
path therefore fails loudly here, without a GPU. ``xp.empty`` fills floats with NaN, as a
reminder that device memory is not zeroed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from mpidist.core.arrays import Device

_BLOCKED = {"__array_interface__", "__array_struct__", "ctypes", "__array_priority__"}


class HostMix(TypeError):
    """A NumPy array met a fake device array: a host-only call on the device path."""


def _unwrap(v: Any) -> Any:
    if isinstance(v, FakeArray):
        return v._a
    if isinstance(v, np.ndarray) and v.ndim > 0:
        raise HostMix(f"a NumPy array of shape {v.shape} was mixed with device arrays")
    if isinstance(v, (list, tuple)):
        return type(v)(_unwrap(x) for x in v)
    return v


def _wrap(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return FakeArray(v)
    if isinstance(v, tuple):
        return tuple(_wrap(x) for x in v)
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    return v


class FakeArray(NDArrayOperatorsMixin):
    """A device-like array over a NumPy array (see the module docstring)."""

    __slots__ = ("_a",)

    def __init__(self, a: np.ndarray) -> None:
        object.__setattr__(self, "_a", a)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise HostMix("implicit conversion of a device array to a NumPy array")

    def __array_namespace__(self, api_version: Any = None) -> Any:
        return xp

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        a = self._a
        ai = a.__array_interface__
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (ai["data"][0], False),
                "strides": None if a.flags.c_contiguous else a.strides, "version": 3}

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if "out" in kwargs:
            kwargs["out"] = tuple(_unwrap(o) for o in kwargs["out"])
        result = getattr(ufunc, method)(*_unwrap(inputs), **kwargs)
        if "out" in kwargs and result is not None:
            outs = tuple(FakeArray(o) for o in kwargs["out"])
            return outs[0] if len(outs) == 1 else outs
        return _wrap(result)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return _wrap(func(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}))

    def __getattr__(self, name: str) -> Any:
        if name in _BLOCKED:
            raise AttributeError(name)
        value = getattr(self._a, name)
        if callable(value):
            def method(*args: Any, **kwargs: Any) -> Any:
                return _wrap(value(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}))
            return method
        return _wrap(value)

    def __getitem__(self, key: Any) -> Any:
        return _wrap(self._a[_unwrap(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[_unwrap(key)] = _unwrap(value)

    def __len__(self) -> int:
        return len(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __bool__(self) -> bool:
        return bool(self._a)

    def get(self) -> np.ndarray:
        """A NumPy copy (CuPy's device-to-host copy)."""
        return self._a.copy()

    def __repr__(self) -> str:
        return f"FakeArray({self._a!r})"


class _Namespace:
    """``cupy``'s part that the engine uses, over NumPy, making FakeArrays."""

    __name__ = "fakexp"
    ndarray = FakeArray

    def asarray(self, a: Any, dtype: Any = None) -> FakeArray:
        if isinstance(a, FakeArray):
            return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
        return FakeArray(np.array(a, dtype=dtype))

    def empty(self, shape: Any, dtype: Any = float) -> FakeArray:
        a = np.empty(shape, dtype=dtype)
        if a.dtype.kind == "f":
            a.fill(np.nan)
        return FakeArray(a)

    def empty_like(self, a: Any, dtype: Any = None) -> FakeArray:
        return self.empty(a.shape, a.dtype if dtype is None else dtype)

    def __getattr__(self, name: str) -> Any:
        value = getattr(np, name)
        if isinstance(value, np.ufunc) or not callable(value) or isinstance(value, type):
            return value

        def function(*args: Any, **kwargs: Any) -> Any:
            return _wrap(value(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}))
        return function


xp = _Namespace()
#: the fake device: what ``device=`` takes to put a model's arrays in FakeArrays
FAKE = Device("fake", xp)
