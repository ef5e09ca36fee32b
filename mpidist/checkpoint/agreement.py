"""How the ranks of a checkpoint save or load agree: the I/O mode, local failures carried
to one collective that raises the same error everywhere, and fsync of paths."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from mpidist.checkpoint.format import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from mpidist.core.comms import size_rank

__all__ = ["ERRORS", "IO_MODES", "Failure", "agree", "capture_failure", "describe_error",
           "first_failure", "fsync_path", "h5py_module", "io_mode", "size_rank"]

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
    size, _ = size_rank(comm)
    if size == 1:
        if failure is not None:
            raise failure.cls(str(failure))
        return
    payload = None if failure is None else (failure.cls.__name__, str(failure))
    everyone = comm.allgather(payload)
    for r, item in enumerate(everyone):
        if item is not None:
            cls = ERRORS.get(item[0], CheckpointError)
            raise cls(f"[rank {r}] {item[1]}" if size > 1 else item[1])


@contextlib.contextmanager
def capture_failure(cls: type[CheckpointError] = CheckpointError) -> Iterator[list[Failure]]:
    """Collect an exception from the body as a :class:`Failure` instead of raising it."""
    box: list[Failure] = []
    try:
        yield box
    except Failure as exc:
        box.append(exc)
    except CheckpointError as exc:
        box.append(Failure(str(exc), type(exc)))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        box.append(Failure(describe_error(exc), cls))


def first_failure(box: list[Failure]) -> Failure | None:
    return box[0] if box else None


