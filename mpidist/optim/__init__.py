"""Optimizers on flat shards, each update ONE fused kernel (see :mod:`mpidist.optim.kernels`).

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

One registry: :data:`OPTIMIZERS` (name -> class) is what the command line, the TOML
configuration, the planner and :func:`warm_up` read. An optimizer is one module: its
hyperparameters and state names (an :class:`Optimizer` dataclass), its element-wise update
body, written once and compiled both as the CPU kernel and as the CUDA kernel
(:class:`mpidist.optim.kernels.Update`), and the ``fused_*`` function that derives the body's
scalars. A new optimizer is that module plus its line in :data:`OPTIMIZERS`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpidist.optim import kernels
from mpidist.optim.adagrad import Adagrad, fused_adagrad
from mpidist.optim.adam import Adam, AdamW, fused_adam
from mpidist.optim.base import Optimizer, OptimizerState
from mpidist.optim.clipping import clip_scale, global_norm
from mpidist.optim.lion import Lion, fused_lion
from mpidist.optim.rmsprop import RMSprop, fused_rmsprop
from mpidist.optim.schedules import (
    ConstantSchedule,
    Schedule,
    StepDecaySchedule,
    WarmupCosineSchedule,
    create_schedule,
    schedule_from_config,
)
from mpidist.optim.sgd import SGD, fused_sgd

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
    "fused_adagrad",
    "fused_adam",
    "fused_lion",
    "fused_rmsprop",
    "fused_sgd",
    "global_norm",
    "schedule_from_config",
    "warm_up",
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


def warm_up(dtypes: tuple[Any, ...] = (np.float32, np.float64)) -> None:
    """Compile every optimizer's CPU kernel (and mpidist.optim.kernels' own) for each dtype on tiny
    arrays, filling Numba's on-disk cache, so that MPI ranks started later load the kernels
    instead of compiling them all at once. Not collective; run it once before launching
    many ranks (``make warm``)."""
    kernels.warm_up(dtypes)
    for cls in OPTIMIZERS.values():
        opt = cls()
        for dt in dtypes:
            param, grad = np.ones(4, dt), np.full(4, 0.5, dt)
            opt.update(param, grad, opt.init_state(param))
