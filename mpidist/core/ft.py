"""Whether this process can survive a dead rank inside the job: MPI's fault tolerance (ULFM).

ULFM (User-Level Failure Mitigation) lets the surviving ranks learn that a rank died,
revoke the communicators it was in, agree, and shrink them to the survivors, without ending
the job. Open MPI >= 5 has it built in and turns it on at run time (``mpiexec --with-ft
ulfm``, which sets the MCA parameter ``mpi_ft_enable``); mpi4py >= 4 exposes the calls
(``Comm.Revoke``, ``Shrink``, ``Agree``, ``Get_failed``, ``Ack_failed``).

The calls alone prove nothing: where the library lacks ULFM, mpi4py quietly stands in
``Dup`` for ``Shrink``, an allreduce for ``Agree`` and an empty group for ``Get_failed``,
and without ``mpi_ft_enable`` a dead rank ends the whole job anyway. So
:func:`fault_tolerance` checks every link of the chain: the library really is Open MPI >= 5,
it exports the ``MPIX_Comm_*`` functions, fault tolerance is on in this process (the MCA
parameter's value through the MPI tool interface, else ``OMPI_MCA_mpi_ft_enable``), and
mpi4py has the calls. It is local to the process and cheap: nothing is communicated and no
call can block.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "FaultTolerance",
    "ULFM_CALLS",
    "ULFM_SYMBOLS",
    "assess_fault_tolerance",
    "fault_tolerance",
    "mpi_ft_enable",
]

#: the ``mpi4py.MPI.Comm`` methods in-job recovery uses
ULFM_CALLS = ("Revoke", "Is_revoked", "Shrink", "Agree", "Get_failed", "Ack_failed")
#: the library functions behind them (Open MPI's names)
ULFM_SYMBOLS = ("MPIX_Comm_revoke", "MPIX_Comm_shrink", "MPIX_Comm_agree",
                "MPIX_Comm_get_failed", "MPIX_Comm_ack_failed")
_ON = ("1", "true", "yes", "on", "enabled")


@dataclass(frozen=True)
class FaultTolerance:
    """The verdict of :func:`fault_tolerance`: ``available`` and, when not, ``reason`` (one
    line); ``library`` is the MPI library's own first line; ``source`` says where the value
    of ``mpi_ft_enable`` came from ("MPI_T", "environment" or "unknown")."""

    available: bool
    reason: str
    library: str
    source: str = "unknown"

    def line(self) -> str:
        """``on (...)`` or ``off: <reason>``: what ``mpidist env`` prints."""
        if self.available:
            return f"on ({self.library.split(',')[0]}, ULFM, mpi_ft_enable from {self.source})"
        return f"off: {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _open_mpi_version(library: str) -> tuple[int, ...] | None:
    """(major, minor, release) of an Open MPI library line, None for another library."""
    found = re.search(r"Open MPI v(\d+)\.(\d+)(?:\.(\d+))?", library)
    if not found:
        return None
    return tuple(int(g) for g in found.groups() if g is not None)


def assess_fault_tolerance(library: str, mpi4py_version: str, *, ft_enabled: bool | None,
                           missing_symbols: tuple[str, ...] | None = (),
                           missing_calls: tuple[str, ...] = (),
                           source: str = "unknown") -> FaultTolerance:
    """The verdict from the facts (pure; :func:`fault_tolerance` gathers them).

    ``library`` is ``MPI.Get_library_version()``; ``ft_enabled`` the value of
    ``mpi_ft_enable`` (None: not known); ``missing_symbols`` the ULFM functions the library
    lacks (None: not known); ``missing_calls`` the mpi4py methods that are absent.
    """
    first = library.replace("\0", "").strip().splitlines()[0] if library.strip() else "unknown"
    name = first.split(",")[0]

    def off(reason: str) -> FaultTolerance:
        return FaultTolerance(False, reason, first, source)

    major = re.match(r"(\d+)", mpi4py_version)
    if major is None or int(major.group(1)) < 4:
        return off(f"mpi4py {mpi4py_version} has no ULFM calls (needs mpi4py >= 4)")
    version = _open_mpi_version(first)
    if version is None:
        return off(f"the MPI library is {name}, not Open MPI >= 5 (only Open MPI's ULFM "
                   "is used; mpi4py maps the calls to stand-ins that do not tolerate faults)")
    if version[0] < 5:
        return off(f"{name} has no fault tolerance (ULFM needs Open MPI >= 5, started "
                   "with mpiexec --with-ft ulfm)")
    if missing_symbols:
        return off(f"{name} was built without fault tolerance (no {missing_symbols[0]})")
    if missing_calls:
        return off(f"mpi4py {mpi4py_version} lacks Comm.{missing_calls[0]}")
    if ft_enabled is None:
        return off(f"{name}: cannot tell whether fault tolerance is on (no mpi_ft_enable "
                   "found); start the job with mpiexec --with-ft ulfm")
    if not ft_enabled:
        return off(f"{name} has fault tolerance, but this job did not turn it on "
                   "(mpi_ft_enable is false): start it with mpiexec --with-ft ulfm")
    return FaultTolerance(True, "", first, source)


def _libmpi() -> Any:
    """The libmpi this process has loaded (never loads one), or None."""
    for name in ("libmpi.so.40", "libmpi.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        except OSError:
            continue
    return None


def _read_cvar(lib: Any, name: str) -> int | None:
    """An integer or boolean control variable of the MPI tool interface (MPI_T), None when
    it is not there. Only for Open MPI >= 5 (its handle types); every return code is
    checked and the tool interface is closed again."""
    provided = ctypes.c_int()
    if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
        return None
    try:
        index = ctypes.c_int()
        if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) != 0:
            return None
        handle, count = ctypes.c_void_p(), ctypes.c_int()
        if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle),
                                       ctypes.byref(count)) != 0:
            return None
        try:
            if count.value != 1:
                return None
            buf = (ctypes.c_ubyte * 64)()
            if lib.MPI_T_cvar_read(handle, buf) != 0:
                return None
            return int.from_bytes(bytes(buf[:8]), "little")
        finally:
            lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    finally:
        lib.MPI_T_finalize()


def mpi_ft_enable(lib: Any = None) -> tuple[bool | None, str]:
    """``(value, source)`` of Open MPI's ``mpi_ft_enable`` in this process: read through
    MPI_T from ``lib`` (the loaded Open MPI >= 5 libmpi) when given, else from
    ``OMPI_MCA_mpi_ft_enable``; ``(None, "unknown")`` when neither says. Not collective."""
    if lib is not None and all(hasattr(lib, f) for f in ("MPI_T_init_thread",
                                                         "MPI_T_cvar_read")):
        value = _read_cvar(lib, "mpi_ft_enable")
        if value is not None:
            return bool(value), "MPI_T"
    env = os.environ.get("OMPI_MCA_mpi_ft_enable")
    if env is not None:
        return env.strip().lower() in _ON, "environment"
    return None, "unknown"


_VERDICT: list[FaultTolerance] = []


def fault_tolerance() -> FaultTolerance:
    """Whether in-job recovery from a dead rank is possible in this process, and why not.

    Not collective and local: imports ``mpi4py.MPI`` (which initialises MPI as usual) and
    asks the library, never the other ranks; every rank of one job normally gets the same
    verdict, and where ranks disagree (a mixed launch) each keeps its own and callers must
    agree on it collectively before relying on it. The answer is kept for the process.
    """
    if _VERDICT:
        return _VERDICT[0]
    import mpi4py
    from mpi4py import MPI

    library = MPI.Get_library_version()
    version = _open_mpi_version(library)
    lib = _libmpi() if version is not None and version[0] >= 5 else None
    missing_symbols = (None if lib is None else
                       tuple(s for s in ULFM_SYMBOLS if not hasattr(lib, s)))
    missing_calls = tuple(c for c in ULFM_CALLS if not hasattr(MPI.Comm, c))
    enabled, source = mpi_ft_enable(lib if not missing_symbols else None)
    verdict = assess_fault_tolerance(library, mpi4py.__version__, ft_enabled=enabled,
                                     missing_symbols=missing_symbols,
                                     missing_calls=missing_calls, source=source)
    _VERDICT.append(verdict)
    return verdict
