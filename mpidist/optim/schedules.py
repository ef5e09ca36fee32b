"""Learning-rate schedules: ``schedule(step) -> lr``, computed on the host once per step and
passed to the optimizer as ``update(..., lr=schedule(step))``.

``step`` counts from 0 (the first update uses ``schedule(0)``). Schedules are frozen
dataclasses; ``config()`` and :func:`schedule_from_config` round-trip them through plain
dicts. Not collective (every rank computes the same value from the same step).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from mpidist.optim.base import check_real

__all__ = [
    "ConstantSchedule",
    "Schedule",
    "StepDecaySchedule",
    "WarmupCosineSchedule",
    "create_schedule",
    "schedule_from_config",
]


def _check_steps(owner: str, name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}: {name}={value!r} must be an integer >= {minimum}")
    return int(value)


@dataclass(frozen=True)
class Schedule:
    """Base class of the schedules."""

    name: ClassVar[str] = ""

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def _step(self, step: Any) -> int:
        return _check_steps(type(self).__name__, "step", step, 0)

    def config(self) -> dict[str, Any]:
        """``{"name": ..., **fields}``; :func:`schedule_from_config` inverts it."""
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass(frozen=True)
class ConstantSchedule(Schedule):
    """``lr`` at every step."""

    name: ClassVar[str] = "constant"
    lr: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", check_real("ConstantSchedule", "lr", self.lr, low=0.0))

    def __call__(self, step: int) -> float:
        self._step(step)
        return self.lr


@dataclass(frozen=True)
class WarmupCosineSchedule(Schedule):
    """Linear warm-up then cosine decay to ``min_lr``.

    For ``step < warmup_steps``: ``lr * (step + 1) / warmup_steps`` (the last warm-up step
    reaches ``lr``). Then, with ``t = (step - warmup_steps) / (total_steps - warmup_steps)``:
    ``min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2``; ``min_lr`` from ``total_steps`` on.
    """

    name: ClassVar[str] = "warmup_cosine"
    lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        o = "WarmupCosineSchedule"
        object.__setattr__(self, "lr", check_real(o, "lr", self.lr, low=0.0))
        object.__setattr__(self, "min_lr", check_real(o, "min_lr", self.min_lr, low=0.0))
        _check_steps(o, "total_steps", self.total_steps, 1)
        _check_steps(o, "warmup_steps", self.warmup_steps, 0)
        if self.min_lr > self.lr:
            raise ValueError(f"{o}: min_lr={self.min_lr!r} exceeds lr={self.lr!r}")
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"{o}: warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}"
            )

    def __call__(self, step: int) -> float:
        s = self._step(step)
        if s < self.warmup_steps:
            return self.lr * (s + 1) / self.warmup_steps
        if s >= self.total_steps:
            return self.min_lr
        t = (s - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


@dataclass(frozen=True)
class StepDecaySchedule(Schedule):
    """``lr * gamma ** (step // step_size)`` (``torch.optim.lr_scheduler.StepLR``)."""

    name: ClassVar[str] = "step"
    lr: float
    step_size: int
    gamma: float = 0.1

    def __post_init__(self) -> None:
        o = "StepDecaySchedule"
        object.__setattr__(self, "lr", check_real(o, "lr", self.lr, low=0.0))
        _check_steps(o, "step_size", self.step_size, 1)
        object.__setattr__(self, "gamma", check_real(o, "gamma", self.gamma, low=0.0))

    def __call__(self, step: int) -> float:
        return self.lr * self.gamma ** (self._step(step) // self.step_size)


_SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (ConstantSchedule, WarmupCosineSchedule, StepDecaySchedule)
}


def create_schedule(name: str, **kwargs: Any) -> Schedule:
    """A schedule by name (``constant``, ``warmup_cosine``, ``step``) and its fields."""
    cls = _SCHEDULES.get(str(name).lower())
    if cls is None:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(_SCHEDULES)}")
    known = {f.name for f in fields(cls)}
    for k, v in kwargs.items():
        if k not in known:
            raise ValueError(f"{cls.__name__}: unknown option {k}={v!r}; known: {sorted(known)}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{cls.__name__}: {e}") from None


def schedule_from_config(config: dict[str, Any]) -> Schedule:
    """Inverse of ``Schedule.config()``."""
    cfg = dict(config)
    if "name" not in cfg:
        raise ValueError(f"schedule config {config!r} has no 'name'")
    return create_schedule(cfg.pop("name"), **cfg)
