"""The "mpidist" torch.distributed backend: torch's own parallel stack over MPI.

``import mpidist.torch`` registers it (devices cpu and cuda); then under ``mpiexec``,
``mpirun`` or ``srun --mpi=pmix``, ``torch.distributed.init_process_group("mpidist")`` needs
no rendezvous variables, and torch's DDP, FSDP2, tensor and pipeline parallelism and
distributed checkpoints communicate through MPI. docs/torch.md describes the groups (one
communicator of exactly their members each, and a second one for calls from other threads),
completion, mixed backends and errors. The rendezvous is :mod:`mpidist.torch.rendezvous`,
the operations :mod:`mpidist.torch.process_group`, the tensor side :mod:`mpidist.torch.ops`.
Every rank keeps a flight recorder (:mod:`mpidist.core.recorder`) from the default group's
creation on; its hang timeout is at most half the group's (not below 10 s), so that its
watchdog dumps before the backend's own one ends the job.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from mpidist.core import comms, recorder
from mpidist.core.comms import mpi
from mpidist.run.launch.guard import abort_with
from mpidist.torch import ops, rendezvous
from mpidist.torch._common import agree
from mpidist.torch.process_group import BACKEND, ProcessGroupMPI, live_communicators

__all__ = ["BACKEND", "ProcessGroupMPI", "live_communicators", "register", "world_comm"]
_WORLD: list[Any] = []  # the communicator the next default group is built on, if not WORLD
# The flight recorder's hang timeout is lowered to half the default group's, not below this
# (a group that times out sooner is ended by the backend's watchdog, which dumps too).
_MIN_HANG_TIMEOUT = 10.0


def world_comm(comm: Any = None, *, reset: bool = False) -> Any:
    """Set (with ``comm``), forget (``reset=True``) or read the communicator the next default
    "mpidist" group is built on; MPI.COMM_WORLD unless set. Not collective."""
    if reset:
        _WORLD.clear()
    elif comm is not None:
        _WORLD[:] = [comm]
    return comms.world(_WORLD[0] if _WORLD else None)


def _create(options: Any, backend_options: Any = None) -> ProcessGroupMPI:
    """torch's creator for "mpidist" groups (collective over the new group's members)."""
    ranks = list(options.global_ranks_in_group)
    rank, size, timeout = options.group_rank, options.group_size, options.timeout
    if not ranks:
        base = world_comm()
        rendezvous.check_world(base, size)
        error = None if base.Get_rank() == rank else (
            f"torch gave this process rank {rank} but MPI rank {base.Get_rank()}")
        agree(base, "init_process_group('mpidist')", error)
        # Every rank keeps a flight recorder whose watchdog dumps before torch's ends the job.
        recorder.install()
        recorder.cap_timeout(max(timeout.total_seconds() / 2, _MIN_HANG_TIMEOUT))
        with ops.watch("creating the default group", timeout):
            recorder.introduce(base)
            comm = base.Dup()
        _abort_on_uncaught_exceptions(base)
    else:
        default = dist.distributed_c10d._get_default_group()
        base = default.base if isinstance(default, ProcessGroupMPI) else comms.world()
        me, world = dist.get_rank(), dist.get_world_size()
        if (me, world) != (base.Get_rank(), base.Get_size()):
            raise ValueError(f"new_group(backend='mpidist'): torch's world is rank {me} of "
                             f"{world} but MPI's is rank {base.Get_rank()} of "
                             f"{base.Get_size()}; start the world with ranks from MPI")
        members = base.Get_group().Incl(ranks)
        try:
            with ops.watch(f"creating a group of ranks {ranks[:8]}", timeout):
                comm = base.Create_group(members)
        finally:
            members.Free()
    with ops.watch("creating a group", timeout):
        side = comm.Dup()
    name = "torch group" if ranks else "torch default group"  # (in flight-recorder dumps)
    comms.label(comm, name)
    comms.label(side, f"{name}, other threads")
    store = getattr(options.store, "underlying_store", options.store)
    group = ProcessGroupMPI(comm, side, base, timeout, store)
    # DCP's async_save and object collectives look for a CPU device among the group's.
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, None)
    return group


def _abort_on_uncaught_exceptions(comm: Any) -> None:
    """An exception that ends this rank's script ends every rank (MPI_Abort), once."""
    if comm.Get_size() == 1 or getattr(sys.excepthook, "_mpidist", False):
        return
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        import traceback

        if kind is KeyboardInterrupt or mpi().Is_finalized():
            previous(kind, value, tb)  # Ctrl-C reaches every rank anyway
            return
        # (the real stderr: torch's own hook, which calls this one, captures sys.stderr)
        abort_with(mpi().COMM_WORLD, "".join(traceback.format_exception(kind, value, tb)),
                   1, sys.__stderr__ or sys.stderr)

    hook._mpidist = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def register() -> None:
    """Register the "mpidist" backend with torch.distributed and wrap the env://
    rendezvous (idempotent; ``import mpidist.torch`` calls it). Not collective."""
    rendezvous.install()
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                  devices=["cpu", "cuda"])
