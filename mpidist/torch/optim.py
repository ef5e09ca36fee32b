"""torch optimizers whose update is one of mpidist's fused kernels.

``Adam``, ``AdamW`` and ``SGD`` are ``torch.optim.Adam``, ``AdamW`` and ``SGD`` (their
constructors, checks, parameter groups, ``state_dict``/``load_state_dict`` and state layout
are torch's own, so state dicts move between the two freely); only ``step`` differs: each
parameter is updated by ONE pass of mpidist's fused kernel over its elements (Numba ``njit``
on CPU tensors, ``numba.cuda`` on CUDA tensors, through ``__cuda_array_interface__``) instead
of torch's sequence of elementwise operations. The results equal torch's to round-off
(float64: 1e-10 relative, in the tests).

They work wherever a torch optimizer does on local tensors: alone, as the
``optimizer_class`` of :class:`~mpidist.torch.ZeroRedundancyOptimizer`, on the shards of
:func:`mpidist.torch.fully_shard`, and on the DTensor parameters of torch's own
``fully_shard`` or tensor parallelism (each rank updates its local shard; the update is
elementwise, so no communication is needed). Parameters and gradients must be float32 or
float64 and of one dtype and device each; options torch's fused or capturable paths need
(``capturable``, ``differentiable``, ``fused``, ``foreach``) are refused with one line.

Not collective: ``step`` updates this rank's tensors only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from mpidist.optim import fused_adam, fused_sgd

__all__ = ["SGD", "Adam", "AdamW"]

_UNSUPPORTED = ("foreach", "fused", "capturable", "differentiable")


def _refuse(cls: str, options: dict[str, Any]) -> None:
    for name in _UNSUPPORTED:
        if options.get(name):
            raise ValueError(f"mpidist.torch.optim.{cls}: {name}={options[name]!r} is not "
                             "supported (the update is always mpidist's fused kernel)")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel updates: a DTensor's local shard, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _array(t: torch.Tensor, what: str) -> Any:
    """A flat view the kernels take: a NumPy view of a CPU tensor, the CUDA tensor itself
    (its ``__cuda_array_interface__``) flattened. Raises for non-contiguous tensors."""
    t = _local(t).detach()
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous; the fused update needs contiguous "
                         "parameters, gradients and state")
    flat = t.view(-1)
    return flat.numpy() if flat.device.type == "cpu" else flat


def _step_value(state: dict[str, Any]) -> float:
    """Increment the step counter (a float tensor, as torch keeps it) and return it."""
    step = state["step"]
    step += 1
    return float(step.item())


def _step(opt: Any, closure: Callable[[], Any] | None) -> Any:
    """The body of each class's ``step``: ``closure()`` with gradients enabled, then
    ``opt._update(p, group)`` for every parameter that has a (dense) gradient."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(f"{type(opt).__name__}: sparse gradients are not supported")
            opt._update(p, group)
    return loss


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class _FusedAdam:
    """The fused step of :class:`Adam` and :class:`AdamW` (mixed into torch's classes)."""

    _decoupled = False
    param_groups: list[dict[str, Any]]
    state: dict[Any, dict[str, Any]]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient; returns ``closure()``'s loss.
        Not collective."""
        return _step(self, closure)

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for name in names:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = _step_value(state)
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        decoupled = group.get("decoupled_weight_decay", self._decoupled)
        l2, decay = (0.0, 1.0 - lr * wd) if decoupled else (wd, 1.0)
        fused_adam(
            _array(p, "parameter"), _array(p.grad, "gradient"),
            _array(state["exp_avg"], "exp_avg"), _array(state["exp_avg_sq"], "exp_avg_sq"),
            _array(state["max_exp_avg_sq"], "max_exp_avg_sq") if group["amsgrad"] else None,
            step_size=lr / (1.0 - beta1**step),
            bias_correction2_sqrt=(1.0 - beta2**step) ** 0.5,
            beta1=beta1, beta2=beta2, eps=float(group["eps"]), weight_decay=l2, decay=decay,
            grad_scale=-1.0 if group["maximize"] else 1.0,
        )


class Adam(_FusedAdam, torch.optim.Adam):
    """``torch.optim.Adam`` whose update is :func:`mpidist.optim.fused_adam` (one fused pass per
    parameter; ``amsgrad``, ``maximize`` and L2 ``weight_decay`` as torch). Not collective."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *,
                 maximize: bool = False, **options: Any) -> None:
        _refuse(type(self).__name__, options)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, **options)


class AdamW(_FusedAdam, torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay: ``p *= 1 - lr*weight_decay`` in the
    same pass) whose update is :func:`mpidist.optim.fused_adam`. Not collective."""

    _decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, **options: Any) -> None:
        _refuse(type(self).__name__, options)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, maximize=maximize, **options)


class SGD(torch.optim.SGD):
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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every parameter with a gradient; returns ``closure()``'s loss.
        Not collective."""
        return _step(self, closure)

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        momentum = float(group["momentum"])
        scale = -1.0 if group["maximize"] else 1.0
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        if momentum == 0.0:
            fused_sgd(_array(p, "parameter"), _array(p.grad, "gradient"), lr=lr,
                        weight_decay=wd, grad_scale=scale)
            return
        state = self.state[p]
        first = state.get("momentum_buffer") is None
        if first:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        fused_sgd(_array(p, "parameter"), _array(p.grad, "gradient"),
                    _array(state["momentum_buffer"], "momentum_buffer"), lr=lr,
                    weight_decay=wd, momentum=momentum, dampening=float(group["dampening"]),
                    nesterov=bool(group["nesterov"]), first=first, grad_scale=scale)
