"""Point-to-point transfers on NumPy and CUDA arrays: send, recv and their nonblocking forms.

Not collective: each call involves this rank and one peer of ``comm``. Any dtype (16-bit
floats are carried as ``uint16``); device arrays are staged as in
:mod:`mpidist.core.collectives`, which re-exports these functions.
"""

from __future__ import annotations

from typing import Any

from mpidist.core import devices as _dev
from mpidist.core.checks import check_array, wire
from mpidist.core.comms import traced
from mpidist.core.requests import Request

__all__ = ["irecv", "isend", "recv", "send"]


def _check_peer(peer: int, comm: Any, what: str) -> None:
    if comm is None:
        raise ValueError(f"{what} needs a communicator; comm=None has no peers")
    n = comm.Get_size()
    if not 0 <= peer < n:
        raise ValueError(f"{what}={peer} is outside a group of size {n}")


def isend(buf: Any, dest: int, *, comm: Any, tag: int = 0) -> Request:
    """Start sending ``buf`` to rank ``dest`` of ``comm``. Not collective (point to point).

    The buffer must not be modified until the request completes.
    """
    comm = traced(comm)
    b = check_array(buf, "send buffer")
    _check_peer(dest, comm, "dest")
    host, _ = _dev.stage(b)
    return Request([comm.Isend(wire(host), dest=dest, tag=tag)], buf, keep=(host,))


def send(buf: Any, dest: int, *, comm: Any, tag: int = 0) -> None:
    """Send ``buf`` to rank ``dest`` of ``comm`` (blocking). Point to point."""
    comm = traced(comm)
    isend(buf, dest, comm=comm, tag=tag).wait()


def irecv(buf: Any, source: int, *, comm: Any, tag: int = 0) -> Request:
    """Start receiving into ``buf`` from rank ``source``; ``wait()`` returns ``buf``."""
    comm = traced(comm)
    b = check_array(buf, "receive buffer")
    _check_peer(source, comm, "source")
    host, back = _dev.stage(b, read=False)
    req = comm.Irecv(wire(host), source=source, tag=tag)
    return Request([req], buf, None if back is None else (lambda: back(host)), keep=(host,))


def recv(buf: Any, source: int, *, comm: Any, tag: int = 0) -> Any:
    """Receive into ``buf`` from rank ``source`` of ``comm`` (blocking); returns ``buf``."""
    comm = traced(comm)
    return irecv(buf, source, comm=comm, tag=tag).wait()
