"""Optimizers on flat shards, each update ONE fused kernel (see :mod:`mpidist.kernels`).

``SGD``, ``Adam``, ``AdamW``, ``RMSprop``, ``Adagrad`` follow ``torch.optim``'s algorithms,
parameter names and defaults; ``Lion`` follows the paper and ``lion-pytorch``. The formulas
are written out in ``docs/optimizers.md``.

Usage on one shard::

    opt = mpidist.optim.create("adamw", lr=3e-4, weight_decay=0.1)
    state = opt.init_state(param_shard)
    scale, norm = mpidist.optim.clip_scale(grad_shard, 1.0, comm=dp_comm)
    opt.update(param_shard, grad_shard, state, grad_scale=scale / n_dp, lr=schedule(step))

Hyperparameters and state serialise to plain dicts (``config()``/``from_config``,
``state_to_dict``/``state_from_dict``); nothing is pickled.
"""

from __future__ import annotations

from typing import Any

from mpidist.optim.adagrad import Adagrad
from mpidist.optim.adam import Adam, AdamW
from mpidist.optim.base import Optimizer, OptimizerState
from mpidist.optim.clipping import clip_scale, global_norm
from mpidist.optim.lion import Lion
from mpidist.optim.rmsprop import RMSprop
from mpidist.optim.schedules import (
    ConstantSchedule,
    Schedule,
    StepDecaySchedule,
    WarmupCosineSchedule,
    create_schedule,
    schedule_from_config,
)
from mpidist.optim.sgd import SGD

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "ConstantSchedule",
    "Lion",
    "Optimizer",
    "OptimizerState",
    "RMSprop",
    "Schedule",
    "StepDecaySchedule",
    "WarmupCosineSchedule",
    "clip_scale",
    "create",
    "create_schedule",
    "from_config",
    "global_norm",
    "schedule_from_config",
]

OPTIMIZERS: dict[str, type[Optimizer]] = {
    cls.name: cls for cls in (SGD, Adam, AdamW, RMSprop, Adagrad, Lion)
}


def create(name: str, **hyperparameters: Any) -> Optimizer:
    """An optimizer by name (``sgd``, ``adam``, ``adamw``, ``rmsprop``, ``adagrad``, ``lion``;
    case-insensitive) with the given hyperparameters; the others take their defaults.
    ValueError names an unknown optimizer, an unknown option or a bad value."""
    cls = OPTIMIZERS.get(str(name).lower())
    if cls is None:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return cls(**hyperparameters)


def from_config(config: dict[str, Any]) -> Optimizer:
    """Inverse of ``Optimizer.config()``: ``{"name": "adamw", "lr": ..., ...}``."""
    cfg = dict(config)
    if "name" not in cfg:
        raise ValueError(f"optimizer config {config!r} has no 'name'")
    return create(cfg.pop("name"), **cfg)
