"""The optimizer base class, the optimizer state, and hyperparameter validation.

An optimizer is a frozen dataclass of hyperparameters with no reference to parameters:
it updates one flat shard at a time, ``update(param, grad, state)``, where ``state`` is an
:class:`OptimizerState` (flat buffers the length of the shard and a step count) made by
``init_state``. Sharded strategies keep one state per local shard; everything here is local
computation, not collective.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from mpidist.core import arrays
from mpidist.optim import kernels

__all__ = ["Optimizer", "OptimizerState"]

StateDict = dict[str, "np.ndarray | int | float"]


@dataclass
class OptimizerState:
    """The state of one optimizer for one flat shard.

    ``step`` counts the updates done so far; ``buffers`` maps the state names of the
    optimizer (PyTorch's names: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) to flat
    arrays of the shard's length, dtype and device. ``state["exp_avg"]`` reads a buffer.
    """

    step: int = 0
    buffers: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.buffers[name]

    def __contains__(self, name: object) -> bool:
        return name in self.buffers


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_real(
    owner: str,
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a float, or ValueError naming it: finite, in the (half-)open range given."""
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name}={value!r} must be a finite real number")
    v = float(value)
    bad_low = low is not None and (v <= low if low_open else v < low)
    bad_high = high is not None and (v >= high if high_open else v > high)
    if bad_low or bad_high:
        if low is not None and high is not None:
            lo = "(" if low_open else "["
            hi = ")" if high_open else "]"
            raise ValueError(f"{owner}: {name}={value!r} must be in {lo}{low:g}, {high:g}{hi}")
        if low is not None:
            op = ">" if low_open else ">="
            raise ValueError(f"{owner}: {name}={value!r} must be {op} {low:g}")
        op = "<" if high_open else "<="
        raise ValueError(f"{owner}: {name}={value!r} must be {op} {high:g}")
    return v


def check_bool(owner: str, name: str, value: Any) -> bool:
    """``value`` as a bool, or ValueError naming it (0/1 integers are not accepted)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{owner}: {name}={value!r} must be True or False")
    return bool(value)


def check_betas(owner: str, value: Any) -> tuple[float, float]:
    """A pair of coefficients, each in [0, 1)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ValueError(f"{owner}: betas={value!r} must be a pair (beta1, beta2)")
    return (
        check_real(owner, "betas[0]", value[0], low=0.0, high=1.0, high_open=True),
        check_real(owner, "betas[1]", value[1], low=0.0, high=1.0, high_open=True),
    )


