"""Fused optimizer kernels with dispatch by array type.

Every function here checks its arrays (1-D, one length, one dtype: float32 or float64, all
on the host or all on a CUDA device), casts the scalar arguments to the arrays' dtype and
runs ONE fused kernel: NumPy arrays go to :mod:`mpidist.kernels.cpu` (Numba ``njit``,
parallel), arrays exposing ``__cuda_array_interface__`` (or Numba device arrays) to
:mod:`mpidist.kernels.cuda`. ``numba.cuda`` is imported only when a device array first
appears, so the CPU path works on machines without CUDA.

The arguments are the scalars the kernels need, already derived from the hyperparameters
(bias corrections, ``1 - beta``, the AdamW decay factor...). :mod:`mpidist.optim` derives
them; the formulas are in ``docs/optimizers.md``. Arrays are modified in place.

All functions are local computations: not collective.
"""

from __future__ import annotations

from functools import partial
from types import ModuleType
from typing import Any

import numpy as np

from mpidist.kernels import cpu

__all__ = [
    "adagrad",
    "adam",
    "is_device_array",
    "lion",
    "rmsprop",
    "sgd",
    "sum_of_squares",
    "warm_up",
]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def is_device_array(x: Any) -> bool:
    """True for CUDA arrays: objects exposing ``__cuda_array_interface__`` or Numba device
    arrays (including the simulator's). NumPy arrays are host arrays."""
    if isinstance(x, np.ndarray):
        return False
    if hasattr(x, "__cuda_array_interface__"):
        return True
    # The CUDA simulator's arrays do not expose the interface; recognise Numba's own types.
    return type(x).__module__.startswith("numba.cuda") and hasattr(x, "copy_to_host")


def _cuda() -> ModuleType:
    from mpidist.kernels import cuda as cuda_kernels

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
        backend = _cuda()
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


