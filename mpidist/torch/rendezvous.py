"""Rendezvous from MPI: ``init_process_group`` under mpiexec or srun with no variables.

torch resolves a missing ``init_method`` to ``env://`` before any backend is asked;
:func:`install` wraps that handler. A process MPI did not start that has ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` is left to torch. Otherwise rank and
world size come from ``MPI.COMM_WORLD`` (a disagreeing ``rank=``/``RANK`` is a ValueError),
the store is a ``TCPStore`` served by rank 0 whose address goes to the others over MPI,
and torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set when
absent (docs/torch.md, "Rendezvous"). Nothing is communicated at import time.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist

from mpidist.core.comms import mpi, world

__all__ = ["agree_with_mpi", "check_srun", "check_world", "install", "launched_by_mpi",
           "mpi_store"]

# Variables an MPI launcher sets in each process it starts (Open MPI, MPICH/Hydra/Intel MPI,
# PMIx as under srun --mpi=pmix).
_MPI_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
                    "MPI_LOCALNRANKS")
_TORCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_ORIGINAL: list[Any] = []


def launched_by_mpi(environ: dict[str, str] | None = None) -> bool:
    """Whether an MPI launcher (or srun) started this process, from its variables. Pure."""
    env = os.environ if environ is None else environ
    return any(v in env for v in _MPI_LAUNCH_VARS) or "SLURM_STEP_ID" in env


def _mpi_initialized() -> bool:
    import sys

    module = sys.modules.get("mpi4py.MPI")
    return module is not None and module.Is_initialized()


def _srun_tasks(env: Mapping[str, str], plugin_vars: tuple[str, ...]) -> int:
    """The number of tasks of the srun step this process is one of, when that is more than
    one and none of ``plugin_vars`` (set by an MPI plugin or launcher) is there; else 0."""
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    if "SLURM_STEP_ID" not in env or not tasks.isdigit() or int(tasks) < 2:
        return 0
    return 0 if any(v in env for v in plugin_vars) else int(tasks)


def _srun_error(what: str, tasks: int) -> ValueError:
    return ValueError(
        f"{what}: srun started {tasks} tasks but each is an MPI world of 1: srun has no "
        "MPI plugin here; launch with `srun --mpi=pmix` (see `srun --mpi=list`) or set "
        "MpiDefault=pmix in slurm.conf")


def check_srun(what: str = "init_process_group", environ: dict[str, str] | None = None) -> None:
    """Raise ValueError when srun started this process among several tasks without an MPI
    plugin (no PMIx/PMI variables), before MPI is initialised: Open MPI would abort in
    MPI_Init with advice about building Open MPI, other MPIs would start a world of one per
    task. Pure (reads the environment)."""
    tasks = _srun_tasks(os.environ if environ is None else environ,
                        ("PMIX_RANK", "PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_SIZE"))
    if tasks:
        raise _srun_error(what, tasks)


def check_world(comm: Any, size: int | None = None, what: str = "init_process_group") -> None:
    """Raise ValueError when MPI's world cannot be the one torch was asked for: ``srun``
    without an MPI plugin (each task an MPI world of one while Slurm started several), or a
    ``size`` that differs from the communicator's. Not collective."""
    n = comm.Get_size()
    tasks = _srun_tasks(os.environ, ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")) if n == 1 else 0
    if tasks:
        raise _srun_error(what, tasks)
    if size is not None and size != n:
        raise ValueError(f"{what}: world_size={size} but MPI says {n} for this process "
                         "(launch with mpiexec -n or srun -n, not torchrun)")


def agree_with_mpi(comm: Any, given: Mapping[str, Any]) -> tuple[int, int]:
    """``(rank, size)`` of ``comm``, after checking the ``rank``/``world_size`` a script gave
    (an argument or RANK/WORLD_SIZE; None or -1: not given): ValueError naming both values
    when they differ. Not collective."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for key, mine in (("rank", rank), ("world_size", size)):
        value = given.get(key)
        if value is not None and value != -1 and int(value) != mine:
            source = {"rank": "RANK", "world_size": "WORLD_SIZE"}[key]
            raise ValueError(f"init_process_group: {key}={value} (argument or {source}) but "
                             f"MPI says {mine} for this process")
    return rank, size


def _where() -> tuple[str, int]:
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return socket.gethostname(), netns


def mpi_store(comm: Any, timeout: timedelta, addr: str | None = None,
              port: int | None = None) -> dist.Store:
    """A ``TCPStore`` served by rank 0 of ``comm`` (on ``port``, default a free one), its
    address sent to the others over MPI. Collective over ``comm``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return dist.HashStore()
    where = comm.allgather(_where())
    error, server = None, None
    if rank == 0:
        try:
            server = dist.TCPStore(addr or "127.0.0.1", int(port or 0), size, True,
                                   timeout=timeout, wait_for_workers=False)
        except Exception as exc:  # the other ranks must hear of it, not hang
            error = f"rank 0 could not open torch's TCPStore on port {port or 0}: {exc}"
    error, actual = comm.bcast((error, server.port if server is not None else None), root=0)
    if error is not None:
        raise RuntimeError(f"init_process_group: {error}")
    if rank == 0:
        return server
    host = addr or ("127.0.0.1" if where[rank] == where[0] else where[0][0])
    try:
        return dist.TCPStore(host, actual, size, False, timeout=timeout)
    except Exception as exc:
        raise RuntimeError(
            f"init_process_group: rank {rank} could not reach torch's TCPStore at "
            f"{host}:{actual} ({exc}); set MASTER_ADDR to an address of rank 0's host that "
            "every rank can reach") from None


def _set_torchrun_vars(comm: Any) -> None:
    local = comm.Split_type(mpi().COMM_TYPE_SHARED)
    try:
        values = {"RANK": comm.Get_rank(), "WORLD_SIZE": comm.Get_size(),
                  "LOCAL_RANK": local.Get_rank(), "LOCAL_WORLD_SIZE": local.Get_size()}
    finally:
        local.Free()
    for key, value in values.items():
        os.environ.setdefault(key, str(value))


def _given(url: str) -> dict[str, int | None]:
    query = dict(parse_qsl(urlparse(url).query))
    out: dict[str, int | None] = {}
    for key, var in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):
        value = query.get(key) or os.environ.get(var)
        out[key] = int(value) if value not in (None, "") else None
    return out


