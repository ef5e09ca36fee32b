"""How the ranks of a checkpoint save or load agree: the I/O mode, local failures carried
to one collective that raises the same error everywhere, and fsync of paths."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from mpidist.checkpoint.format import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from mpidist.core.comms import size_rank

__all__ = ["ERRORS", "IO_MODES", "Failure", "agree", "capture_failure", "describe_error",
           "first_failure", "fsync_path", "h5py_module", "io_mode", "on_root", "size_rank",
           "sum_over"]

#: The I/O modes (``MPIDIST_CHECKPOINT_IO``); see :mod:`mpidist.checkpoint.io`.
IO_MODES = ("posix", "mpio", "serial")
ERRORS = {c.__name__: c for c in (CheckpointError, CorruptCheckpointError,
                                  CheckpointFormatError, CheckpointMismatchError)}


def h5py_module() -> Any:
    import h5py

    return h5py


def io_mode(comm: Any, serial: bool | None) -> str:
    """``"posix"``, ``"mpio"`` or ``"serial"``: how this save or load moves its bytes.

    ``serial=True`` (or, when ``serial`` is None, ``MPIDIST_CHECKPOINT_SERIAL=1``) selects
    the serial fallback; otherwise ``MPIDIST_CHECKPOINT_IO`` (default ``posix``), where
    ``serial=False`` turns ``serial`` into ``posix`` and ``mpio`` needs h5py built with MPI
    and more than one rank (else ``posix``). Not collective: callers check the result
    agrees across ranks. Raises ValueError naming a bad ``MPIDIST_CHECKPOINT_IO``.
    """
    size, _ = size_rank(comm)
    env = os.environ.get("MPIDIST_CHECKPOINT_IO", "").strip().lower() or "posix"
    if env not in IO_MODES:
        raise ValueError(f"MPIDIST_CHECKPOINT_IO={env!r} must be one of {list(IO_MODES)}")
    if serial is None:
        serial = env == "serial" or os.environ.get(
            "MPIDIST_CHECKPOINT_SERIAL", "0").strip().lower() not in ("", "0", "false", "no")
    if serial:
        return "serial"
    if env == "mpio" and size > 1 and bool(h5py_module().get_config().mpi):
        return "mpio"
    return "posix"


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Failure(Exception):
    """A local failure carried to the agreement step with the error class to raise."""

    def __init__(self, message: str, cls: type[CheckpointError] = CheckpointError) -> None:
        super().__init__(message)
        self.cls = cls


def agree(comm: Any, failure: Failure | None) -> None:
    """Collective over ``comm``: raise the first rank's failure on every rank, if any."""
    if comm is None or comm.Get_size() == 1:
        if failure is not None:
            raise failure.cls(str(failure))
        return
    everyone = comm.allgather(None if failure is None else (failure.cls.__name__, str(failure)))
    for r, item in enumerate(everyone):
        if item is not None:
            raise ERRORS.get(item[0], CheckpointError)(f"[rank {r}] {item[1]}")


def on_root(comm: Any, fn: Callable[[], Any], context: str = "") -> Any:
    """``fn()`` run on rank 0 of ``comm`` (None: one process), its result on every rank.

    Collective. A failure of ``fn`` raises on every rank, as its own class, its message
    prefixed with ``[rank 0] <context>: `` when ``context`` is given; an exception of a
    class :func:`capture_failure` does not expect (a bug, an odd file) raises as a
    :class:`CheckpointError` naming it, on every rank too (raised on rank 0 alone it
    would leave the others waiting in the broadcast).
    """
    result = error = None
    if comm is None or comm.Get_rank() == 0:
        with capture_failure(anything=True) as box:
            result = fn()
        if box:
            error = (box[0].cls.__name__, str(box[0]))
    if comm is not None:
        result, error = comm.bcast((result, error), root=0)
    if error is not None:
        raise ERRORS.get(error[0], CheckpointError)(
            f"[rank 0] {context}: {error[1]}" if context else error[1])
    return result


def sum_over(comm: Any, sums: np.ndarray) -> np.ndarray:
    """``sums`` (uint64) added up over ``comm`` in place, wrapping mod 2**64. Collective."""
    if comm is not None:
        from mpi4py import MPI

        comm.Allreduce(MPI.IN_PLACE, [sums, MPI.UINT64_T], op=MPI.SUM)
    return sums


@contextlib.contextmanager
def capture_failure(cls: type[CheckpointError] = CheckpointError, *, anything: bool = False
                    ) -> Iterator[list[Failure]]:
    """Collect an exception from the body as a :class:`Failure` instead of raising it: the
    checkpoint's own and I/O-like ones, and with ``anything`` every other exception too."""
    box: list[Failure] = []
    try:
        yield box
    except Failure as exc:
        box.append(exc)
    except CheckpointError as exc:
        box.append(Failure(str(exc), type(exc)))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        box.append(Failure(describe_error(exc), cls))
    except Exception as exc:
        if not anything:
            raise
        box.append(Failure(describe_error(exc), cls))


def first_failure(box: list[Failure]) -> Failure | None:
    return box[0] if box else None


