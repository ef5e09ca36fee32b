"""Mixed precision: 16-bit compute, float32 master weights, dynamic loss scaling for fp16.

With ``precision="mixed-bf16"`` or ``"mixed-fp16"`` (:class:`ShardingConfiguration`,
``--precision``) a model keeps two copies of its parameters: the float32 *master* weights,
which the optimizer updates and checkpoints store (the format does not change), and a
16-bit *compute* copy, refreshed from them before each step's first forward, which the
layers run with: activations are 16-bit, products accumulate in float32 on the GPU, and
the kernels accumulate their reductions in float32. Gradients land in float32 buffers and
are reduced in float32.

float16 has 5 exponent bits: small gradients underflow. :class:`LossScaler` multiplies the
loss by a scale ``S`` before backward (so the gradients are ``S`` times larger), unscales
them in the update (``grad_scale = 1/S``), and skips a step whose gradients hold an inf or
a NaN, halving ``S``; after ``growth_interval`` good steps in a row it doubles ``S``
(torch.amp.GradScaler's rule and defaults). bfloat16 has float32's exponent range and
needs no scaling.

Where it cannot run the choice is refused with the reason, before anything is allocated
or communicated (:func:`compute_dtype`, :func:`check_placement`): on the CPU (Numba's CPU
kernels have no 16-bit types and NumPy's float16 products run without BLAS), bfloat16
for now (numba-cuda, which compiles the layer kernels, has no bfloat16 arrays), and with
tensor parallelism (its collectives would reduce 16-bit activations). Not collective,
except :meth:`LossScaler.found_nonfinite`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.arrays import is_cpu, namespace

__all__ = ["LossScaler", "ScaledLoss", "check_placement", "compute_dtype"]


def check_placement(config: Any, *, tp_size: int, hook: Any) -> None:
    """Pure checks of ``config.device`` and ``config.precision`` against the mesh and the
    gradient hook: ValueError naming the reason, before anything is communicated."""
    on_cpu = is_cpu(config.device)
    if config.precision != "full":
        if on_cpu:
            compute_dtype(config.precision, np)
        if tp_size > 1:
            raise ValueError(f"precision={config.precision!r} with tensor parallelism "
                             f"(tp={tp_size}) is not supported: its collectives would reduce "
                             "16-bit activations")
    if not on_cpu and not hook.runs_on_device:
        raise ValueError(f"the {hook.name} gradient exchange takes host arrays: it does not "
                         f"run with device={config.device!r}")


def compute_dtype(precision: str, xp: Any) -> np.dtype | None:
    """The 16-bit dtype the layers compute in for ``precision`` with the array library
    ``xp`` (None for "full"). Raises ValueError naming the reason where it cannot run:
    anything on the CPU, and bfloat16 for now (the kernels have no bfloat16 arrays)."""
    if precision == "full":
        return None
    if xp is np:
        raise ValueError(
            f"--precision {precision} needs a GPU (--device cuda): on the CPU the layer "
            "kernels (Numba) have no 16-bit types and NumPy's 16-bit matrix products run "
            "without BLAS, so there is no 16-bit compute to gain from")
    if precision == "mixed-fp16":
        return np.dtype(np.float16)
    # bfloat16: CuPy 14 has the arrays (through ml_dtypes), but numba-cuda, which compiles
    # the fused layer kernels, has no bfloat16 array type.
    raise ValueError(f"--precision {precision}: the fused layer kernels (numba-cuda) have no "
                     "bfloat16 arrays; use --precision mixed-fp16")


@dataclass
class LossScaler:
    """Dynamic loss scale for float16 training (see the module docstring).

    Attributes:
        scale: the current factor ``S`` the loss (and so every gradient) is multiplied by.
        growth_factor, backoff_factor: ``S`` is multiplied by these after
            ``growth_interval`` good steps in a row / after a step with an inf or NaN.
        growth_interval: good steps in a row before ``S`` grows.
        good_steps: good steps since the last change of ``S``.
        skipped: steps skipped so far.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    skipped: int = 0

    def found_nonfinite(self, grads: list[Any], comm: Any) -> bool:
        """Whether any rank's gradient pieces ``grads`` hold an inf or a NaN. Collective
        over ``comm`` (every rank of the mesh: they must all skip the same steps)."""
        bad = any(g.size and not bool(namespace(g).isfinite(g).all()) for g in grads)
        flag = np.array([1.0 if bad else 0.0])
        C.allreduce(flag, "max", comm=comm)
        return bool(flag[0] > 0)

    def state_dict(self) -> dict[str, float]:
        """The scale and its counters (what a checkpoint keeps). Not collective."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, d: dict[str, float]) -> None:
        """Continue from :meth:`state_dict`'s values. Not collective."""
        self.scale = float(d["scale"])
        self.good_steps, self.skipped = int(d["good_steps"]), int(d["skipped"])

    def update(self, nonfinite: bool) -> bool:
        """Account for one step; returns True when the step must be skipped (its gradients
        were not finite): the scale backs off. Not collective."""
        if nonfinite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return True
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return False


class ScaledLoss:
    """A loss whose backward starts from ``scaler.scale`` instead of 1: every gradient of
    the step comes out ``S`` times larger (the forward's value is the loss itself)."""

    def __init__(self, loss: Any, scaler: LossScaler) -> None:
        self.loss = loss
        self.scaler = scaler

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.loss.forward(*args, **kwargs)

    def backward(self, dy: float = 1.0, ctx: Any = None) -> Any:
        return self.loss.backward(dy * self.scaler.scale, ctx=ctx)

    def clear_cache(self, *args: Any, **kwargs: Any) -> None:
        self.loss.clear_cache(*args, **kwargs)

