"""Stochastic gradient descent with momentum, dampening, Nesterov and weight decay.

Semantics of ``torch.optim.SGD``; the formulas are in ``docs/optimizers.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from numba import prange
from numba.extending import register_jitable

from mpidist.optim import kernels
from mpidist.optim.base import Optimizer, OptimizerState, check_bool, check_real
from mpidist.optim.kernels.cpu import loop

__all__ = ["SGD", "fused_sgd"]


@register_jitable
def _sgd(i, p, g, buf, grad_scale, weight_decay, lr, momentum, one_minus_dampening,
         nesterov, first, use_momentum):  # pragma: no cover - compiled
    pi = p[i]
    d = grad_scale * g[i] + weight_decay * pi
    if use_momentum:
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


@loop
def _sgd_cpu(p, g, buf, grad_scale, weight_decay, lr, momentum, one_minus_dampening,
             nesterov, first, use_momentum):  # pragma: no cover - compiled
    for i in prange(p.shape[0]):
        _sgd(i, p, g, buf, grad_scale, weight_decay, lr, momentum, one_minus_dampening,
             nesterov, first, use_momentum)


_UPDATE = kernels.Update("sgd", _sgd, _sgd_cpu, arrays=("param", "grad", "momentum_buffer"),
                         written=("param", "momentum_buffer"), optional=("momentum_buffer",))


def fused_sgd(param: Any, grad: Any, momentum_buffer: Any = None, *, lr: float,
              weight_decay: float = 0.0, momentum: float = 0.0, dampening: float = 0.0,
              nesterov: bool = False, first: bool = False, grad_scale: float = 1.0) -> None:
    """SGD update in one pass: ``d = grad_scale*grad + weight_decay*param``; with a
    ``momentum_buffer``: ``buf = d`` if ``first`` else ``momentum*buf + (1-dampening)*d``,
    then ``d = d + momentum*buf`` (nesterov) or ``d = buf``; finally ``param -= lr*d``.
    Not collective."""
    _UPDATE((param, grad, momentum_buffer),
            (grad_scale, weight_decay, lr, momentum, 1.0 - dampening, bool(nesterov),
             bool(first), momentum_buffer is not None))


@dataclass(frozen=True)
class SGD(Optimizer):
    """SGD as in ``torch.optim.SGD``: state ``momentum_buffer`` when ``momentum > 0``."""

    name: ClassVar[str] = "sgd"
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        o = type(self).__name__
        self._set("momentum", check_real(o, "momentum", self.momentum, low=0.0))
        self._set("dampening", check_real(o, "dampening", self.dampening, low=0.0, high=1.0))
        self._set("weight_decay", check_real(o, "weight_decay", self.weight_decay, low=0.0))
        self._set("nesterov", check_bool(o, "nesterov", self.nesterov))
        self._set("maximize", check_bool(o, "maximize", self.maximize))
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise ValueError(
                f"{o}: nesterov=True requires momentum > 0 and dampening == 0, got "
                f"momentum={self.momentum!r}, dampening={self.dampening!r}"
            )

    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum > 0.0 else ()

    def _update(
        self, param: Any, grad: Any, state: OptimizerState, grad_scale: float, lr: float, step: int
    ) -> None:
        if self.momentum == 0.0:
            fused_sgd(param, grad, lr=lr, weight_decay=self.weight_decay, grad_scale=grad_scale)
            return
        fused_sgd(param, grad, state.buffers["momentum_buffer"], lr=lr,
                  weight_decay=self.weight_decay, momentum=self.momentum,
                  dampening=self.dampening, nesterov=self.nesterov, first=step == 1,
                  grad_scale=grad_scale)
