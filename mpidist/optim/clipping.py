"""Clipping by the global gradient norm over shards.

Each rank computes the sum of squares of its gradient shards (a fused float64 reduction),
one scalar allreduce adds them over the group, and the resulting factor
``min(1, max_norm / (norm + 1e-6))`` is passed to the optimizer's fused update as
``grad_scale`` (times 1/N for averaging), so clipping costs one read of the gradient and
no extra write.

Shards must partition the gradient: an element replicated on several ranks of ``comm``
(a tensor-parallel-replicated parameter) must be counted on one rank only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.optim import kernels

__all__ = ["clip_coefficient", "clip_scale", "global_norm"]


def _as_list(grad_shards: Any) -> list[Any]:
    if isinstance(grad_shards, np.ndarray) or kernels.is_device_array(grad_shards):
        return [grad_shards]
    if isinstance(grad_shards, Sequence):
        return list(grad_shards)
    raise TypeError(
        f"grad_shards must be an array or a sequence of arrays, got {type(grad_shards).__name__}"
    )


def global_norm(grad_shards: Any, *, comm: Any = None) -> float:
    """The L2 norm of the gradient split over ``grad_shards`` on every rank of ``comm``.

    Collective over ``comm`` (one allreduce of one float64) when ``comm`` is given; every
    rank must call it. ``comm=None`` is a single process.
    """
    ss = 0.0
    for g in _as_list(grad_shards):
        ss += kernels.sum_of_squares(g)
    if comm is not None:
        from mpidist.core.collectives import allreduce  # imported lazily: optional at import time

        buf = np.array([ss], dtype=np.float64)
        allreduce(buf, op="sum", comm=comm)
        ss = float(buf[0])
    return math.sqrt(ss)


def clip_coefficient(max_norm: float, norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))`` (torch's ``clip_grad_norm_``), the one place
    mpidist writes it; a NaN norm gives NaN rather than 1. Pure."""
    scale = float(max_norm) / (float(norm) + 1e-6)
    # Written as a test rather than min() so that a NaN norm propagates instead of giving 1.
    return 1.0 if scale > 1.0 else scale


def clip_scale(grad_shards: Any, max_norm: float, *, comm: Any = None) -> tuple[float, float]:
    """``(scale, total_norm)`` with ``scale = min(1, max_norm / (total_norm + 1e-6))``, the
    factor to pass as ``grad_scale`` (multiplied by the averaging factor, if any).

    A non-finite norm gives a NaN (or zero) scale, as ``torch.nn.utils.clip_grad_norm_``
    does; check ``total_norm`` to skip such steps. Collective over ``comm`` (one scalar
    allreduce); ``comm=None`` is a single process.
    """
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float, np.floating, np.integer))
        or not max_norm > 0
    ):
        raise ValueError(f"clip_scale: max_norm={max_norm!r} must be > 0")
    total = global_norm(grad_shards, comm=comm)
    return clip_coefficient(max_norm, total), total
