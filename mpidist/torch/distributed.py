"""The parts of ``torch.distributed`` a training script calls, answered by MPI.

``import mpidist.torch.distributed as dist`` in place of ``import torch.distributed as
dist`` keeps a script's ``dist.init_process_group(...)``, ``dist.get_rank()``,
``dist.get_world_size()``, ``dist.barrier()``, ``dist.all_reduce(t)``,
``dist.broadcast(t, src)`` and ``dist.destroy_process_group()`` working under ``mpiexec`` or
``srun`` with no rendezvous variables: MPI already knows the ranks. The group is
``MPI.COMM_WORLD`` unless ``init_process_group(comm=...)`` names another.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.utils.data

from mpidist import collectives as C
from mpidist.torch._common import host_view, resolve_comm

__all__ = [
    "DistributedSampler",
    "ReduceOp",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_comm",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_available",
    "is_initialized",
]

_GROUP: list[Any] = []


class ReduceOp(enum.Enum):
    """Reduction operations of :func:`all_reduce` (torch's names)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


def is_available() -> bool:
    """Always True: MPI is the transport. Not collective."""
    return True


def init_process_group(backend: str | None = None, *, comm: Any = None, **kwargs: Any) -> None:
    """Make ``comm`` (default every rank) the default group. ``backend``, ``init_method``,
    ``rank``, ``world_size`` and ``timeout`` are accepted and checked against MPI (a rank or
    world size that differs from MPI's raises). Not collective."""
    del backend
    comm = resolve_comm(comm)
    for key, mine in (("rank", comm.Get_rank()), ("world_size", comm.Get_size())):
        given = kwargs.get(key)
        if given is not None and given != -1 and int(given) != mine:
            raise ValueError(f"{key}={given} but MPI says {mine} for this process")
    _GROUP[:] = [comm]


def is_initialized() -> bool:
    """Whether :func:`init_process_group` was called. Not collective."""
    return bool(_GROUP)


def get_comm() -> Any:
    """The default group's communicator (every rank before ``init_process_group``)."""
    return _GROUP[0] if _GROUP else resolve_comm(None)


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (an mpi4py communicator) or the default group."""
    return (group or get_comm()).Get_rank()


def get_world_size(group: Any = None) -> int:
    """The size of ``group`` or of the default group. Not collective."""
    return (group or get_comm()).Get_size()


def barrier(group: Any = None) -> None:
    """Wait for every rank of the group. Collective."""
    (group or get_comm()).Barrier()


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> None:
    """Reduce ``tensor`` in place over the group (float32/float64/int32/int64). Collective.
    ``async_op`` is accepted; the call completes before it returns."""
    del async_op
    view = host_view(tensor)
    C.allreduce(view.to_host(), ReduceOp(op).value, comm=group or get_comm())
    view.to_device()


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None,
              async_op: bool = False) -> None:
    """Overwrite ``tensor`` with rank ``src``'s values. Collective."""
    del async_op
    view = host_view(tensor)
    C.broadcast(view.to_host(), src, comm=group or get_comm())
    view.to_device()


def destroy_process_group(group: Any = None) -> None:
    """Forget the default group (MPI itself is finalised at exit). Not collective."""
    del group
    _GROUP.clear()


class DistributedSampler(torch.utils.data.distributed.DistributedSampler):
    """torch's ``DistributedSampler`` with ``num_replicas`` and ``rank`` taken from the
    default group when not given."""

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(dataset,
                         num_replicas=get_world_size() if num_replicas is None else num_replicas,
                         rank=get_rank() if rank is None else rank, **kwargs)
