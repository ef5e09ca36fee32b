"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Semantics of the paper's Algorithm 2 and of ``lion-pytorch``: the update is the sign of an
interpolation of momentum and gradient, weight decay is decoupled (``p *= 1 - lr*wd``).
Formulas in ``docs/optimizers.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mpidist import kernels
from mpidist.optim.base import Optimizer, OptimizerState, check_betas, check_real

__all__ = ["Lion"]


@dataclass(frozen=True)
class Lion(Optimizer):
    """Lion as in ``lion_pytorch.Lion``: state ``exp_avg``."""

    name: ClassVar[str] = "lion"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        o = type(self).__name__
        self._set("betas", check_betas(o, self.betas))
        self._set("weight_decay", check_real(o, "weight_decay", self.weight_decay, low=0.0))

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg",)

    def _update(
        self, param: Any, grad: Any, state: OptimizerState, grad_scale: float, lr: float, step: int
    ) -> None:
        beta1, beta2 = self.betas
        kernels.lion(
            param,
            grad,
            state.buffers["exp_avg"],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            decay=1.0 - lr * self.weight_decay,
            grad_scale=grad_scale,
        )
