"""The rank side of the fault-tolerance tests: imported first by every program that
ulfm_harness.run_job starts.

On import, this rank's stdout and stderr go to ``$MPIDIST_FT_TEST_DIR/rank-N.out|err``
(N: the launcher's rank; 100, 101... for the processes of a first spawn, 200... of a
second), so the harness has each rank's output even from a rank that was
killed, and the rank announces its pid (an event ``started``), by which the harness can
SIGKILL it from outside. ``event`` writes one JSON line (the harness reads them as they
come); ``point`` is a named point at which ``MPIDIST_FT_TEST_KILL=RANK:POINT`` makes that
rank SIGKILL itself. ``leave`` ends a rank that outlived a failure without MPI_Finalize;
an exception aborts the job at once (event ``raised``, exit status 1).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _rank() -> int:
    """The launcher's rank; in a process spawned into the job (growing back: Open MPI
    numbers each spawn's processes from 0 in a job of its own, ``<namespace>@<job>``),
    ``100 * (job - 1)`` plus it, so that its files and events do not mix with a first
    rank's."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")))
    _, at, job = os.environ.get("PMIX_NAMESPACE", "").rpartition("@")  # (Open MPI 5's)
    return rank + 100 * (int(job) - 1) if at and job.isdigit() and int(job) > 1 else rank


RANK = _rank()
_DIR = os.environ.get("MPIDIST_FT_TEST_DIR")
_KILL = os.environ.get("MPIDIST_FT_TEST_KILL", "")


def _redirect() -> None:
    if not _DIR:
        return
    for fd, suffix in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(_DIR, f"rank-{RANK}.{suffix}"),
                    os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def event(name: str, **fields) -> None:
    """One JSON line ``{"event": name, "rank": .., "t": wall time, **fields}`` on stdout."""
    sys.stdout.write(json.dumps({"event": name, "rank": RANK, "t": time.time(), **fields})
                     + "\n")
    sys.stdout.flush()


def point(name: str) -> None:
    """A named point: this rank SIGKILLs itself here if ``MPIDIST_FT_TEST_KILL`` names it
    (``RANK:POINT``), after an event ``killing``."""
    if _KILL == f"{RANK}:{name}":
        event("killing", point=name)
        os.kill(os.getpid(), signal.SIGKILL)


def leave(comm, status: int = 0) -> None:
    """End this rank after a failure: a Barrier on ``comm`` (the survivors' communicator),
    then exit without MPI_Finalize. Open MPI 5.0's MPI_Finalize waits in a runtime fence
    that, now and then, still counts the dead rank and never ends (open-mpi/ompi#11404);
    the launcher counts a rank that exits 0 without it as a success. A ``status`` other
    than 0 aborts the job with it: under --with-ft ulfm, a rank that exits non-zero
    without MPI_Finalize is neither reported to the others nor ends the job."""
    comm.Barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    if status:
        comm.Abort(status)
    os._exit(0)


def _end_on_exception(kind, value, tb) -> None:
    """An exception aborts the job at once: under --with-ft ulfm, the MPI_Finalize that
    mpi4py would call on the way out waits for the other ranks (and they for it), and a
    rank that exits non-zero without it is not reported to the others."""
    sys.__excepthook__(kind, value, tb)
    event("raised", error=f"{kind.__name__}: {value}")
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(1)
    os._exit(1)


_redirect()
sys.excepthook = _end_on_exception
event("started", pid=os.getpid())
