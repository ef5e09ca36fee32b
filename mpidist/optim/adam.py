"""Adam (L2 weight decay in the gradient) and AdamW (decoupled weight decay), with AMSGrad.

Semantics of ``torch.optim.Adam`` and ``torch.optim.AdamW``; formulas in
``docs/optimizers.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mpidist import kernels
from mpidist.optim.base import Optimizer, OptimizerState, check_betas, check_bool, check_real

__all__ = ["Adam", "AdamW"]


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam as in ``torch.optim.Adam``: state ``exp_avg``, ``exp_avg_sq`` and, with
    ``amsgrad``, ``max_exp_avg_sq``. ``weight_decay`` is an L2 term added to the gradient."""

    name: ClassVar[str] = "adam"
    decoupled: ClassVar[bool] = False
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        o = type(self).__name__
        self._set("betas", check_betas(o, self.betas))
        self._set("eps", check_real(o, "eps", self.eps, low=0.0, low_open=True))
        self._set("weight_decay", check_real(o, "weight_decay", self.weight_decay, low=0.0))
        self._set("amsgrad", check_bool(o, "amsgrad", self.amsgrad))
        self._set("maximize", check_bool(o, "maximize", self.maximize))

    def state_names(self) -> tuple[str, ...]:
        if self.amsgrad:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")

    def _update(
        self, param: Any, grad: Any, state: OptimizerState, grad_scale: float, lr: float, step: int
    ) -> None:
        beta1, beta2 = self.betas
        # Computed on the host in float64 exactly as PyTorch does, once per step.
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        if self.decoupled:
            l2, decay = 0.0, 1.0 - lr * self.weight_decay
        else:
            l2, decay = self.weight_decay, 1.0
        b = state.buffers
        kernels.adam(
            param,
            grad,
            b["exp_avg"],
            b["exp_avg_sq"],
            b["max_exp_avg_sq"] if self.amsgrad else None,
            step_size=lr / bias_correction1,
            bias_correction2_sqrt=bias_correction2**0.5,
            beta1=beta1,
            beta2=beta2,
            eps=self.eps,
            weight_decay=l2,
            decay=decay,
            grad_scale=-grad_scale if self.maximize else grad_scale,
        )


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW as in ``torch.optim.AdamW``: the parameter is multiplied by
    ``1 - lr*weight_decay`` before the Adam step; the gradient carries no L2 term."""

    name: ClassVar[str] = "adamw"
    decoupled: ClassVar[bool] = True
    weight_decay: float = 1e-2