def sgd(
    param: Any,
    grad: Any,
    momentum_buffer: Any = None,
    *,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    first: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """SGD update in one pass: ``d = grad_scale*grad + weight_decay*param``; with a
    ``momentum_buffer``: ``buf = d`` if ``first`` else ``momentum*buf + (1-dampening)*d``,
    then ``d = d + momentum*buf`` (nesterov) or ``d = buf``; finally ``param -= lr*d``.
    Not collective."""
    if momentum_buffer is None:
        backend, (p, g), t = _prepare("sgd", {"param": param, "grad": grad}, ("param",))
        backend.sgd(p, g, t(grad_scale), t(weight_decay), t(lr))
        return
    backend, (p, g, b), t = _prepare(
        "sgd",
        {"param": param, "grad": grad, "momentum_buffer": momentum_buffer},
        ("param", "momentum_buffer"),
    )
    backend.sgd_momentum(
        p, g, b, t(grad_scale), t(weight_decay), t(lr), t(momentum), t(1.0 - dampening),
        bool(nesterov), bool(first),
    )


def adam(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    max_exp_avg_sq: Any = None,
    *,
    step_size: float,
    bias_correction2_sqrt: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    decay: float = 1.0,
    grad_scale: float = 1.0,
) -> None:
    """Adam/AdamW update in one pass. ``weight_decay`` is Adam's L2 term (added to the
    gradient), ``decay`` AdamW's factor ``1 - lr*weight_decay`` on the parameter;
    ``step_size = lr/(1-beta1**t)``, ``bias_correction2_sqrt = (1-beta2**t)**0.5``. With
    ``max_exp_avg_sq`` (AMSGrad) the denominator uses the running maximum of ``exp_avg_sq``.
    Not collective."""
    arrays = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    written = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    if max_exp_avg_sq is not None:
        arrays["max_exp_avg_sq"] = max_exp_avg_sq
    backend, arrs, t = _prepare("adam", arrays, written)
    scalars = (
        t(grad_scale), t(weight_decay), t(decay), t(beta1), t(1.0 - beta1), t(beta2),
        t(1.0 - beta2), t(step_size), t(bias_correction2_sqrt), t(eps),
    )
    if max_exp_avg_sq is None:
        backend.adam(*arrs, *scalars)
    else:
        backend.adam_amsgrad(*arrs, *scalars)


def rmsprop(
    param: Any,
    grad: Any,
    square_avg: Any,
    grad_avg: Any = None,
    momentum_buffer: Any = None,
    *,
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    grad_scale: float = 1.0,
) -> None:
    """RMSprop update in one pass; centered when ``grad_avg`` is given, with momentum when
    ``momentum_buffer`` is given. Not collective."""
    arrays = {"param": param, "grad": grad, "square_avg": square_avg}
    if grad_avg is not None:
        arrays["grad_avg"] = grad_avg
    if momentum_buffer is not None:
        arrays["momentum_buffer"] = momentum_buffer
    backend, arrs, t = _prepare(
        "rmsprop", arrays, ("param", "square_avg", "grad_avg", "momentum_buffer")
    )
    p, g, sq = arrs[:3]
    rest = iter(arrs[3:])
    # The kernel has a fixed signature; an empty array stands in for a buffer it will not read.
    placeholder = backend.empty(0, t) if backend is not cpu else np.empty(0, t)
    ga = next(rest) if grad_avg is not None else placeholder
    buf = next(rest) if momentum_buffer is not None else placeholder
    backend.rmsprop(
        p, g, sq, ga, buf, t(grad_scale), t(weight_decay), t(lr), t(alpha), t(1.0 - alpha),
        t(eps), t(momentum), grad_avg is not None, momentum_buffer is not None,
    )


def adagrad(
    param: Any,
    grad: Any,
    state_sum: Any,
    *,
    clr: float,
    eps: float,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
) -> None:
    """Adagrad update in one pass with the step's learning rate ``clr``. Not collective."""
    backend, (p, g, s), t = _prepare(
        "adagrad", {"param": param, "grad": grad, "state_sum": state_sum}, ("param", "state_sum")
    )
    backend.adagrad(p, g, s, t(grad_scale), t(weight_decay), t(clr), t(eps))


def lion(
    param: Any,
    grad: Any,
    exp_avg: Any,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    decay: float = 1.0,
    grad_scale: float = 1.0,
) -> None:
    """Lion update in one pass: ``param = param*decay - lr*sign(beta1*m + (1-beta1)*g)``,
    ``m = beta2*m + (1-beta2)*g``. Not collective."""
    backend, (p, g, m), t = _prepare(
        "lion", {"param": param, "grad": grad, "exp_avg": exp_avg}, ("param", "exp_avg")
    )
    backend.lion(
        p, g, m, t(grad_scale), t(decay), t(lr), t(beta1), t(1.0 - beta1), t(beta2), t(1.0 - beta2)
    )


def sum_of_squares(x: Any) -> float:
    """Sum of squares of a 1-D float32/float64 array, accumulated in float64 (a parallel
    reduction on the CPU; a block reduction with one atomic per block on CUDA). Not
    collective; combine shards with one allreduce (see ``mpidist.optim.clip_scale``)."""
    backend, (a,), _ = _prepare("sum_of_squares", {"x": x}, ())
    return float(backend.sum_of_squares(a))


def warm_up(dtypes: tuple[Any, ...] = (np.float32, np.float64)) -> None:
    """Compile every CPU kernel for each dtype on tiny arrays, filling Numba's on-disk cache
    (so that MPI ranks started later load the kernels instead of compiling them all at once).
    Not collective; run it once before launching many ranks."""
    for dt in dtypes:
        p = np.ones(4, dt)
        g = np.full(4, 0.5, dt)
        z = partial(np.zeros, 4, dt)

        sgd(p, g, lr=0.1)
        sgd(p, g, z(), lr=0.1, momentum=0.9, first=True)
        adam(p, g, z(), z(), step_size=0.1, bias_correction2_sqrt=0.1, beta1=0.9, beta2=0.99,
             eps=1e-8)
        adam(p, g, z(), z(), z(), step_size=0.1, bias_correction2_sqrt=0.1, beta1=0.9,
             beta2=0.99, eps=1e-8)
        rmsprop(p, g, z(), lr=0.1, alpha=0.99, eps=1e-8)
        rmsprop(p, g, z(), z(), z(), lr=0.1, alpha=0.99, eps=1e-8, momentum=0.9)
        adagrad(p, g, z(), clr=0.1, eps=1e-10)
        lion(p, g, z(), lr=0.1, beta1=0.9, beta2=0.99)
        sum_of_squares(p)
