"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Semantics of the paper's Algorithm 2 and of ``lion-pytorch``: the update is the sign of an
interpolation of momentum and gradient, weight decay is decoupled (``p *= 1 - lr*wd``).
Formulas in ``docs/optimizers.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from numba import prange
from numba.extending import register_jitable

from mpidist.optim import kernels
from mpidist.optim.base import Optimizer, OptimizerState, check_betas, check_real
from mpidist.optim.kernels.cpu import loop

__all__ = ["Lion", "fused_lion"]


@register_jitable
def _lion(i, p, g, m, grad_scale, decay, lr, beta1, one_minus_beta1, beta2,
          one_minus_beta2):  # pragma: no cover - compiled
    d = grad_scale * g[i]
    mi = m[i]
    c = beta1 * mi + one_minus_beta1 * d
    pi = p[i] * decay
    # Branches instead of sign(): p - lr*sign(c) is exactly one of these three values.
    if c > 0:
        pi = pi - lr
    elif c < 0:
        pi = pi + lr
    p[i] = pi
    m[i] = beta2 * mi + one_minus_beta2 * d


@loop
def _lion_cpu(p, g, m, grad_scale, decay, lr, beta1, one_minus_beta1, beta2,
              one_minus_beta2):  # pragma: no cover - compiled
    for i in prange(p.shape[0]):
        _lion(i, p, g, m, grad_scale, decay, lr, beta1, one_minus_beta1, beta2, one_minus_beta2)


_UPDATE = kernels.Update("lion", _lion, _lion_cpu, arrays=("param", "grad", "exp_avg"),
                         written=("param", "exp_avg"))


def fused_lion(param: Any, grad: Any, exp_avg: Any, *, lr: float, beta1: float, beta2: float,
               decay: float = 1.0, grad_scale: float = 1.0) -> None:
    """Lion update in one pass: ``param = param*decay - lr*sign(beta1*m + (1-beta1)*g)``,
    ``m = beta2*m + (1-beta2)*g``. Not collective."""
    _UPDATE((param, grad, exp_avg),
            (grad_scale, decay, lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2))


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
        fused_lion(param, grad, state.buffers["exp_avg"], lr=lr, beta1=beta1, beta2=beta2,
                   decay=1.0 - lr * self.weight_decay, grad_scale=grad_scale)