@dataclass(frozen=True)
class Optimizer:
    """Base class: hyperparameters as frozen dataclass fields, the update as one fused kernel.

    Subclasses declare their hyperparameters as fields (PyTorch's names and defaults),
    validate them in ``__post_init__``, name their state buffers in ``state_names`` and
    implement ``_update``.
    """

    name: ClassVar[str] = ""
    lr: float = 1e-3

    def __new__(cls, *args: Any, **kwargs: Any) -> Optimizer:
        # The dataclass __init__ would raise TypeError; an unknown option is a bad value.
        known = [f.name for f in fields(cls)]
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            k = unknown[0]
            raise ValueError(
                f"{cls.__name__}: unknown option {k}={kwargs[k]!r}; known options: "
                + ", ".join(known)
            )
        return super().__new__(cls)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        self._set("lr", check_real(type(self).__name__, "lr", self.lr, low=0.0))

    # -- serialisation ---------------------------------------------------------------------

    def hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters as a plain dict of numbers, bools and pairs of numbers."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def config(self) -> dict[str, Any]:
        """``{"name": ..., **hyperparameters()}``; ``mpidist.optim.from_config`` inverts it."""
        return {"name": self.name, **self.hyperparameters()}

    # -- state -----------------------------------------------------------------------------

    def state_names(self) -> tuple[str, ...]:
        """Names of the state buffers this configuration keeps (may be empty)."""
        return ()

    def _initial_value(self, name: str) -> float:
        return 0.0

    def init_state(self, n_or_param: Any, *, dtype: Any = None, device: Any = None
                   ) -> OptimizerState:
        """A fresh state for a shard: ``n_or_param`` is the shard length (buffers on
        ``device``, the host by default, ``dtype`` default float64) or the parameter shard
        itself (its length, dtype and device; ``dtype`` must then be None or equal). Not
        collective."""
        owner = type(self).__name__
        if isinstance(n_or_param, (numbers.Integral, np.integer)) and not isinstance(
            n_or_param, (bool, np.bool_)
        ):
            n = int(n_or_param)
            if n < 0:
                raise ValueError(f"{owner}: shard length n={n} must be >= 0")
            dt = np.dtype(np.float64 if dtype is None else dtype)
            xp = arrays.device(device).xp
        else:
            shape = getattr(n_or_param, "shape", None)
            if shape is None or len(shape) != 1:
                raise ValueError(
                    f"{owner}: init_state needs a length or a 1-D parameter shard, got "
                    f"{type(n_or_param).__name__} with shape {shape}"
                )
            n = int(shape[0])
            dt = _dtype_of(n_or_param)
            if dtype is not None and np.dtype(dtype) != dt:
                raise ValueError(f"{owner}: dtype={np.dtype(dtype)} but the parameter is {dt}")
            xp = _library(n_or_param)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError(f"{owner}: dtype {dt} is not float32 or float64")
        buffers: dict[str, Any] = {}
        for key in self.state_names():
            value = self._initial_value(key)
            if xp is None:  # a Numba device array: Numba device buffers
                buffers[key] = kernels.device_module().full(n, value, dt)
            else:
                buffers[key] = xp.full(n, value, dtype=dt)
        return OptimizerState(step=0, buffers=buffers)

    def state_to_dict(self, state: OptimizerState) -> StateDict:
        """``{"step": int, name: array, ...}``. Host buffers are returned as they are (no
        copy: write them out before the next update); device buffers are copied to the host.
        Not collective."""
        out: StateDict = {"step": int(state.step)}
        for key in self.state_names():
            buf = state.buffers[key]
            out[key] = kernels.device_module().to_host(buf) if kernels.is_device_array(buf) else buf
        return out

    def state_from_dict(self, d: dict[str, Any], *, like: Any = None) -> OptimizerState:
        """Rebuild a state from ``state_to_dict`` output (copies the arrays). With ``like``
        (a parameter shard) the buffers take its dtype and device, and must match its length.
        Not collective."""
        owner = type(self).__name__
        expected = {"step", *self.state_names()}
        missing = sorted(expected - set(d))
        extra = sorted(set(d) - expected)
        if missing or extra:
            raise ValueError(
                f"{owner}: state dict keys {sorted(d)} do not match {sorted(expected)} "
                f"(missing {missing}, unexpected {extra})"
            )
        step = d["step"]
        if isinstance(step, np.ndarray):
            step = step.item() if step.size == 1 else step
        if (
            not isinstance(step, (numbers.Integral, np.integer))
            or isinstance(step, (bool, np.bool_))
            or step < 0
        ):
            raise ValueError(f"{owner}: step={step!r} must be an integer >= 0")
        device = like is not None and kernels.is_device_array(like)
        buffers: dict[str, Any] = {}
        n = None if like is None else int(like.shape[0])
        for key in self.state_names():
            arr = np.asarray(d[key])
            if arr.ndim != 1:
                raise ValueError(f"{owner}: state {key!r} must be 1-D, got shape {arr.shape}")
            if n is None:
                n = arr.shape[0]
            if arr.shape[0] != n:
                raise ValueError(f"{owner}: state {key!r} has length {arr.shape[0]}, expected {n}")
            dt = arr.dtype if like is None else np.dtype(like.dtype)
            host = np.array(arr, dtype=dt, order="C", copy=True)
            buffers[key] = kernels.device_module().to_device(host) if device else host
        return OptimizerState(step=int(step), buffers=buffers)

    # -- update ----------------------------------------------------------------------------

    def update(
        self,
        param: Any,
        grad: Any,
        state: OptimizerState,
        *,
        grad_scale: float = 1.0,
        lr: float | None = None,
    ) -> None:
        """One optimizer step on a flat shard, in place, as ONE fused kernel.

        ``grad_scale`` multiplies the gradient inside the kernel (gradient averaging 1/N and
        the clipping factor); ``lr`` overrides the configured learning rate for this step (a
        schedule's value). ``param`` and the state buffers are updated and ``state.step`` is
        incremented. Not collective: each rank updates its own shard.
        """
        owner = type(self).__name__
        lr_t = self.lr if lr is None else check_real(owner, "lr", lr, low=0.0)
        if not _is_real(grad_scale):
            raise ValueError(f"{owner}: grad_scale={grad_scale!r} must be a real number")
        missing = [k for k in self.state_names() if k not in state.buffers]
        if missing:
            raise ValueError(f"{owner}: state lacks buffers {missing}; use init_state()")
        sign = -1.0 if getattr(self, "maximize", False) else 1.0
        self._update(param, grad, state, sign * float(grad_scale), lr_t, state.step + 1)
        state.step += 1

    def _update(
        self, param: Any, grad: Any, state: OptimizerState, grad_scale: float, lr: float, step: int
    ) -> None:
        """The kernel call of :meth:`update`; ``grad_scale`` is already negated for
        ``maximize``."""
        raise NotImplementedError


def _dtype_of(param: Any) -> np.dtype:
    """The NumPy dtype of a parameter shard: its ``dtype``, or for a device array of a
    library NumPy does not know (a torch CUDA tensor) the typestr of its
    ``__cuda_array_interface__``."""
    try:
        return np.dtype(param.dtype)
    except TypeError:
        cai = getattr(param, "__cuda_array_interface__", None)
        if cai is None:
            raise
        return np.dtype(cai["typestr"])


def _library(param: Any) -> Any:
    """The array namespace of a parameter shard; None for a Numba device array (which has
    none: its state buffers are Numba device arrays too) and for a device array of a
    library without an array namespace (a torch CUDA tensor: Numba device buffers too)."""
    if kernels.is_device_array(param) and hasattr(param, "copy_to_host"):
        return None  # (the simulator's arrays pass __array_namespace__ on to NumPy's)
    try:
        return arrays.namespace(param)
    except TypeError:
        if kernels.is_device_array(param):
            return None
        raise
