"""``torch.distributed`` with MPI underneath: a thin layer over torch's own module.

Every name of ``torch.distributed`` is available here and is torch's own; what this module
adds or changes (docs/torch.md): :func:`init_process_group` runs on the "mpidist" backend
over ``MPI.COMM_WORLD`` or ``comm=``, :func:`get_comm` returns that communicator, ``group=``
may be an mpi4py communicator in :func:`get_rank`, :func:`get_world_size`, :func:`barrier`,
:func:`all_reduce` and :func:`broadcast`, and ``op=`` also takes "sum", "avg", "max", "min".
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as _dist
import torch.utils.data

from mpidist.core import collectives as C
from mpidist.torch import backend as _backend
from mpidist.torch import rendezvous as _rendezvous
from mpidist.torch._common import HostView, resolve_comm

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

ReduceOp = _dist.ReduceOp
DistributedSampler = torch.utils.data.distributed.DistributedSampler
_COMM: list[Any] = []
_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN}


def __getattr__(name: str) -> Any:
    """Every other name is torch.distributed's own."""
    return getattr(_dist, name)


def is_available() -> bool:
    """Always True: MPI is the transport. Not collective."""
    return True


def is_initialized() -> bool:
    """Whether torch's default process group exists. Not collective."""
    return _dist.is_initialized()


def init_process_group(backend: str | None = None, *, comm: Any = None,
                       timeout: timedelta | None = None, **kwargs: Any) -> None:
    """Start torch's default process group on the "mpidist" backend over ``comm`` (default
    every rank). ``rank`` and ``world_size`` may be given and must agree with MPI (else
    ValueError, before anything is communicated); ``init_method`` is ignored (MPI is the
    rendezvous). A backend string naming "mpidist" for some devices (``"cpu:mpidist,
    cuda:nccl"``) is used as given; any other name is replaced by "mpidist". Collective over
    ``comm``."""
    if comm is None:
        _rendezvous.check_srun()  # before MPI is initialised
    comm = resolve_comm(comm)
    _rendezvous.agree_with_mpi(comm, {k: kwargs.pop(k, None) for k in ("rank", "world_size")})
    kwargs.pop("init_method", None)
    kwargs.pop("store", None)
    name = backend if backend and _backend.BACKEND in str(backend) else _backend.BACKEND
    timeout = timeout or _dist.default_pg_timeout
    _rendezvous.check_world(comm)
    store = _rendezvous.mpi_store(comm, timeout)
    _backend.world_comm(comm)
    try:
        _dist.init_process_group(name, store=store, rank=comm.Get_rank(),
                                 world_size=comm.Get_size(), timeout=timeout, **kwargs)
    finally:
        _backend.world_comm(reset=True)
    _COMM[:] = [comm]


def get_comm() -> Any:
    """The communicator of the default group (every rank before :func:`init_process_group`),
    as mpidist's traced wrapper of it (the same MPI handle: it compares equal to the
    communicator given). Not collective."""
    return _COMM[0] if _COMM and _dist.is_initialized() else resolve_comm(None)


def _mpi_comm(group: Any) -> Any | None:
    """``group`` when it is an mpi4py communicator other than the default group's."""
    if group is None or isinstance(group, _dist.ProcessGroup):
        return None
    comm = resolve_comm(group)
    if _COMM and _dist.is_initialized() and comm == _COMM[0]:
        return None
    return comm


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (a torch group or an mpi4py communicator) or the
    default group. Not collective."""
    comm = _mpi_comm(group)
    if comm is not None or not _dist.is_initialized():
        return (comm or get_comm()).Get_rank()
    return _dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """The size of ``group`` or of the default group. Not collective."""
    comm = _mpi_comm(group)
    if comm is not None or not _dist.is_initialized():
        return (comm or get_comm()).Get_size()
    return _dist.get_world_size(group)


def barrier(group: Any = None, **kwargs: Any) -> Any:
    """Wait for every rank of the group. Collective."""
    comm = _mpi_comm(group)
    if comm is not None:
        comm.Barrier()
        return None
    return _dist.barrier(group, **kwargs)


def _op(op: Any) -> Any:
    if isinstance(op, str):
        if op.lower() not in _OPS:
            raise ValueError(f"op={op!r} is not one of {sorted(_OPS)}")
        return _OPS[op.lower()]
    return op


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
    """Reduce ``tensor`` in place over the group (torch's ``all_reduce``; returns a Work
    when ``async_op``). Collective."""
    op = _op(op)
    comm = _mpi_comm(group)
    if comm is None:
        return _dist.all_reduce(tensor, op, group, async_op)
    names = {v: k for k, v in _OPS.items()}
    if op not in names:
        raise ValueError(f"op={op} on an mpi4py communicator must be one of {sorted(_OPS)}")
    view = HostView(tensor)
    C.allreduce(view.to_host(), names[op], comm=comm)
    view.to_device()
    return None


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None,
              async_op: bool = False) -> Any:
    """Overwrite ``tensor`` with rank ``src``'s values (torch's ``broadcast``). Collective."""
    comm = _mpi_comm(group)
    if comm is None:
        return _dist.broadcast(tensor, src, group, async_op)
    view = HostView(tensor)
    C.broadcast(view.to_host(), src, comm=comm)
    view.to_device()
    return None


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group``, or every group when None (torch's). Collective only in that every
    rank should call it; MPI itself is finalised at exit."""
    if _mpi_comm(group) is not None:
        return
    if _dist.is_initialized():
        _dist.destroy_process_group(group)
    if group is None:
        _COMM.clear()
