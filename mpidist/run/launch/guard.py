"""End the whole MPI job when one rank fails, instead of leaving the others hanging.

An exception on one rank of an MPI program usually leaves the other ranks blocked in their
next collective forever. :class:`abort_on_failure` (a context manager and a decorator)
prints the failing rank's traceback, prefixed with its rank, then calls ``Abort`` on the
communicator, so ``mpiexec``/``srun`` ends every rank with a non-zero exit code within
seconds, as ``python -m mpi4py`` does for scripts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
import zlib
from typing import Any

import numpy as np

from mpidist.core import failure
from mpidist.run.logs import append_to_run_log, rank_prefixed

__all__ = ["ERROR_WAIT_SECONDS", "abort_on_failure", "abort_with", "enable_error_agreement",
           "error_agreement_enabled", "exit_code", "one_line", "report_failure"]


def abort_with(comm: Any, text: str, code: int = 1, stream: Any = None) -> None:
    """Write ``text`` (a traceback) to ``stream`` (default ``sys.stderr``), each line
    prefixed with this rank, dump the flight recorder (:mod:`mpidist.core.recorder`, when
    installed), then ``Abort`` ``comm`` with ``code`` (:func:`mpidist.core.failure.abort`:
    under MPI's fault tolerance this rank leaves the job alone). Not collective: only
    the failing rank acts; MPI ends the others. Does not return."""
    stream = sys.stderr if stream is None else stream
    rank = comm.Get_rank()
    sys.stdout.flush()
    stream.write(rank_prefixed(rank, text))
    leave = failure.abort_leaves_the_job()
    stream.write(f"[rank {rank}] {_ending(code, leave)}\n")
    stream.flush()
    _dump_flight_recorder(_headline(text))
    failure.abort(comm, code, leave)


def _ending(code: int, leave: bool) -> str:
    """How this rank's failure ends the job, in words (``leave``:
    :func:`mpidist.core.failure.abort_leaves_the_job`)."""
    if leave:
        return (f"leaving the job (status {code}; under fault tolerance the other ranks "
                "recover without this one, or end the job in one line)")
    return f"aborting the MPI job (exit code {code})"


class abort_on_failure(contextlib.ContextDecorator):  # noqa: N801 - reads as a statement
    """Abort ``comm`` (default ``MPI.COMM_WORLD``) with ``exit_code`` if the body raises.

    ``SystemExit`` with code 0 or None passes through; any other exception, including
    ``KeyboardInterrupt`` and ``SystemExit(n)`` for n != 0, aborts when the communicator
    has more than one rank and is re-raised otherwise. Use it around ``main()``::

        @abort_on_failure()
        def main(): ...

    Not collective: only the failing rank acts; MPI ends the others.
    """

    def __init__(self, comm: Any = None, exit_code: int = 1) -> None:
        self.comm = comm
        self.exit_code = exit_code

    def __enter__(self) -> abort_on_failure:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return False
        comm = self.comm
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        if comm.Get_size() <= 1:
            return False
        if isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) else self.exit_code
            text = f"SystemExit({exc.code!r})\n"
        else:
            code = self.exit_code
            text = "".join(traceback.format_exception(exc_type, exc, tb))
        abort_with(comm, text, code)
        return False  # pragma: no cover - Abort does not return


# -- failing once, in one line ------------------------------------------------------------
#: Seconds a failing rank waits for the others to fail the same way before it aborts the
#: job (``MPIDIST_ERROR_WAIT_S``).
ERROR_WAIT_SECONDS = 10.0

_AGREEMENT: dict[str, Any] = {"comm": None}
_REGISTERED = [False]  # whether enable_error_agreement ran (its listener is registered)


def enable_error_agreement(comm: Any) -> None:
    """Set aside a duplicate of ``comm`` on which failing ranks find out whether every rank
    failed alike (:func:`report_failure`). Collective over ``comm``: call it first thing,
    on every rank."""
    old = _AGREEMENT["comm"]
    if old is not None:
        old.Free()
    _AGREEMENT["comm"] = comm.Dup() if comm.Get_size() > 1 else None
    from mpidist.core.failure import on_shrink

    _REGISTERED[0] = True
    on_shrink(_rebind)  # after in-job recovery from a lost rank: the survivors'


def error_agreement_enabled() -> bool:
    """Whether :func:`enable_error_agreement` was called in this process (then every
    recovery, and every join of growing back, duplicates the job's communicator for it).
    Not collective."""
    return _REGISTERED[0]


def _rebind(comm: Any) -> None:
    """The survivors' communicator (after in-job recovery) becomes the job's for failure
    reports. Collective over ``comm``."""
    _AGREEMENT["comm"] = comm.Dup() if comm.Get_size() > 1 else None
    _AGREEMENT["job"] = comm


def _wait_seconds() -> float:
    try:
        return float(os.environ.get("MPIDIST_ERROR_WAIT_S", "") or ERROR_WAIT_SECONDS)
    except ValueError:
        return ERROR_WAIT_SECONDS


def _agree(line: str) -> np.ndarray | None:
    """Every rank's checksum of its error line, if every rank fails within the wait."""
    comm = _AGREEMENT["comm"]
    if comm is None:
        return None
    send = np.array([zlib.crc32(line.encode())], dtype=np.int64)
    recv = np.zeros(comm.Get_size(), dtype=np.int64)
    deadline = time.monotonic() + _wait_seconds()
    try:
        req = comm.Iallgather(send, recv)
        while not req.Test():
            if time.monotonic() > deadline:
                return None  # the others are busy elsewhere: this failure is this rank's own
            time.sleep(0.005)
    except Exception:  # noqa: BLE001 - a rank was lost: this rank reports alone
        return None
    return recv


def one_line(exc: BaseException) -> str:
    """The message a failure prints: a ValueError's (bad input) or a FloatingPointError's
    (divergence) text alone, other exceptions with their type."""
    if isinstance(exc, (ValueError, FloatingPointError)) or getattr(exc, "plain", False):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    if isinstance(exc, SystemExit):
        return f"exited with status {exc.code}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def exit_code(exc: BaseException) -> int:
    """2 for bad input (ValueError), 130 for Ctrl-C, a SystemExit's own code, else 1."""
    if isinstance(exc, SystemExit) and isinstance(exc.code, int):
        return exc.code
    if isinstance(exc, ValueError):
        return 2
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


def report_failure(exc: BaseException, prog: str, stream: Any = None) -> int:
    """Report ``exc`` in one line and return the exit status, or abort the MPI job.

    Single process: the line (with the traceback in the run's log file, or on ``stream``
    before it when there is none; none for bad input). Several ranks that all fail alike
    within ``MPIDIST_ERROR_WAIT_S`` seconds (after :func:`enable_error_agreement`): rank 0
    prints the line, any rank whose line differs prints its own, and every rank returns
    the status, so the job ends without ``MPI_Abort``. A failure of this rank alone: its
    line first, the flight recorder's dump, then ``Abort`` with the status. Not collective.
    """
    stream = sys.stderr if stream is None else stream
    line, code = one_line(exc), exit_code(exc)
    quiet = isinstance(exc, (ValueError, FloatingPointError, KeyboardInterrupt, SystemExit)) \
        or getattr(exc, "plain", False)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    comm = _world()
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    sys.stdout.flush()
    keys = _agree(line) if size > 1 else np.zeros(1, dtype=np.int64)
    if keys is not None:
        speaks = rank == 0 or keys[rank] != keys[0]
        where = append_to_run_log(text, rank) if speaks and not quiet else None
        if speaks:
            if not quiet and where is None:
                stream.write(text)
            prefix = f"[rank {rank}] " if rank else ""
            more = f" (traceback in {where})" if where else ""
            stream.write(f"{prefix}{prog}: error: {line}{more}\n")
        stream.flush()
        if size > 1:  # every rank failed alike and is here: exit only once the lines are out
            comm.Barrier()
        return code
    where = append_to_run_log(text, rank)
    if where is None:
        stream.write(rank_prefixed(rank, text))
    more = f"; traceback in {where}" if where else ""
    leave = failure.abort_leaves_the_job()
    stream.write(f"[rank {rank}] {prog}: error: {line}{more}; {_ending(code, leave)}\n")
    stream.flush()
    _dump_flight_recorder(line)
    failure.abort(comm, code, leave)
    return code  # pragma: no cover - Abort does not return


def _headline(text: str) -> str:
    """The line that says what happened: a traceback's last, else the first."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "aborted"
    return lines[-1].strip() if lines[0].startswith("Traceback") else lines[0].strip()


def _dump_flight_recorder(reason: str) -> None:
    """This rank's flight recorder into its dump directory before the job is aborted (the
    others' watchdogs, if they have timed out, dumped theirs already)."""
    from mpidist.core import recorder

    if recorder.installed():
        recorder.dump(f"abort: {reason}")


def _world() -> Any:
    """COMM_WORLD when MPI is running, else None (without starting MPI)."""
    if "mpi4py.MPI" not in sys.modules:
        return None
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    if _AGREEMENT.get("job") is not None:
        return _AGREEMENT["job"]
    from mpidist.core.comms import world

    return world()
