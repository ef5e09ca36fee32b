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
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpidist.core import devices as _dev
from mpidist.core import topology as _topo

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

_REDUCE_OPS = ("sum", "avg", "max", "min")
_REDUCIBLE = {np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64)}
_SIG_BYTES = 160

_debug = os.environ.get("MPIDIST_DEBUG", "0") not in ("", "0", "false", "no")


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives, or the same one with different shapes/dtypes."""


def set_debug(enabled: bool) -> bool:
    """Turn the cross-rank collective check on or off; returns the previous setting.

    Must be set the same on every rank of a communicator (the check is itself a collective).
    """
    global _debug
    previous, _debug = _debug, bool(enabled)
    return previous


def debug_enabled() -> bool:
    """Whether the cross-rank collective check is on (``MPIDIST_DEBUG=1`` or
    :func:`set_debug`). Not collective."""
    return _debug


def check_signature(comm: Any, signature: str) -> None:
    """Collective over ``comm``: raise :class:`CollectiveMismatchError` on every rank when
    the ranks' ``signature`` strings (operation, dtype, shape, ...) differ, naming the ranks
    of each variant. The first 160 bytes of a signature are compared."""
    if _size(comm) > 1:
        _debug_check(comm, signature)


def _size(comm: Any) -> int:
    return 1 if comm is None else comm.Get_size()


_MPI: Any = None
_OPS: dict[str, Any] = {}


def _mpi() -> Any:
    """mpi4py.MPI, imported on first use so that importing mpidist does not start MPI."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI

        _OPS.update(sum=MPI.SUM, avg=MPI.SUM, max=MPI.MAX, min=MPI.MIN)
        _MPI = MPI
    return _MPI


def _mpi_op(op: str) -> Any:
    if not _OPS:
        _mpi()
    return _OPS[op]


def _check_op(op: str, allowed: Sequence[str] = _REDUCE_OPS) -> None:
    if op not in allowed:
        raise ValueError(f"op={op!r} is not one of {tuple(allowed)}")


# -- device arrays (mpidist.core.devices) ------------------------------------------------------
_is_device = _dev.is_device
cuda_aware = _dev.cuda_aware


def _check_array(a: Any, what: str, reduce: bool = False) -> Any:
    """``a`` as the collectives use it (a device array as a Numba view of it), after
    checking it; TypeError/ValueError naming ``what`` otherwise."""
    if _is_device(a):
        a = _dev.view(a)
        dtype = np.dtype(a.dtype)
    elif isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous; got strides {a.strides}")
        dtype = a.dtype
    else:
        raise TypeError(f"{what} must be a NumPy or CUDA array, not {type(a).__name__}")
    if reduce and dtype not in _REDUCIBLE:
        raise ValueError(
            f"{what} has dtype {dtype}; reductions support "
            f"{sorted(str(d) for d in _REDUCIBLE)}"
        )
    return a


def _check_out(out: Any, size: int, dtype: Any, what: str, reduce: bool = False) -> Any:
    """``out`` checked as by :func:`_check_array` and to hold ``size`` elements of ``dtype``."""
    o = _check_array(out, f"{what} output", reduce)
    if o.size != size or np.dtype(o.dtype) != np.dtype(dtype):
        raise ValueError(f"{what} output has shape {tuple(o.shape)} and dtype {o.dtype}; "
                         f"need {size} elements of {dtype}")
    return o


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def _wire(a: Any) -> Any:
    """``a`` flat, as MPI is given it outside reductions: 16-bit floats (float16, bfloat16)
    viewed as ``uint16``, which MPI carries bit for bit (it has no such float types)."""
    a = _flat(a)
    dt = np.dtype(a.dtype)
    return a.view(np.uint16) if dt.itemsize == 2 and dt.kind not in "iu" else a


