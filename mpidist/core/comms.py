"""A communicator or none: the helpers every layer uses to talk about one.

``comm=None`` means one process without MPI (size 1, rank 0). mpi4py is imported only when
a communicator is actually used, so everything also runs under plain ``python``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["bcast_json", "in_place", "mpi", "size_rank", "world"]


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


def bcast_json(obj: Any, comm: Any, root: int = 0) -> Any:
    """``root``'s JSON-serialisable ``obj`` on every rank (its bytes, no pickle).
    Collective over ``comm``; None or a group of one returns ``obj``."""
    import numpy as np

    size, rank = size_rank(comm)
    if size == 1:
        return obj
    data = json.dumps(obj).encode() if rank == root else b""
    n = np.array([len(data)], dtype=np.int64)
    comm.Bcast(n, root=root)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if rank == root else \
        np.zeros(int(n[0]), dtype=np.uint8)
    comm.Bcast(buf, root=root)
    return json.loads(buf.tobytes().decode())
