"""A functional interface for any framework: NumPy parameters and a loss-and-gradient function.

The user supplies ``params`` (``{name: ndarray}``, the initial values) and
``loss_and_grad(params, batch) -> (loss, grads)`` where ``batch`` is ``(inputs, targets)``
and ``grads`` is ``{name: ndarray}``. JAX, autograd, hand-written NumPy... anything that can
take NumPy arrays and return NumPy arrays works. The function receives read-only views of
the strategy's flat parameter buffer (no copies) and its returned gradients are written into
the flat gradient buffer, which the strategy then synchronises over MPI.

Normalisation: with ``reduction="mean"`` (default) the function returns the *mean* loss over
the samples of the batch it is given (tokens, for integer targets of more than one axis: the
count mpidist's losses use) and the gradient of that mean; with ``reduction="sum"`` the sum.
The adapter rescales both to mpidist's world-size-invariant convention (sum over the local
samples divided by the global count of the step), so the training trajectory is the same at
every data-parallel size and micro-batch count.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

from mpidist.core.buffers import FlatBuffer
from mpidist.parallel import ShardedOptimizer, ShardingConfiguration
from mpidist.parallel.adapters.common import Trainer, make_optimizer
from mpidist.parallel.registry import DEFAULT_STRATEGY

__all__ = ["FunctionalLoss", "FunctionalModel", "FunctionalOptimizer"]

LossAndGrad = Callable[[Mapping[str, np.ndarray], tuple[Any, Any]],
                       tuple[float, Mapping[str, np.ndarray]]]


def _count(targets: Any) -> int:
    y = np.asarray(targets)
    if y.dtype.kind in "iu":
        return int(y.size)
    return int(y.shape[0]) if y.ndim else 1


class FunctionalModel:
    """Parameters plus a ``loss_and_grad`` function, usable as an mpidist module (one unit).

    Args:
        params: ``{name: array}`` initial values (floating point). Their names and shapes
            define the flat-buffer layout; the values are copied in by ``init_parameters``
            (the strategies then broadcast them from dp rank 0).
        loss_and_grad: ``(params, (inputs, targets)) -> (loss, {name: grad})``. A name left
            out of the gradients means a zero gradient.
        reduction: ``"mean"`` or ``"sum"``: what ``loss_and_grad`` returns (see module doc).

    Use it with :class:`FunctionalOptimizer`, or pass ``model.loss`` as the ``loss=`` of a
    strategy optimizer: the loss function runs inside the strategy's loss call and the
    gradients are accumulated in the module's backward.
    """

    def __init__(self, params: Mapping[str, np.ndarray], loss_and_grad: LossAndGrad, *,
                 reduction: str = "mean") -> None:
        if not callable(loss_and_grad):
            raise ValueError(f"loss_and_grad={loss_and_grad!r} is not callable")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
        if not params:
            raise ValueError("params is empty")
        self._initial: dict[str, np.ndarray] = {}
        for name, value in params.items():
            arr = np.asarray(value)
            if not isinstance(name, str) or not name:
                raise ValueError(f"parameter name {name!r} must be a non-empty string")
            if arr.dtype.kind != "f":
                raise ValueError(f"parameter {name!r} has dtype {arr.dtype}, expected float")
            self._initial[name] = arr
        self.loss_and_grad = loss_and_grad
        self.reduction = reduction
        self._params: dict[str, np.ndarray] | None = None
        self._readonly: dict[str, np.ndarray] | None = None
        self._grads: dict[str, np.ndarray] | None = None
        self._cache: dict[Hashable, Any] = {}
        self.loss = FunctionalLoss(self)

    # -- the module protocol --------------------------------------------------------------
    def named_parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every parameter: the layout of the flat buffers."""
        return [(n, tuple(a.shape)) for n, a in self._initial.items()]

    def parameter_names(self, include_shared: bool = True) -> list[str]:
        """Names of the parameters (nothing is shared)."""
        return list(self._initial)

    def num_parameters(self) -> int:
        return int(sum(a.size for a in self._initial.values()))

    def bind(self, params: Mapping[str, np.ndarray] | FlatBuffer,
             grads: Mapping[str, np.ndarray] | FlatBuffer | None = None) -> FunctionalModel:
        """Use these arrays (views into flat buffers) as parameter and gradient storage.
        Names not owned here are ignored; a missing name or wrong shape raises ValueError."""
        if isinstance(params, FlatBuffer):
            params = params.views()
        if isinstance(grads, FlatBuffer):
            grads = grads.views()
        p = {n: _lookup(params, n, a.shape, "parameter") for n, a in self._initial.items()}
        g = None if grads is None else \
            {n: _lookup(grads, n, a.shape, "gradient") for n, a in self._initial.items()}
        ro = {}
        for n, v in p.items():
            view = v.view()
            view.flags.writeable = False
            ro[n] = view
        self._params, self._readonly, self._grads = p, ro, g
        return self

    def unbind(self) -> None:
        self._params = self._readonly = self._grads = None

    def init_parameters(self, seed: int = 0) -> None:
        """Copy the initial values given at construction into the bound storage (``seed``
        is unused: the values are the user's)."""
        params = self._require_params()
        for n, a in self._initial.items():
            params[n][...] = a

    def forward(self, x: Any, ctx: Hashable = None) -> Any:
        """Keep the inputs for the loss call; the "output" is the inputs themselves."""
        self._require_params()
        return x

    def backward(self, dy: Any, ctx: Hashable = None) -> None:
        """Accumulate (``+=``) the gradients the loss call computed into the bound gradient
        arrays. ``dy`` is what :meth:`FunctionalLoss.backward` returned."""
        if self._grads is None:
            raise RuntimeError("FunctionalModel.backward: no gradient storage is bound")
        grads, factor = dy
        for n, g in grads.items():
            dst = self._grads[n]
            if factor == 1.0:
                dst += g
            else:
                dst += factor * np.asarray(g, dtype=dst.dtype)
        return None

    def clear_cache(self) -> None:
        self.loss._cache.clear()

    # -- conveniences -----------------------------------------------------------------
    @property
    def params(self) -> dict[str, np.ndarray]:
        """The bound parameter arrays (views into the flat buffer)."""
        return dict(self._require_params())

    def _require_params(self) -> dict[str, np.ndarray]:
        if self._params is None:
            raise RuntimeError("FunctionalModel has no bound parameters; wrap it in a strategy "
                               "(FunctionalOptimizer) or call bind() first")
        return self._params

    def _call(self, batch: tuple[Any, Any]) -> tuple[float, dict[str, np.ndarray]]:
        self._require_params()
        loss, grads = self.loss_and_grad(self._readonly, batch)
        if not isinstance(grads, Mapping):
            raise ValueError(f"loss_and_grad returned gradients of type "
                             f"{type(grads).__name__}; expected a dict name -> array")
        out = {}
        for n, g in grads.items():
            if n not in self._initial:
                raise ValueError(f"loss_and_grad returned a gradient for unknown parameter "
                                 f"{n!r}; parameters: {list(self._initial)}")
            g = np.asarray(g)
            if g.shape != self._initial[n].shape:
                raise ValueError(f"gradient {n!r} has shape {g.shape}, expected "
                                 f"{self._initial[n].shape}")
            out[n] = g
        return float(loss), out

    def __repr__(self) -> str:
        return (f"FunctionalModel({len(self._initial)} tensors, {self.num_parameters()} "
                f"parameters, reduction={self.reduction!r})")