# -- debug check --------------------------------------------------------------------------
def _debug_check(comm: Any, sig: str) -> None:
    """Collective: every rank's signature must match, else raise on every rank."""
    raw = sig.encode()[:_SIG_BYTES].ljust(_SIG_BYTES, b"\0")
    mine = np.frombuffer(raw, dtype=np.uint8).copy()
    everyone = np.empty((comm.Get_size(), _SIG_BYTES), dtype=np.uint8)
    comm.Allgather(mine, everyone)
    sigs = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in everyone]
    if len(set(sigs)) > 1:
        groups: dict[str, list[int]] = {}
        for r, s in enumerate(sigs):
            groups.setdefault(s, []).append(r)
        detail = "; ".join(f"ranks {rs}: {s}" for s, rs in groups.items())
        raise CollectiveMismatchError(f"collective mismatch on a group of {len(sigs)}: {detail}")


def _maybe_check(comm: Any, name: str, a: Any, extra: str = "") -> None:
    _debug_check(comm, f"{name} dtype={np.dtype(a.dtype)} shape={tuple(a.shape)}{extra}")


# -- requests -----------------------------------------------------------------------------
_LIVE: set[Request] = set()


class Request:
    """A pending nonblocking operation. ``wait()`` completes it and returns its result.

    Finishing work (averaging, unpadding, copying a staged result back to the device)
    happens in ``wait()``/a successful ``test()``, exactly once. A two-level collective is
    a sequence of stages (``stages``: a generator yielding lists of MPI requests); the next
    stage starts when the previous one has completed, in ``wait()`` or ``test()``.
    """

    def __init__(
        self,
        reqs: Sequence[Any],
        result: Any,
        finish: Callable[[], Any] | None = None,
        keep: tuple = (),
        stages: _topo.Stages | None = None,
    ) -> None:
        self._stages = stages
        if stages is not None:
            reqs = next(stages)
        self._reqs = list(reqs)
        self._result = result
        self._finish = finish
        self._done = False
        self._keep = keep  # buffers MPI reads or writes until completion stay alive
        if self._reqs:
            # A request in flight outlives whoever started it (a dropped model, a failed
            # test): its MPI requests and buffers must stay alive until MPI is done.
            _LIVE.add(self)

    def _complete(self) -> Any:
        if not self._done:
            self._done = True
            self._keep = ()
            _LIVE.discard(self)
            if self._finish is not None:
                out = self._finish()
                if out is not None:
                    self._result = out
        return self._result

    def _advance(self) -> bool:
        """Start the next stage; False when there is none."""
        if self._stages is None:
            return False
        try:
            self._reqs = next(self._stages)
        except StopIteration:
            self._stages = None
            return False
        return True

    def wait(self) -> Any:
        """Block until done; return the result (the output array)."""
        if not self._done:
            while True:
                if self._reqs:
                    if self._stages is not None and _POLL_SLEEP > 0:
                        _poll(self._reqs)
                    else:
                        _mpi().Request.Waitall(self._reqs)
                if not self._advance():
                    break
        return self._complete()

    def test(self) -> bool:
        """True (and the result is ready) when done; drives MPI progress otherwise."""
        if self._done:
            return True
        while True:
            if self._reqs and not _mpi().Request.Testall(self._reqs):
                return False
            if not self._advance():
                break
        self._complete()
        return True

    @property
    def done(self) -> bool:
        return self._done


_POLL_SLEEP = float(os.environ.get("MPIDIST_POLL_SLEEP", "0.0002"))


def _poll(reqs: list[Any]) -> None:
    # Sleep between tests rather than spin in Waitall: ranks waiting on the inter-node link
    # then leave the cores to the node's ranks doing shared-memory stages.
    test = _mpi().Request.Testall
    while not test(reqs):
        time.sleep(_POLL_SLEEP)


def wait_all(requests: Sequence[Request]) -> list[Any]:
    """Wait for every request; returns their results in order."""
    return [r.wait() for r in requests]


def _two_level(comm: Any, host: Any, nbytes: int, algorithm: str) -> _topo.Topology | None:
    """The topology for a two-level collective on ``host``, or None for the flat one.

    Two levels work on host arrays (their stages reduce with NumPy); device buffers that a
    CUDA-aware MPI takes directly use the flat collective."""
    if not isinstance(host, np.ndarray):
        return None
    return _topo.choose_algorithm(comm, nbytes, algorithm)