def _env_handler(url: str, timeout: timedelta = dist.default_pg_timeout,
                 **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
    original = _ORIGINAL[0]
    given = _given(url)
    have = all(v is not None for v in given.values()) and \
        all(os.environ.get(v) for v in _TORCH_VARS[2:])
    none_set = not any(os.environ.get(v) for v in _TORCH_VARS) and given["rank"] is None
    if not (launched_by_mpi() or _mpi_initialized() or none_set):
        yield from original(url, timeout=timeout, **kwargs)
        return
    check_srun()
    comm = world()
    check_world(comm)
    rank, size = agree_with_mpi(comm, given)
    if have:
        yield from original(url, timeout=timeout, **kwargs)
        return
    port = os.environ.get("MASTER_PORT")
    store = mpi_store(comm, timeout, os.environ.get("MASTER_ADDR") or None,
                      int(port) if port else None)
    if size > 1:
        _set_torchrun_vars(comm)
    yield store, rank, size
    raise RuntimeError("Unable to perform re-rendezvous using env:// from MPI")


def install() -> None:
    """Wrap torch's ``env://`` rendezvous handler (once; see the module docstring)."""
    # (``torch.distributed.rendezvous`` is also the name of a function there)
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    current = handlers.get("env")
    if current is _env_handler:
        return
    if current is None:
        raise RuntimeError("torch.distributed has no env:// rendezvous handler to wrap")
    _ORIGINAL[:] = [current]
    handlers["env"] = _env_handler
