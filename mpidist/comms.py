"""A communicator or none: the helpers every layer uses to talk about one.

``comm=None`` means one process without MPI (size 1, rank 0). mpi4py is imported only when
a communicator is actually used, so everything also runs under plain ``python``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["in_place", "mpi", "size_rank", "world"]


_MPI: list[Any] = []


def mpi() -> Any:
    """The ``mpi4py.MPI`` module (imported on first use)."""
    if not _MPI:
        from mpi4py import MPI

        _MPI.append(MPI)
    return _MPI[0]


def in_place() -> Any:
    """``MPI.IN_PLACE``."""
    return mpi().IN_PLACE


def size_rank(comm: Any) -> tuple[int, int]:
    """``(size, rank)`` of ``comm``; ``(1, 0)`` for None. Not collective."""
    if comm is None:
        return 1, 0
    return comm.Get_size(), comm.Get_rank()


def world(comm: Any = None) -> Any:
    """``comm``, or every rank (``MPI.COMM_WORLD``) when None. Not collective.

    The one place where the user-facing entry points (``ProcessMesh``, the default mesh of
    ``ShardingConfiguration``, ``HybridShardedOptimizer``, ``ElasticOptimizer``,
    ``run_training``, ``mpidist.torch``) resolve their documented default; the code below
    them takes its communicator from them.
    """
    return mpi().COMM_WORLD if comm is None else comm
