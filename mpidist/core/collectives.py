"""Collectives on NumPy (and CUDA) arrays: allreduce, allgather, reduce_scatter, broadcast, p2p.

Every function takes the communicator as the keyword ``comm`` (an ``mpi4py`` intracomm or
None). A group of size 1 (or ``comm=None``) takes a fast path that makes no MPI call, so
everything also runs under plain ``python`` and ``pytest``.

Lengths that do not divide the group size are padded, never rejected: ``reduce_scatter``
of 10 elements over 3 ranks gives each rank 4 (the last rank's tail is zero padding) and
``allgather(shard, numel=10)`` gives back exactly the original 10. Buffers that already
have a padded length (``mpidist.core.buffers.FlatBuffer``) go to MPI without any copy.

Reductions support float32, float64, int32 and int64. Gathers, broadcasts and
point-to-point transfers take any dtype (16-bit floats are carried as ``uint16``).

Device arrays of any library (Numba, CuPy, torch: anything exposing
``__cuda_array_interface__``) are passed to MPI directly when the MPI library is CUDA-aware
(``MPI.Query_cuda_support()``, or ``MPIDIST_CUDA_AWARE=1``), after the device is
synchronised; otherwise they are staged through a pinned host buffer: device → host, the
collective on the host array, host → device (see :mod:`mpidist.core.devices`).

Debug mode (``MPIDIST_DEBUG=1`` or :func:`set_debug`): before each collective the ranks
exchange the operation name, dtype and shape with one small Allgather and raise
:class:`CollectiveMismatchError` on every rank, naming the ranks that differ, instead of
hanging or silently mixing buffers.

This module holds the reductions (``allreduce``, ``reduce_scatter`` and their nonblocking
forms) and re-exports the rest of the API from where it lives: the gathers and broadcast
(:mod:`mpidist.core.gathers`), point to point (:mod:`mpidist.core.p2p`), :class:`Request`
and :func:`wait_all` (:mod:`mpidist.core.requests`), the debug check
(:mod:`mpidist.core.checks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpidist.core import devices as _dev
from mpidist.core import topology as _topo
from mpidist.core.checks import (
    CollectiveMismatchError,
    check_array,
    check_op,
    check_out,
    check_signature,
    debug_enabled,
    flat,
    group_size,
    maybe_check,
    set_debug,
    two_level,
)
from mpidist.core.comms import traced
from mpidist.core.gathers import (
    allgather,
    allgather_inplace,
    allgather_varied,
    broadcast,
    iallgather,
    iallgather_inplace,
)
from mpidist.core.p2p import irecv, isend, recv, send
from mpidist.core.requests import Request, mpi, mpi_op, wait_all

__all__ = [
    "CollectiveMismatchError",
    "Request",
    "check_signature",
    "debug_enabled",
    "allgather",
    "allgather_inplace",
    "allgather_varied",
    "cuda_aware",
    "allreduce",
    "broadcast",
    "iallgather",
    "iallgather_inplace",
    "iallreduce",
    "ireduce_scatter",
    "irecv",
    "isend",
    "recv",
    "reduce_scatter",
    "send",
    "set_debug",
    "wait_all",
]

_is_device = _dev.is_device  # the name this module has always had for it
cuda_aware = _dev.cuda_aware


def iallreduce(
    buf: Any, op: str = "sum", *, comm: Any = None, algorithm: str | None = None
) -> Request:
    """Start an in-place allreduce of ``buf`` over ``comm``; ``wait()`` returns ``buf``.

    Collective over ``comm``: every rank must call it, in the same order as its other
    collectives, with the same op, shape, dtype and ``algorithm``. ``op`` is sum, avg, max
    or min. ``algorithm``: "flat" (one MPI call), "hierarchical" (two levels when the group
    spans nodes, see :mod:`mpidist.core.topology`) or "auto" (two levels from
    ``MPIDIST_HIERARCHICAL_MIN_BYTES`` up); None reads ``MPIDIST_COLLECTIVES`` (default auto).
    """
    comm = traced(comm)
    check_op(op)
    b = check_array(buf, "allreduce buffer", reduce=True)
    algorithm = _topo.check_algorithm(algorithm)
    n = group_size(comm)
    if n == 1:
        return Request([], buf)
    if debug_enabled():
        maybe_check(comm, f"allreduce[{op}]", b)
    host, back = _dev.stage(b)
    topo = two_level(comm, host, host.nbytes, algorithm)

    def finish() -> None:
        if op == "avg":
            _dev.scale(host, n)
        if back is not None:
            back(host)

    if topo is not None:
        stages = _topo.allreduce_stages(flat(host), "sum" if op == "avg" else op, topo)
        return Request([], buf, finish, stages=stages)
    req = comm.Iallreduce(mpi().IN_PLACE, flat(host), op=mpi_op(op))
    return Request([req], buf, finish)


def allreduce(
    buf: Any, op: str = "sum", *, comm: Any = None, algorithm: str | None = None
) -> Any:
    """Allreduce ``buf`` in place over ``comm`` and return it. Collective over ``comm``.

    ``op``: sum, avg (sum then one scaling pass by 1/size), max or min. ``algorithm`` as in
    :func:`iallreduce`.
    """
    comm = traced(comm)
    check_op(op)
    b = check_array(buf, "allreduce buffer", reduce=True)
    algorithm = _topo.check_algorithm(algorithm)
    n = group_size(comm)
    if n == 1:
        return buf
    if two_level(comm, b, b.nbytes, algorithm) is not None:
        return iallreduce(buf, op, comm=comm, algorithm=algorithm).wait()
    if debug_enabled():
        maybe_check(comm, f"allreduce[{op}]", b)
    host, back = _dev.stage(b)
    comm.Allreduce(mpi().IN_PLACE, flat(host), op=mpi_op(op))
    if op == "avg":
        _dev.scale(host, n)
    if back is not None:
        back(host)
    return buf


# -- reduce_scatter -----------------------------------------------------------------------
def _padded_input(buf: np.ndarray, n: int) -> np.ndarray:
    whole = flat(buf)
    rem = whole.shape[0] % n
    if rem == 0:
        return whole
    padded = np.zeros(whole.shape[0] + n - rem, dtype=whole.dtype)
    padded[: whole.shape[0]] = whole
    return padded


def ireduce_scatter(
    buf: Any, op: str = "sum", *, comm: Any = None, out: Any = None,
    algorithm: str | None = None,
) -> Request:
    """Start a reduce-scatter of ``buf``; ``wait()`` returns this rank's reduced shard.

    Collective over ``comm``. ``buf`` is padded with zeros to a multiple of the group size
    ``n`` when needed; rank r receives elements ``[r*s, (r+1)*s)`` of the reduced buffer,
    ``s = ceil(len(buf)/n)``. ``out`` (length ``s``) receives the shard if given.
    ``op`` is sum or avg; ``algorithm`` as in :func:`iallreduce`.
    """
    comm = traced(comm)
    check_op(op, ("sum", "avg"))
    b = check_array(buf, "reduce_scatter buffer", reduce=True)
    algorithm = _topo.check_algorithm(algorithm)
    n = group_size(comm)
    numel = b.size
    s = -(-numel // n)
    if out is not None:
        o = check_out(out, s, b.dtype, "reduce_scatter", reduce=True)
    if n == 1:
        if out is None:
            return Request([], flat(b))
        _dev.copy(o, b)
        return Request([], out)
    if debug_enabled():
        maybe_check(comm, f"reduce_scatter[{op}]", b)
    host_in, _ = _dev.stage(b)
    if _dev.is_device(host_in) and numel % n:  # CUDA-aware MPI, but padding is done on the host
        host_in = host_in.copy_to_host()
    send = _padded_input(host_in, n)
    if out is None:
        result = np.empty(s, dtype=send.dtype)
        back = None
        target: Any = result
    else:
        result, back = _dev.stage(o, read=False)
        target = out

    def finish() -> None:
        if op == "avg":
            _dev.scale(result, n)
        if back is not None:
            back(result)

    topo = two_level(comm, result, send.nbytes, algorithm)
    if topo is not None:
        stages = _topo.reduce_scatter_stages(send, flat(result), "sum", topo)
        return Request([], target, finish, keep=(send, result), stages=stages)
    req = comm.Ireduce_scatter_block(send, flat(result), op=mpi_op(op))
    return Request([req], target, finish, keep=(send, result))


def reduce_scatter(
    buf: Any, op: str = "sum", *, comm: Any = None, out: Any = None,
    algorithm: str | None = None,
) -> Any:
    """Reduce ``buf`` over ``comm`` and return this rank's shard (see :func:`ireduce_scatter`).

    Collective over ``comm``.
    """
    comm = traced(comm)
    check_op(op, ("sum", "avg"))
    check_array(buf, "reduce_scatter buffer", reduce=True)
    algorithm = _topo.check_algorithm(algorithm)
    n = group_size(comm)
    if n == 1 or _dev.is_device(buf) or (out is not None and _dev.is_device(out)):
        return ireduce_scatter(buf, op, comm=comm, out=out, algorithm=algorithm).wait()
    s = -(-buf.size // n)
    if out is not None:
        check_out(out, s, buf.dtype, "reduce_scatter", reduce=True)
    if two_level(comm, buf, s * n * buf.itemsize, algorithm) is not None:
        return ireduce_scatter(buf, op, comm=comm, out=out, algorithm=algorithm).wait()
    if debug_enabled():
        maybe_check(comm, f"reduce_scatter[{op}]", buf)
    send = _padded_input(buf, n)
    result = np.empty(s, dtype=send.dtype) if out is None else out
    comm.Reduce_scatter_block(send, flat(result), op=mpi_op(op))
    if op == "avg":
        _dev.scale(result, n)
    return result