# -- allreduce ----------------------------------------------------------------------------
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
    _check_op(op)
    b = _check_array(buf, "allreduce buffer", reduce=True)
    algorithm = _topo.check_algorithm(algorithm)
    n = _size(comm)
    if n == 1:
        return Request([], buf)
    if _debug:
        _maybe_check(comm, f"allreduce[{op}]", b)
    host, back = _dev.stage(b)
    topo = _two_level(comm, host, host.nbytes, algorithm)

    def finish() -> None:
        if op == "avg":
            _dev.scale(host, n)
        if back is not None:
            back(host)

    if topo is not None:
        stages = _topo.allreduce_stages(_flat(host), "sum" if op == "avg" else op, topo)
        return Request([], buf, finish, stages=stages)
    req = comm.Iallreduce(_mpi().IN_PLACE, _flat(host), op=_mpi_op(op))
    return Request([req], buf, finish)


def allreduce(
    buf: Any, op: str = "sum", *, comm: Any = None, algorithm: str | None = None
) -> Any:
    """Allreduce ``buf`` in place over ``comm`` and return it. Collective over ``comm``.

    ``op``: sum, avg (sum then one scaling pass by 1/size), max or min. ``algorithm`` as in
    :func:`iallreduce`.
    """
    _check_op(op)
    b = _check_array(buf, "allreduce buffer", reduce=True)
    algorithm = _topo.check_algorithm(algorithm)
    n = _size(comm)
    if n == 1:
        return buf
    if _two_level(comm, b, b.nbytes, algorithm) is not None:
        return iallreduce(buf, op, comm=comm, algorithm=algorithm).wait()
    if _debug:
        _maybe_check(comm, f"allreduce[{op}]", b)
    host, back = _dev.stage(b)
    comm.Allreduce(_mpi().IN_PLACE, _flat(host), op=_mpi_op(op))
    if op == "avg":
        _dev.scale(host, n)
    if back is not None:
        back(host)
    return buf


