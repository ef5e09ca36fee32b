"""Adagrad with learning-rate decay.

Semantics of ``torch.optim.Adagrad``; formulas in ``docs/optimizers.md``.
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

__all__ = ["Adagrad", "fused_adagrad"]


@register_jitable
def _adagrad(i, p, g, state_sum, grad_scale, weight_decay, clr, eps):  # pragma: no cover
    pi = p[i]
    d = grad_scale * g[i] + weight_decay * pi
    s = state_sum[i] + d * d
    state_sum[i] = s
    std = math.sqrt(s) + eps
    p[i] = pi - clr * (d / std)


@loop
def _adagrad_cpu(p, g, state_sum, grad_scale, weight_decay, clr, eps):  # pragma: no cover
    for i in prange(p.shape[0]):
        _adagrad(i, p, g, state_sum, grad_scale, weight_decay, clr, eps)


_UPDATE = kernels.Update("adagrad", _adagrad, _adagrad_cpu,
                         arrays=("param", "grad", "state_sum"), written=("param", "state_sum"))


def fused_adagrad(param: Any, grad: Any, state_sum: Any, *, clr: float, eps: float,
                  weight_decay: float = 0.0, grad_scale: float = 1.0) -> None:
    """Adagrad update in one pass with the step's learning rate ``clr``. Not collective."""
    _UPDATE((param, grad, state_sum), (grad_scale, weight_decay, clr, eps))


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad as in ``torch.optim.Adagrad``: state ``sum``, initialised to
    ``initial_accumulator_value``."""

    name: ClassVar[str] = "adagrad"
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        o = type(self).__name__
        self._set("lr_decay", check_real(o, "lr_decay", self.lr_decay, low=0.0))
        self._set("weight_decay", check_real(o, "weight_decay", self.weight_decay, low=0.0))
        self._set(
            "initial_accumulator_value",
            check_real(o, "initial_accumulator_value", self.initial_accumulator_value, low=0.0),
        )
        self._set("eps", check_real(o, "eps", self.eps, low=0.0, low_open=True))
        self._set("maximize", check_bool(o, "maximize", self.maximize))

    def state_names(self) -> tuple[str, ...]:
        return ("sum",)

    def _initial_value(self, name: str) -> float:
        return self.initial_accumulator_value

    def _update(
        self, param: Any, grad: Any, state: OptimizerState, grad_scale: float, lr: float, step: int
    ) -> None:
        fused_adagrad(param, grad, state.buffers["sum"], clr=lr / (1 + (step - 1) * self.lr_decay),
                      eps=self.eps, weight_decay=self.weight_decay, grad_scale=grad_scale)
