"""RMSprop with momentum and the centered variant.

Semantics of ``torch.optim.RMSprop``; formulas in ``docs/optimizers.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from numba import prange
from numba.extending import register_jitable

from mpidist.optim import kernels
from mpidist.optim.base import Optimizer, OptimizerState, check_bool, check_real
from mpidist.optim.kernels.cpu import loop

__all__ = ["RMSprop", "fused_rmsprop"]


@register_jitable
def _rmsprop(i, p, g, square_avg, grad_avg, buf, grad_scale, weight_decay, lr, alpha,
             one_minus_alpha, eps, momentum, centered,
             use_momentum):  # pragma: no cover - compiled
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


@loop
def _rmsprop_cpu(p, g, square_avg, grad_avg, buf, grad_scale, weight_decay, lr, alpha,
                 one_minus_alpha, eps, momentum, centered,
                 use_momentum):  # pragma: no cover - compiled
    for i in prange(p.shape[0]):
        _rmsprop(i, p, g, square_avg, grad_avg, buf, grad_scale, weight_decay, lr, alpha,
                 one_minus_alpha, eps, momentum, centered, use_momentum)


_UPDATE = kernels.Update(
    "rmsprop", _rmsprop, _rmsprop_cpu,
    arrays=("param", "grad", "square_avg", "grad_avg", "momentum_buffer"),
    written=("param", "square_avg", "grad_avg", "momentum_buffer"),
    optional=("grad_avg", "momentum_buffer"),
)


def fused_rmsprop(param: Any, grad: Any, square_avg: Any, grad_avg: Any = None,
                  momentum_buffer: Any = None, *, lr: float, alpha: float, eps: float,
                  weight_decay: float = 0.0, momentum: float = 0.0,
                  grad_scale: float = 1.0) -> None:
    """RMSprop update in one pass; centered when ``grad_avg`` is given, with momentum when
    ``momentum_buffer`` is given. Not collective."""
    _UPDATE((param, grad, square_avg, grad_avg, momentum_buffer),
            (grad_scale, weight_decay, lr, alpha, 1.0 - alpha, eps, momentum,
             grad_avg is not None, momentum_buffer is not None))


@dataclass(frozen=True)
class RMSprop(Optimizer):
    """RMSprop as in ``torch.optim.RMSprop``: state ``square_avg``, plus ``grad_avg`` when
    centered and ``momentum_buffer`` when ``momentum > 0``."""

    name: ClassVar[str] = "rmsprop"
    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        o = type(self).__name__
        self._set("alpha", check_real(o, "alpha", self.alpha, low=0.0, high=1.0, high_open=True))
        self._set("eps", check_real(o, "eps", self.eps, low=0.0, low_open=True))
        self._set("weight_decay", check_real(o, "weight_decay", self.weight_decay, low=0.0))
        self._set("momentum", check_real(o, "momentum", self.momentum, low=0.0))
        self._set("centered", check_bool(o, "centered", self.centered))
        self._set("maximize", check_bool(o, "maximize", self.maximize))

    def state_names(self) -> tuple[str, ...]:
        names = ["square_avg"]
        if self.centered:
            names.append("grad_avg")
        if self.momentum > 0.0:
            names.append("momentum_buffer")
        return tuple(names)

    def _update(
        self, param: Any, grad: Any, state: OptimizerState, grad_scale: float, lr: float, step: int
    ) -> None:
        b = state.buffers
        fused_rmsprop(param, grad, b["square_avg"], b["grad_avg"] if self.centered else None,
                      b["momentum_buffer"] if self.momentum > 0.0 else None, lr=lr,
                      alpha=self.alpha, eps=self.eps, weight_decay=self.weight_decay,
                      momentum=self.momentum, grad_scale=grad_scale)
