"""The four tensor-parallel mappings of Megatron (design idea 8), each one class with its
forward and backward side by side, and the tp group arithmetic they share.

=========================  ==================  ==================
mapping                    forward             backward
=========================  ==================  ==================
CopyToTensorParallel       identity            allreduce
ReduceFromTensorParallel   allreduce           identity
GatherFromTensorParallel   allgather (last)    split
ScatterToTensorParallel    split (last)        allgather
=========================  ==================  ==================

They hold no parameters, so their :meth:`~mpidist.nn.Module.backward_input` is their
backward (a zero-bubble schedule's B pass does the communication) and their
``backward_weight`` does nothing. A group of size 1 (or ``comm=None``) makes no MPI call.
Re-exported by :mod:`mpidist.nn.tensor_parallel`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.arrays import namespace

from .module import Module

__all__ = [
    "CopyToTensorParallel",
    "GatherFromTensorParallel",
    "ReduceFromTensorParallel",
    "ScatterToTensorParallel",
    "even_split",
    "tp_group",
]


def tp_group(comm: Any) -> tuple[int, int]:
    """(size, rank) of a tp communicator; None is a group of one."""
    if comm is None:
        return 1, 0
    return comm.Get_size(), comm.Get_rank()


def even_split(n: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """``[lo, hi)`` of ``n`` items that rank ``rank`` of ``size`` holds; ValueError naming
    ``what`` unless ``size`` divides ``n``. Pure."""
    if n % size:
        raise ValueError(f"tp={size} does not divide {what}={n}")
    w = n // size
    return rank * w, (rank + 1) * w


# -- the four mappings ----------------------------------------------------------------------
def _allreduce_copy(x: np.ndarray, comm: Any) -> np.ndarray:
    out = namespace(x).array(x, copy=True, order="C")
    C.allreduce(out, "sum", comm=comm)
    return out


def _split_last(x: np.ndarray, comm: Any) -> np.ndarray:
    size, rank = tp_group(comm)
    if size == 1:
        return x
    lo, hi = even_split(x.shape[-1], size, rank, "last dim")
    return namespace(x).ascontiguousarray(x[..., lo:hi])


def _gather_last(x: np.ndarray, comm: Any) -> np.ndarray:
    size, _ = tp_group(comm)
    if size == 1:
        return x
    xp = namespace(x)
    x = xp.ascontiguousarray(x)
    g = C.allgather(x.reshape(-1), comm=comm, out=xp.empty(size * x.size, dtype=x.dtype))
    g = g.reshape((size, *x.shape))
    return xp.concatenate([g[r] for r in range(size)], axis=-1)


class _Mapping(Module):
    """A parameterless module that moves tensors between the tp ranks."""

    def __init__(self, comm: Any) -> None:
        super().__init__()
        self.comm = comm


class CopyToTensorParallel(_Mapping):
    """Enter a tp region: forward is the identity (every rank has the whole input);
    backward allreduces (sums) the partial input gradients. Backward is collective over tp."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return x

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _allreduce_copy(dy, self.comm)


class ReduceFromTensorParallel(_Mapping):
    """Leave a tp region by summing partial outputs: forward allreduces, backward is the
    identity (the gradient of a sum reaches every term). Forward is collective over tp."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _allreduce_copy(x, self.comm)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return dy


class GatherFromTensorParallel(_Mapping):
    """Leave a tp region by concatenating shards of the last axis: forward allgathers,
    backward keeps this rank's slice of the gradient. Forward is collective over tp."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _gather_last(x, self.comm)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _split_last(dy, self.comm)


class ScatterToTensorParallel(_Mapping):
    """Enter a tp region by splitting the last axis: forward keeps this rank's slice,
    backward allgathers the gradient slices. Backward is collective over tp."""

    def forward(self, x: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _split_last(x, self.comm)

    def backward(self, dy: np.ndarray, ctx: Hashable = None) -> np.ndarray:
        return _gather_last(dy, self.comm)