class FunctionalLoss:
    """The loss a strategy calls for a :class:`FunctionalModel`: runs ``loss_and_grad`` and
    rescales its loss and gradients to the global normaliser of the step."""

    def __init__(self, model: FunctionalModel) -> None:
        self.model = model
        self._cache: dict[Hashable, Any] = {}

    def forward(self, outputs: Any, targets: Any, normalizer: float | None = None,
                ctx: Hashable = None) -> float:
        count = _count(targets)
        if normalizer is None:
            normalizer = count
        if not float(normalizer) > 0:
            raise ValueError(f"normalizer={normalizer!r} must be > 0")
        loss, grads = self.model._call((outputs, targets))
        local = count if self.model.reduction == "mean" else 1
        factor = local / float(normalizer)
        self._cache[ctx] = (grads, factor)
        return loss * factor

    def backward(self, dy: float = 1.0, ctx: Hashable = None) -> tuple[dict, float]:
        try:
            grads, factor = self._cache.pop(ctx)
        except KeyError:
            raise RuntimeError(f"FunctionalLoss.backward(ctx={ctx!r}) has no matching "
                               "forward") from None
        return grads, factor * float(dy)


class FunctionalOptimizer(Trainer):
    """Train a :class:`FunctionalModel` with an mpidist strategy.

    ``FunctionalOptimizer(model, strategy=..., optimizer=Adam(lr=1e-3), config=...)``;
    ``step((inputs, targets)) -> global loss`` is collective over the data-parallel group
    (every rank passes its slice of the global batch, equal sizes). ``strategy`` is a
    data-parallel strategy of sharding level 0, 1 or 2 (default: level 0, replicated; a
    FunctionalModel is one unit, so level 3 does not apply). Construction is collective:
    parameters are broadcast from dp rank 0.
    """

    def __init__(self, model: FunctionalModel,
                 strategy: str | type[ShardedOptimizer] = DEFAULT_STRATEGY,
                 optimizer: Any = None, config: ShardingConfiguration | None = None, *,
                 lr_schedule: Any = None) -> None:
        if not isinstance(model, FunctionalModel):
            raise ValueError(f"model must be a FunctionalModel, got {type(model).__name__}")
        opt = make_optimizer(strategy, optimizer, config, loss=model.loss,
                             lr_schedule=lr_schedule)
        super().__init__(model, opt)

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The current parameters (views into this rank's flat buffer; for ZeRO-1/2 the full
        parameters are kept on every rank, so these are complete after each step)."""
        return self.module.params


def _lookup(arrays: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...],
            what: str) -> np.ndarray:
    try:
        arr = arrays[name]
    except KeyError:
        raise ValueError(f"{what} {name!r} is missing from the arrays given to bind") from None
    if not isinstance(arr, np.ndarray) or tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{what} {name!r} has shape {np.shape(arr)}, expected {tuple(shape)}")
    return arr
