"""CPU kernels: ``numba.njit(parallel=True)`` loops over flat shards.

An optimizer's kernel (see :class:`mpidist.optim.kernels.Update`) is its element body, written
once beside its hyperparameters in :mod:`mpidist.optim`, called from a ``prange`` loop
compiled with :func:`loop`. Each kernel makes one pass over its arrays: every element of
every array is read once and written once, so an update costs the memory traffic of its
arrays and nothing more.

Calling convention (shared with :mod:`mpidist.optim.kernels.cuda`): arrays are 1-D, C-contiguous,
of one dtype (float32 or float64) and one length; every scalar argument is already of the
arrays' dtype. The dispatcher in :mod:`mpidist.optim.kernels` does the casting. Passing scalars
of the array dtype keeps float32 math in float32 (a float64 scalar would promote the whole
expression), and it keeps the number of compiled specialisations to one per dtype. For the
same reason the kernel bodies contain no float literals; ``1 - beta`` and friends arrive
precomputed.

``grad_scale`` multiplies the gradient inside the kernel: it carries the 1/N of gradient
averaging, the clipping factor and, negated, ``maximize``.

``fastmath=False`` so that LLVM neither contracts ``a*b + c`` into an FMA nor reorders
operations: results match an unfused NumPy implementation of the same formulas.

Not collective. These functions do no argument checking; use :mod:`mpidist.optim.kernels`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import prange

__all__ = [
    "loop",
    "sum_of_squares",
    "triad",
]

_JIT = {"parallel": True, "cache": True, "fastmath": False, "nogil": True}


def loop(fn: Callable[..., None]) -> Any:
    """Compile ``fn``, a loop ``for i in prange(len(first array)): element(i, ...)`` written
    beside an optimizer's element body, as its CPU kernel: ``numba.njit`` parallel, cached
    on disk, without fastmath, releasing the GIL. (The loop takes its arguments one by one:
    a ``*args`` tuple of arrays and scalars made Numba's parallel loop 25x slower.)"""
    return numba.njit(**_JIT)(fn)


@numba.njit(**_JIT)
def sum_of_squares(x):  # pragma: no cover - compiled
    """Sum of ``x[i]**2`` accumulated in float64 (a parallel reduction)."""
    acc = 0.0
    for i in prange(x.shape[0]):
        xi = np.float64(x[i])
        acc += xi * xi
    return acc


@numba.njit(**_JIT)
def triad(a, b, c, s):  # pragma: no cover - compiled
    """STREAM triad ``a = b + s*c``: the memory-bandwidth yardstick of the benchmarks."""
    for i in prange(a.shape[0]):
        a[i] = b[i] + s * c[i]
