"""RMSprop with momentum and the centered variant.

Semantics of ``torch.optim.RMSprop``; formulas in ``docs/optimizers.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mpidist import kernels
from mpidist.optim.base import Optimizer, OptimizerState, check_bool, check_real

__all__ = ["RMSprop"]


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
        kernels.rmsprop(
            param,
            grad,
            b["square_avg"],
            b["grad_avg"] if self.centered else None,
            b["momentum_buffer"] if self.momentum > 0.0 else None,
            lr=lr,
            alpha=self.alpha,
            eps=self.eps,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            grad_scale=-grad_scale if self.maximize else grad_scale,
        )
