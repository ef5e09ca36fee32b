"""torch optimizers whose update is one of mpidist's fused kernels.

``Adam``, ``AdamW`` and ``SGD`` are ``torch.optim``'s classes (constructors, checks, groups,
state dicts and state layout are torch's own) whose ``step`` updates the parameters with ONE
pass of mpidist's fused kernel (Numba ``njit`` on CPU tensors, ``numba.cuda`` on CUDA
tensors; Adam/AdamW: one launch per flat bucket of a parameter group, see
:mod:`mpidist.torch.optim_flat`; SGD: one per parameter), equal to torch's to round-off.
They work on local tensors, shards and DTensors (each rank updates its local shard).
Parameters and gradients must be float32 or float64; ``capturable``, ``differentiable``,
``fused`` and ``foreach`` are refused with one line.

Not collective: ``step`` updates this rank's tensors only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from mpidist.optim import fused_sgd
from mpidist.torch.optim_flat import FlatAdam, adam_update, kernel_array, scalar_dtype

__all__ = ["SGD", "Adam", "AdamW"]

_UNSUPPORTED = ("foreach", "fused", "capturable", "differentiable")


def _refuse(cls: str, options: dict[str, Any]) -> None:
    for name in _UNSUPPORTED:
        if options.get(name):
            raise ValueError(f"mpidist.torch.optim.{cls}: {name}={options[name]!r} is not "
                             "supported (the update is always mpidist's fused kernel)")


class _Fused:
    """The ``step`` mixed into torch's classes: ``_update(p, group)`` (the fused kernel) of
    every parameter with a gradient."""

    param_groups: list[dict[str, Any]]
    state: dict[Any, dict[str, Any]]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient; returns ``closure()``'s loss.
        Not collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._groups_step()
        return loss

    def _groups_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self._checked_update(p, group)

    def _checked_update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        if p.grad is None:
            return
        if p.grad.is_sparse:
            raise ValueError(f"{type(self).__name__}: sparse gradients are not supported")
        self._update(p, group)

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError


class _FusedAdam(_Fused):
    """The fused update of :class:`Adam` and :class:`AdamW`: the multi-tensor path of
    :mod:`mpidist.torch.optim_flat` (``flat=True``, the default), else one launch per
    parameter."""

    _decoupled = False
    _flat: FlatAdam | None

    def _groups_step(self) -> None:
        if self._flat is None:
            super()._groups_step()
            return
        for index, group in enumerate(self.param_groups):
            for p in self._flat.step_group(index, group, self.state):
                self._checked_update(p, group)

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:  # the step counter is a float tensor, as torch keeps it
            state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
            names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for name in names:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        arrays = [kernel_array(p, "parameter"), kernel_array(p.grad, "gradient")]
        adam_update(arrays + [kernel_array(state[n], n) for n in names], group,
                    float(state["step"].item()), self._decoupled)


class Adam(_FusedAdam, torch.optim.Adam):
    """``torch.optim.Adam`` whose update is :func:`mpidist.optim.fused_adam` (one fused pass per
    flat bucket of parameters, ``flat=False``: per parameter; ``amsgrad``, ``maximize`` and
    L2 ``weight_decay`` as torch). Not collective."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *,
                 maximize: bool = False, flat: bool = True, **options: Any) -> None:
        _refuse(type(self).__name__, options)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, **options)
        self._flat = FlatAdam(self._decoupled) if flat else None


class AdamW(_FusedAdam, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay: ``p *= 1 - lr*weight_decay`` in the
    same pass) whose update is :func:`mpidist.optim.fused_adam`. Not collective."""

    _decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, flat: bool = True, **options: Any) -> None:
        _refuse(type(self).__name__, options)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, **options)
        self._flat = FlatAdam(self._decoupled) if flat else None


class SGD(_Fused, torch.optim.SGD):
    """``torch.optim.SGD`` whose update is :func:`mpidist.optim.fused_sgd` (momentum, dampening,
    nesterov, ``maximize`` and weight decay as torch; the momentum buffer is set to the
    first step's gradient). Not collective."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 *, maximize: bool = False, **options: Any) -> None:
        _refuse(type(self).__name__, options)
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                         **options)

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        momentum = float(group["momentum"])
        scale = -1.0 if group["maximize"] else 1.0
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        if momentum == 0.0:
            fused_sgd(kernel_array(p, "parameter"), kernel_array(p.grad, "gradient"), lr=lr,
                        weight_decay=wd, grad_scale=scale)
            return
        state = self.state[p]
        first = state.get("momentum_buffer") is None
        if first:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        fused_sgd(kernel_array(p, "parameter"), kernel_array(p.grad, "gradient"),
                    kernel_array(state["momentum_buffer"], "momentum_buffer"), lr=lr,
                    weight_decay=wd, momentum=momentum, dampening=float(group["dampening"]),
                    nesterov=bool(group["nesterov"]), first=first, grad_scale=scale)
