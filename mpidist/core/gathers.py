"""Allgathers (equal, in-place and varied segments) and broadcast on NumPy and CUDA arrays.

Collective over the keyword ``comm``; ``comm=None`` or a group of one makes no MPI call.
Any dtype (16-bit floats are carried as ``uint16``). Re-exported by
:mod:`mpidist.core.collectives`, whose docstring describes padding, device arrays and the
debug check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.core import devices as _dev
from mpidist.core import topology as _topo
from mpidist.core.checks import (
    check_array,
    check_out,
    debug_enabled,
    flat,
    group_size,
    maybe_check,
    two_level,
    wire,
)
from mpidist.core.comms import traced
from mpidist.core.requests import Request, mpi

__all__ = [
    "allgather", "allgather_inplace", "allgather_varied", "broadcast", "iallgather",
    "iallgather_inplace",
]


def iallgather(
    shard: Any, *, comm: Any = None, numel: int | None = None, out: Any = None,
    algorithm: str | None = None,
) -> Request:
    """Start an allgather of equal-length shards; ``wait()`` returns the concatenation.

    Collective over ``comm``. The result has ``size * len(shard)`` elements, or the first
    ``numel`` of them when ``numel`` is given (dropping the padding added by
    :func:`reduce_scatter`). ``out``, if given, must hold ``size * len(shard)`` elements.
    ``algorithm`` as in :func:`iallreduce`.
    """
    comm = traced(comm)
    sh = check_array(shard, "allgather shard")
    algorithm = _topo.check_algorithm(algorithm)
    n = group_size(comm)
    s = sh.size
    total = n * s
    if numel is not None and not 0 <= numel <= total:
        raise ValueError(f"numel={numel} is outside [0, {total}] for {n} shards of {s}")
    if out is not None:
        o = check_out(out, total, sh.dtype, "allgather")

    def trim(a: Any) -> Any:
        return a if numel is None or numel == total else flat(a)[:numel]

    if n == 1:
        if out is None:
            return Request([], trim(flat(sh)))
        _dev.copy(o, sh)
        return Request([], trim(out))
    if debug_enabled():
        maybe_check(comm, "allgather", sh)
    host_in, _ = _dev.stage(sh)
    if out is None:
        result = np.empty(total, dtype=np.dtype(sh.dtype))
        back, target = None, result
    else:
        result, back = _dev.stage(o, read=False)
        target = out

    def finish() -> Any:
        if back is not None:
            back(result)
        return trim(target)

    topo = two_level(comm, result, result.nbytes, algorithm)
    if topo is not None:
        stages = _topo.allgather_stages(wire(host_in), wire(result), topo)
        return Request([], target, finish, keep=(host_in, result), stages=stages)
    req = comm.Iallgather(wire(host_in), wire(result))
    return Request([req], target, finish, keep=(host_in, result))


def allgather(
    shard: Any, *, comm: Any = None, numel: int | None = None, out: Any = None,
    algorithm: str | None = None,
) -> Any:
    """Gather equal-length shards from every rank (see :func:`iallgather`). Collective."""
    comm = traced(comm)
    algorithm = _topo.check_algorithm(algorithm)
    kw = {"comm": comm, "numel": numel, "out": out, "algorithm": algorithm}
    if group_size(comm) == 1 or _dev.is_device(shard) or (out is not None and _dev.is_device(out)):
        return iallgather(shard, **kw).wait()
    check_array(shard, "allgather shard")
    total = comm.Get_size() * shard.size
    if out is not None:
        check_out(out, total, shard.dtype, "allgather")
    if numel is not None and not 0 <= numel <= total:
        return iallgather(shard, **kw).wait()  # raises ValueError
    if two_level(comm, shard, total * shard.itemsize, algorithm) is not None:
        return iallgather(shard, **kw).wait()
    if debug_enabled():
        maybe_check(comm, "allgather", shard)
    result = np.empty(total, dtype=shard.dtype) if out is None else out
    comm.Allgather(wire(shard), wire(result))
    if numel is None or numel == total:
        return result
    return flat(result)[:numel]


def iallgather_inplace(buf: Any, *, comm: Any = None, algorithm: str | None = None) -> Request:
    """Start an in-place allgather: rank r's segment ``[r*s, (r+1)*s)`` of ``buf`` is its input.

    Collective over ``comm``. ``len(buf)`` must be a multiple of the group size (flat
    buffers are built padded). ``wait()`` returns ``buf`` with every segment filled.
    ``algorithm`` as in :func:`iallreduce`.
    """
    comm = traced(comm)
    b = check_array(buf, "allgather buffer")
    algorithm = _topo.check_algorithm(algorithm)
    n = group_size(comm)
    numel = b.size
    if numel % n:
        raise ValueError(
            f"in-place allgather needs a length divisible by the group size; "
            f"got {numel} over {n} ranks (pad the buffer to {-(-numel // n) * n})"
        )
    if n == 1:
        return Request([], buf)
    if debug_enabled():
        maybe_check(comm, "allgather_inplace", b)
    host, back = _dev.stage(b)
    finish = None if back is None else (lambda: back(host))
    topo = two_level(comm, host, host.nbytes, algorithm)
    if topo is not None:
        whole, s = flat(host), numel // n
        mine = whole[comm.Get_rank() * s:(comm.Get_rank() + 1) * s]
        stages = _topo.allgather_stages(mine, whole, topo)
        return Request([], buf, finish, keep=(host,), stages=stages)
    req = comm.Iallgather(mpi().IN_PLACE, wire(host))
    return Request([req], buf, finish)


def allgather_inplace(buf: Any, *, comm: Any = None, algorithm: str | None = None) -> Any:
    """In-place allgather (see :func:`iallgather_inplace`); returns ``buf``. Collective."""
    comm = traced(comm)
    algorithm = _topo.check_algorithm(algorithm)
    n = group_size(comm)
    if n == 1 or _dev.is_device(buf):
        return iallgather_inplace(buf, comm=comm, algorithm=algorithm).wait()
    check_array(buf, "allgather buffer")
    if buf.size % n or two_level(comm, buf, buf.nbytes, algorithm) is not None:
        # (a length that does not divide raises the ValueError there)
        return iallgather_inplace(buf, comm=comm, algorithm=algorithm).wait()
    if debug_enabled():
        maybe_check(comm, "allgather_inplace", buf)
    comm.Allgather(mpi().IN_PLACE, wire(buf))
    return buf


def allgather_varied(buf: Any, counts: Sequence[int], *, comm: Any = None) -> Any:
    """In-place allgather of segments of different lengths: rank r's input is its segment
    of ``counts[r]`` elements of ``buf`` (segments in rank order); returns ``buf`` with
    every segment filled. Collective over ``comm``; every rank passes the same ``counts``.
    Always flat (the two-level stages need equal segments)."""
    comm = traced(comm)
    b = check_array(buf, "allgather buffer")
    n = group_size(comm)
    if len(counts) != n or sum(counts) != b.size or min(counts, default=0) < 0:
        raise ValueError(f"allgather counts {list(counts)[:8]} do not split {b.size} "
                         f"elements over {n} ranks")
    if n == 1:
        return buf
    if debug_enabled():
        maybe_check(comm, "allgather_varied", b, f" counts={list(counts)[:8]}")
    host, back = _dev.stage(b)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    comm.Allgatherv(mpi().IN_PLACE, [wire(host), (list(counts), displs)])
    if back is not None:
        back(host)
    return buf


# -- broadcast ----------------------------------------------------------------------------
def broadcast(buf: Any, root: int = 0, *, comm: Any = None) -> Any:
    """Broadcast ``buf`` from ``root`` in place and return it. Collective over ``comm``."""
    comm = traced(comm)
    b = check_array(buf, "broadcast buffer")
    n = group_size(comm)
    if not 0 <= root < n:
        raise ValueError(f"root={root} is outside a group of size {n}")
    if n == 1:
        return buf
    if debug_enabled():
        maybe_check(comm, f"broadcast[root={root}]", b)
    host, back = _dev.stage(b, read=comm.Get_rank() == root)
    comm.Bcast(wire(host), root=root)
    if back is not None:
        back(host)
    return buf
