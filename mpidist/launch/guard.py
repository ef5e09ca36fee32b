"""End the whole MPI job when one rank fails, instead of leaving the others hanging.

An exception on one rank of an MPI program usually leaves the other ranks blocked in their
next collective forever. :class:`abort_on_failure` (a context manager and a decorator)
prints the failing rank's traceback, prefixed with its rank, then calls ``Abort`` on the
communicator, so ``mpiexec``/``srun`` ends every rank with a non-zero exit code within
seconds, as ``python -m mpi4py`` does for scripts.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from typing import Any

__all__ = ["abort_on_failure", "abort_with"]


def abort_with(comm: Any, text: str, code: int = 1, stream: Any = None) -> None:
    """Write ``text`` (a traceback) to ``stream`` (default ``sys.stderr``), each line
    prefixed with this rank, then ``Abort`` ``comm`` with ``code``. Not collective: only
    the failing rank acts; MPI ends the others. Does not return."""
    stream = sys.stderr if stream is None else stream
    rank = comm.Get_rank()
    prefixed = "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))
    sys.stdout.flush()
    stream.write(prefixed)
    stream.write(f"[rank {rank}] aborting the MPI job (exit code {code})\n")
    stream.flush()
    comm.Abort(code)


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