# -- reduce_scatter -----------------------------------------------------------------------
def _padded_input(buf: np.ndarray, n: int) -> np.ndarray:
    flat = _flat(buf)
    rem = flat.shape[0] % n
    if rem == 0:
        return flat
    padded = np.zeros(flat.shape[0] + n - rem, dtype=flat.dtype)
    padded[: flat.shape[0]] = flat
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
    _check_op(op, ("sum", "avg"))
    b = _check_array(buf, "reduce_scatter buffer", reduce=True)
    algorithm = _topo.check_algorithm(algorithm)
    n = _size(comm)
    numel = b.size
    s = -(-numel // n)
    if out is not None:
        o = _check_out(out, s, b.dtype, "reduce_scatter", reduce=True)
    if n == 1:
        if out is None:
            return Request([], _flat(b))
        _dev.copy(o, b)
        return Request([], out)
    if _debug:
        _maybe_check(comm, f"reduce_scatter[{op}]", b)
    host_in, _ = _dev.stage(b)
    if _is_device(host_in) and numel % n:  # CUDA-aware MPI, but padding is done on the host
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

    topo = _two_level(comm, result, send.nbytes, algorithm)
    if topo is not None:
        stages = _topo.reduce_scatter_stages(send, _flat(result), "sum", topo)
        return Request([], target, finish, keep=(send, result), stages=stages)
    req = comm.Ireduce_scatter_block(send, _flat(result), op=_mpi_op(op))
    return Request([req], target, finish, keep=(send, result))


def reduce_scatter(
    buf: Any, op: str = "sum", *, comm: Any = None, out: Any = None,
    algorithm: str | None = None,
) -> Any:
    """Reduce ``buf`` over ``comm`` and return this rank's shard (see :func:`ireduce_scatter`).

    Collective over ``comm``.
    """
    _check_op(op, ("sum", "avg"))
    _check_array(buf, "reduce_scatter buffer", reduce=True)
    algorithm = _topo.check_algorithm(algorithm)
    n = _size(comm)
    if n == 1 or _is_device(buf) or (out is not None and _is_device(out)):
        return ireduce_scatter(buf, op, comm=comm, out=out, algorithm=algorithm).wait()
    s = -(-buf.size // n)
    if out is not None:
        _check_out(out, s, buf.dtype, "reduce_scatter", reduce=True)
    if _two_level(comm, buf, s * n * buf.itemsize, algorithm) is not None:
        return ireduce_scatter(buf, op, comm=comm, out=out, algorithm=algorithm).wait()
    if _debug:
        _maybe_check(comm, f"reduce_scatter[{op}]", buf)
    send = _padded_input(buf, n)
    result = np.empty(s, dtype=send.dtype) if out is None else out
    comm.Reduce_scatter_block(send, _flat(result), op=_mpi_op(op))
    if op == "avg":
        _dev.scale(result, n)
    return result


# -- allgather ----------------------------------------------------------------------------
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
    sh = _check_array(shard, "allgather shard")
    algorithm = _topo.check_algorithm(algorithm)
    n = _size(comm)
    s = sh.size
    total = n * s
    if numel is not None and not 0 <= numel <= total:
        raise ValueError(f"numel={numel} is outside [0, {total}] for {n} shards of {s}")
    if out is not None:
        o = _check_out(out, total, sh.dtype, "allgather")

    def trim(a: Any) -> Any:
        return a if numel is None or numel == total else _flat(a)[:numel]

    if n == 1:
        if out is None:
            return Request([], trim(_flat(sh)))
        _dev.copy(o, sh)
        return Request([], trim(out))
    if _debug:
        _maybe_check(comm, "allgather", sh)
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

    topo = _two_level(comm, result, result.nbytes, algorithm)
    if topo is not None:
        stages = _topo.allgather_stages(_wire(host_in), _wire(result), topo)
        return Request([], target, finish, keep=(host_in, result), stages=stages)
    req = comm.Iallgather(_wire(host_in), _wire(result))
    return Request([req], target, finish, keep=(host_in, result))


def allgather(
    shard: Any, *, comm: Any = None, numel: int | None = None, out: Any = None,
    algorithm: str | None = None,
) -> Any:
    """Gather equal-length shards from every rank (see :func:`iallgather`). Collective."""
    algorithm = _topo.check_algorithm(algorithm)
    kw = {"comm": comm, "numel": numel, "out": out, "algorithm": algorithm}
    if _size(comm) == 1 or _is_device(shard) or (out is not None and _is_device(out)):
        return iallgather(shard, **kw).wait()
    _check_array(shard, "allgather shard")
    total = comm.Get_size() * shard.size
    if out is not None:
        _check_out(out, total, shard.dtype, "allgather")
    if numel is not None and not 0 <= numel <= total:
        return iallgather(shard, **kw).wait()  # raises ValueError
    if _two_level(comm, shard, total * shard.itemsize, algorithm) is not None:
        return iallgather(shard, **kw).wait()
    if _debug:
        _maybe_check(comm, "allgather", shard)
    result = np.empty(total, dtype=shard.dtype) if out is None else out
    comm.Allgather(_wire(shard), _wire(result))
    if numel is None or numel == total:
        return result
    return _flat(result)[:numel]


def iallgather_inplace(buf: Any, *, comm: Any = None, algorithm: str | None = None) -> Request:
    """Start an in-place allgather: rank r's segment ``[r*s, (r+1)*s)`` of ``buf`` is its input.

    Collective over ``comm``. ``len(buf)`` must be a multiple of the group size (flat
    buffers are built padded). ``wait()`` returns ``buf`` with every segment filled.
    ``algorithm`` as in :func:`iallreduce`.
    """
    b = _check_array(buf, "allgather buffer")
    algorithm = _topo.check_algorithm(algorithm)
    n = _size(comm)
    numel = b.size
    if numel % n:
        raise ValueError(
            f"in-place allgather needs a length divisible by the group size; "
            f"got {numel} over {n} ranks (pad the buffer to {-(-numel // n) * n})"
        )
    if n == 1:
        return Request([], buf)
    if _debug:
        _maybe_check(comm, "allgather_inplace", b)
    host, back = _dev.stage(b)
    finish = None if back is None else (lambda: back(host))
    topo = _two_level(comm, host, host.nbytes, algorithm)
    if topo is not None:
        flat, s = _flat(host), numel // n
        mine = flat[comm.Get_rank() * s:(comm.Get_rank() + 1) * s]
        stages = _topo.allgather_stages(mine, flat, topo)
        return Request([], buf, finish, keep=(host,), stages=stages)
    req = comm.Iallgather(_mpi().IN_PLACE, _wire(host))
    return Request([req], buf, finish)


def allgather_inplace(buf: Any, *, comm: Any = None, algorithm: str | None = None) -> Any:
    """In-place allgather (see :func:`iallgather_inplace`); returns ``buf``. Collective."""
    algorithm = _topo.check_algorithm(algorithm)
    n = _size(comm)
    if n == 1 or _is_device(buf):
        return iallgather_inplace(buf, comm=comm, algorithm=algorithm).wait()
    _check_array(buf, "allgather buffer")
    if buf.size % n or _two_level(comm, buf, buf.nbytes, algorithm) is not None:
        # (a length that does not divide raises the ValueError there)
        return iallgather_inplace(buf, comm=comm, algorithm=algorithm).wait()
    if _debug:
        _maybe_check(comm, "allgather_inplace", buf)
    comm.Allgather(_mpi().IN_PLACE, _wire(buf))
    return buf


def allgather_varied(buf: Any, counts: Sequence[int], *, comm: Any = None) -> Any:
    """In-place allgather of segments of different lengths: rank r's input is its segment
    of ``counts[r]`` elements of ``buf`` (segments in rank order); returns ``buf`` with
    every segment filled. Collective over ``comm``; every rank passes the same ``counts``.
    Always flat (the two-level stages need equal segments)."""
    b = _check_array(buf, "allgather buffer")
    n = _size(comm)
    if len(counts) != n or sum(counts) != b.size or min(counts, default=0) < 0:
        raise ValueError(f"allgather counts {list(counts)[:8]} do not split {b.size} "
                         f"elements over {n} ranks")
    if n == 1:
        return buf
    if _debug:
        _maybe_check(comm, "allgather_varied", b, f" counts={list(counts)[:8]}")
    host, back = _dev.stage(b)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    comm.Allgatherv(_mpi().IN_PLACE, [_wire(host), (list(counts), displs)])
    if back is not None:
        back(host)
    return buf


# -- broadcast ----------------------------------------------------------------------------
def broadcast(buf: Any, root: int = 0, *, comm: Any = None) -> Any:
    """Broadcast ``buf`` from ``root`` in place and return it. Collective over ``comm``."""
    b = _check_array(buf, "broadcast buffer")
    n = _size(comm)
    if not 0 <= root < n:
        raise ValueError(f"root={root} is outside a group of size {n}")
    if n == 1:
        return buf
    if _debug:
        _maybe_check(comm, f"broadcast[root={root}]", b)
    host, back = _dev.stage(b, read=comm.Get_rank() == root)
    comm.Bcast(_wire(host), root=root)
    if back is not None:
        back(host)
    return buf


# -- point to point -----------------------------------------------------------------------
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
    b = _check_array(buf, "send buffer")
    _check_peer(dest, comm, "dest")
    host, _ = _dev.stage(b)
    return Request([comm.Isend(_wire(host), dest=dest, tag=tag)], buf, keep=(host,))


def send(buf: Any, dest: int, *, comm: Any, tag: int = 0) -> None:
    """Send ``buf`` to rank ``dest`` of ``comm`` (blocking). Point to point."""
    isend(buf, dest, comm=comm, tag=tag).wait()


def irecv(buf: Any, source: int, *, comm: Any, tag: int = 0) -> Request:
    """Start receiving into ``buf`` from rank ``source``; ``wait()`` returns ``buf``."""
    b = _check_array(buf, "receive buffer")
    _check_peer(source, comm, "source")
    host, back = _dev.stage(b, read=False)
    req = comm.Irecv(_wire(host), source=source, tag=tag)
    return Request([req], buf, None if back is None else (lambda: back(host)), keep=(host,))


def recv(buf: Any, source: int, *, comm: Any, tag: int = 0) -> Any:
    """Receive into ``buf`` from rank ``source`` of ``comm`` (blocking); returns ``buf``."""
    return irecv(buf, source, comm=comm, tag=tag).wait()
