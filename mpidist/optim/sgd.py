"""Stochastic gradient descent with momentum, dampening, Nesterov and weight decay.

Semantics of ``torch.optim.SGD``; the formulas are in ``docs/optimizers.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mpidist import kernels
from mpidist.optim.base import Optimizer, OptimizerState, check_bool, check_real

__all__ = ["SGD"]


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
        gs = -grad_scale if self.maximize else grad_scale
        if self.momentum == 0.0:
            kernels.sgd(param, grad, lr=lr, weight_decay=self.weight_decay, grad_scale=gs)
            return
        kernels.sgd(
            param,
            grad,
            state.buffers["momentum_buffer"],
            lr=lr,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            dampening=self.dampening,
            nesterov=self.nesterov,
            first=step == 1,
            grad_scale=gs,
        )
