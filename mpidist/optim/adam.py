"""Adam (L2 weight decay in the gradient) and AdamW (decoupled weight decay), with AMSGrad.

Semantics of ``torch.optim.Adam`` and ``torch.optim.AdamW``; formulas in
``docs/optimizers.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from numba import prange
from numba.extending import register_jitable

from mpidist.optim import kernels
from mpidist.optim.base import Optimizer, OptimizerState, check_betas, check_bool, check_real
from mpidist.optim.kernels.cpu import loop

__all__ = ["Adam", "AdamW", "fused_adam"]


@register_jitable
def _adam(i, p, g, m, v, vmax, grad_scale, weight_decay, decay, beta1, one_minus_beta1, beta2,
          one_minus_beta2, step_size, bias_correction2_sqrt, eps,
          amsgrad):  # pragma: no cover - compiled
    pi = p[i]
    d = grad_scale * g[i] + weight_decay * pi
    mi = beta1 * m[i] + one_minus_beta1 * d
    vi = beta2 * v[i] + one_minus_beta2 * d * d
    m[i] = mi
    v[i] = vi
    if amsgrad:  # the denominator uses the running maximum of v
        mx = vmax[i]
        if vi > mx:
            mx = vi
        vmax[i] = mx
        vi = mx
    denom = math.sqrt(vi) / bias_correction2_sqrt + eps
    p[i] = pi * decay - step_size * (mi / denom)


@loop
def _adam_cpu(p, g, m, v, vmax, grad_scale, weight_decay, decay, beta1, one_minus_beta1, beta2,
              one_minus_beta2, step_size, bias_correction2_sqrt, eps,
              amsgrad):  # pragma: no cover - compiled
    for i in prange(p.shape[0]):
        _adam(i, p, g, m, v, vmax, grad_scale, weight_decay, decay, beta1, one_minus_beta1,
              beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps, amsgrad)


_UPDATE = kernels.Update(
    "adam", _adam, _adam_cpu,
    arrays=("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    written=("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), optional=("max_exp_avg_sq",),
)


def fused_adam(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any,
               max_exp_avg_sq: Any = None, *, step_size: float, bias_correction2_sqrt: float,
               beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
               decay: float = 1.0, grad_scale: float = 1.0) -> None:
    """Adam/AdamW update in one pass. ``weight_decay`` is Adam's L2 term (added to the
    gradient), ``decay`` AdamW's factor ``1 - lr*weight_decay`` on the parameter;
    ``step_size = lr/(1-beta1**t)``, ``bias_correction2_sqrt = (1-beta2**t)**0.5``. With
    ``max_exp_avg_sq`` (AMSGrad) the denominator uses the running maximum of ``exp_avg_sq``.
    Not collective."""
    _UPDATE((param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq),
            (grad_scale, weight_decay, decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2,
             step_size, bias_correction2_sqrt, eps, max_exp_avg_sq is not None))


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
        fused_adam(param, grad, b["exp_avg"], b["exp_avg_sq"],
                   b["max_exp_avg_sq"] if self.amsgrad else None,
                   step_size=lr / bias_correction1, bias_correction2_sqrt=bias_correction2**0.5,
                   beta1=beta1, beta2=beta2, eps=self.eps, weight_decay=l2, decay=decay,
                   grad_scale=grad_scale)


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW as in ``torch.optim.AdamW``: the parameter is multiplied by
    ``1 - lr*weight_decay`` before the Adam step; the gradient carries no L2 term."""

    name: ClassVar[str] = "adamw"
    decoupled: ClassVar[bool] = True
    weight_decay: float = 1e-2
