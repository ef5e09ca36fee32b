"""Measured, chained nonblocking exchanges: what the communication-efficient strategies
send goes through a :class:`CountingComm`, and multi-phase exchanges are
:class:`RequestChain` objects with DDP's request interface.

Every byte a strategy sends is counted where it is handed to MPI: the gradient/parameter
exchange goes through a :class:`CountingComm`, a thin proxy over the dp communicator that
adds the size of each send buffer passed to an MPI call (for in-place calls, the part of
the buffer this rank contributes). ``bytes_sent`` counters are therefore measured, not
derived from formulas.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpidist.core.comms import mpi, size_rank, test_all, wait_all

__all__ = ["CountingComm", "RequestChain", "iallgather", "iallreduce"]


# -- measuring what is sent ---------------------------------------------------------------------
def _spec_bytes(spec: Any, skip: int | None = None) -> int:
    """Bytes of an mpi4py buffer spec: an array, or ``[array, (counts, displs), type]``."""
    if isinstance(spec, np.ndarray):
        return int(spec.nbytes)
    if isinstance(spec, (list, tuple)):
        arr = spec[0]
        if len(spec) >= 2 and isinstance(spec[1], (list, tuple)) and len(spec[1]) == 2 \
                and isinstance(spec[1][0], (list, tuple, np.ndarray)):
            counts = [int(c) for i, c in enumerate(spec[1][0]) if i != skip]
            return int(sum(counts)) * np.asarray(arr).itemsize
        return int(np.asarray(arr).nbytes)
    return int(memoryview(spec).nbytes)


class CountingComm:
    """A proxy over an mpi4py intracommunicator that counts the bytes this rank sends.

    Every collective called through it adds the size of the send buffer it is handed:
    the whole buffer for (all)reduce, this rank's segment for an in-place allgather, and
    the counts addressed to other ranks for ``Alltoallv``. Everything else (``Get_size``,
    ``Get_rank``...) is forwarded unchanged, so the proxy can be passed as ``comm=`` to
    :mod:`mpidist.core.collectives`. ``calls`` counts MPI calls, ``bytes`` the bytes sent.
    """

    def __init__(self, comm: Any, *, totals: CountingComm | None = None) -> None:
        self._comm = comm
        self._totals = totals  # another counter that also receives every count
        self.bytes = 0
        self.calls = 0
        self.by_op: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    @property
    def comm(self) -> Any:
        """The wrapped communicator."""
        return self._comm

    def _add(self, op: str, nbytes: int) -> None:
        self.bytes += int(nbytes)
        self.calls += 1
        self.by_op[op] = self.by_op.get(op, 0) + int(nbytes)
        if self._totals is not None:
            self._totals._add(op, nbytes)

    def _in_place(self, sendbuf: Any) -> bool:
        return sendbuf is mpi().IN_PLACE

    def _reduce(self, name: str, sendbuf: Any, recvbuf: Any, *args: Any, **kw: Any) -> Any:
        self._add(name, _spec_bytes(recvbuf if self._in_place(sendbuf) else sendbuf))
        return getattr(self._comm, name)(sendbuf, recvbuf, *args, **kw)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, *a: Any, **kw: Any) -> Any:  # noqa: N802
        return self._reduce("Allreduce", sendbuf, recvbuf, *a, **kw)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, *a: Any, **kw: Any) -> Any:  # noqa: N802
        return self._reduce("Iallreduce", sendbuf, recvbuf, *a, **kw)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, *a: Any, **kw: Any) -> Any:  # noqa: N802
        return self._reduce("Reduce_scatter_block", sendbuf, recvbuf, *a, **kw)

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, *a: Any, **kw: Any) -> Any:  # noqa: N802
        return self._reduce("Ireduce_scatter_block", sendbuf, recvbuf, *a, **kw)

    def _gather(self, name: str, sendbuf: Any, recvbuf: Any) -> Any:
        if self._in_place(sendbuf):
            nbytes = _spec_bytes(recvbuf) // self._comm.Get_size()
        else:
            nbytes = _spec_bytes(sendbuf)
        self._add(name, nbytes)
        return getattr(self._comm, name)(sendbuf, recvbuf)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        return self._gather("Allgather", sendbuf, recvbuf)

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        return self._gather("Iallgather", sendbuf, recvbuf)

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        self._add("Ialltoallv", _spec_bytes(sendbuf, skip=self._comm.Get_rank()))
        return self._comm.Ialltoallv(sendbuf, recvbuf)

    def Bcast(self, buf: Any, root: int = 0) -> Any:  # noqa: N802
        if self._comm.Get_rank() == root:
            self._add("Bcast", _spec_bytes(buf))
        return self._comm.Bcast(buf, root=root)


_IN_FLIGHT: list[RequestChain] = []


class RequestChain:
    """A multi-phase nonblocking exchange with DDP's request interface (``wait``/``test``).

    ``then()`` runs when the current phase's MPI requests are complete and returns the next
    phase ``(requests, then)`` or None when the exchange is finished.

    Nonblocking collectives must be started in the same order on every rank of a
    communicator, but phase 1 of different buckets completes in a timing-dependent order.
    So a two-phase chain starts its second phase on a second communicator, and only when it
    is at the head of the shared ``gate`` queue (chains enter it in bucket-start order):
    second phases therefore start in bucket order on every rank.
    """

    def __init__(self, reqs: Sequence[Any], then: Callable[[], Any] | None,
                 gate: deque[RequestChain] | None = None) -> None:
        self._reqs = list(reqs)
        self._then = then
        self._gate = gate
        if gate is not None:
            gate.append(self)
        # An exchange still in flight must outlive whoever started it: were its MPI
        # requests (and with them its buffers) garbage-collected, MPI would write into
        # freed memory. Finished chains leave the registry when next it is swept.
        _IN_FLIGHT[:] = [c for c in _IN_FLIGHT if not c.done]
        if not self.done:
            _IN_FLIGHT.append(self)

    def _can_advance(self) -> bool:
        return self._gate is None or self._gate[0] is self

    def _advance(self) -> None:
        if self._gate is not None:
            self._gate.popleft()
            self._gate = None
        for r in self._reqs:  # this phase is complete: its buffers may go
            _PINNED.pop(id(r), None)
        nxt = self._then() if self._then is not None else None
        if nxt is None:
            self._reqs, self._then = [], None
        else:
            self._reqs, self._then = list(nxt[0]), nxt[1]

    @property
    def done(self) -> bool:
        return not self._reqs and self._then is None

    def test(self) -> bool:
        while not self.done:
            if self._reqs and not test_all(self._reqs):
                return False
            if not self._can_advance():
                return False
            self._advance()
        return True

    def wait(self) -> None:
        while not self.done:
            if self._reqs:
                wait_all(self._reqs)
            while not self._can_advance():
                if self._gate is None:
                    raise RuntimeError("exchange: waiting to advance with no gate to wait on")
                self._gate[0].wait()
            self._advance()


#: Buffers of nonblocking reductions in flight, by ``id`` of their MPI request. mpi4py
#: (4.1) keeps a reference to the buffers of a nonblocking Iallgather, Ialltoallv or
#: Isend, but not of an Iallreduce: were the array collected (its exchange dropped, say),
#: MPI would write into freed memory, which showed up as heap corruption inside Open MPI's
#: progress engine. A chain releases its phase's entries when the phase completes.
_PINNED: dict[int, tuple[Any, np.ndarray]] = {}


def iallreduce(buf: np.ndarray, comm: Any) -> list[Any]:
    """Start an in-place sum allreduce; [] on a group of one (or no communicator).

    ``buf`` stays referenced (:data:`_PINNED`) until the :class:`RequestChain` that holds the
    request sees it complete."""
    if size_rank(comm)[0] == 1:
        return []
    req = comm.Iallreduce(mpi().IN_PLACE, buf.reshape(-1), op=mpi().SUM)
    _PINNED[id(req)] = (req, buf)
    return [req]


def iallgather(send: np.ndarray, recv: np.ndarray, comm: Any) -> list[Any]:
    if comm.Get_size() == 1:
        recv[:] = send.reshape(-1)
        return []
    return [comm.Iallgather(send, recv)]

