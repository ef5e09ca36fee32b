"""Calls to MPI as hooks see them: the call record, the hooks, the step and phase.

:mod:`mpidist.core.comms` makes every communicator mpidist uses report its calls here:
:func:`begin` before a call, :func:`end` when it completed, :func:`fail` when MPI raised.
A nonblocking call completes when its request does, through :func:`wait_all`,
:func:`test_all` or the request's own ``Wait``/``Test``. Hooks (:func:`add_hook`) are the
flight recorder, the timeline and fault tolerance.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["Call", "add_context_hook", "add_hook", "begin", "blocked_in", "end", "fail", "hooks",
           "inside", "last_progress", "pending", "phase", "remove_context_hook", "remove_hook",
           "run", "set_step", "step_phase", "test_all", "track", "wait", "wait_all"]


class Call:
    """One MPI call as the hooks see it.

    ``comm``: the communicator's identity; ``kind``: "coll" (a collective operation or a
    communicator's creation), "p2p", or "group" (``Create_group``, which only the new
    group's members call); ``seq``: its number among the calls of its kind on that
    communicator ("group" calls are numbered with the point-to-point ones); ``op``: the
    mpi4py method name; ``count``/``dtype``: the first buffer's elements and type (the
    array's dtype object, an MPI datatype's name, "object" for pickled objects, "" when
    none: ``str()`` it for reports); ``peer``: the other rank of a point-to-point call,
    or the root, else -1; ``t_enter``/``t_exit``: ``time.monotonic()`` seconds (``t_exit``
    None until it completed); ``step``/``phase``: the training step and phase when it was
    issued; ``error``: the MPI error class when it failed, else 0; ``thread``: the issuing
    thread's id.
    """

    __slots__ = ("comm", "count", "dtype", "error", "kind", "op", "peer", "phase", "seq",
                 "step", "t_enter", "t_exit", "thread")

    def __init__(self, comm: str, seq: int, kind: str, op: str, count: int, dtype: Any,
                 peer: int) -> None:
        self.comm, self.seq, self.kind, self.op = comm, seq, kind, op
        self.count, self.dtype, self.peer = count, dtype, peer
        self.step, self.phase = _CTX[0], _CTX[1]
        self.t_enter = time.monotonic()
        self.t_exit: float | None = None
        self.error = 0
        self.thread = threading.get_ident()

    def as_dict(self) -> dict[str, Any]:
        """The call as a JSON-serialisable dict."""
        out = {k: getattr(self, k) for k in self.__slots__}
        out["dtype"] = str(self.dtype)
        return out

    def __repr__(self) -> str:
        return (f"Call({self.op} on {self.comm} #{self.seq} {self.kind}, {self.count} "
                f"{self.dtype}, step {self.step} {self.phase})")


_ENTER: list[Callable[[Call], None]] = []
_EXIT: list[Callable[[Call], None]] = []
_ERROR: list[Callable[[Call, BaseException], None]] = []
_WAIT: list[Callable[[Call, float, float], None]] = []
_SPAN: list[Callable[[str, float, float], None]] = []
_HOOKS: list[Any] = []


def add_hook(hook: Any) -> None:
    """Call ``hook.enter(call)``, ``hook.exit(call)`` and ``hook.error(call, exc)`` (each
    optional) for every MPI call from now on, after the hooks added before. Not
    collective. ``error`` may raise: its exception replaces MPI's.

    Two more optional methods see time rather than calls (the timeline's): ``wait(call,
    t0, t1)`` after this thread was blocked from ``t0`` to ``t1`` waiting for the request
    of the nonblocking ``call`` (the first pending one of a ``wait_all``), and ``span(name,
    t0, t1)`` when a :func:`phase` ends (``time.monotonic()`` seconds)."""
    if hook in _HOOKS:
        return
    _HOOKS.append(hook)
    _rebuild_hooks()


def remove_hook(hook: Any) -> None:
    """Stop calling ``hook``. Not collective."""
    if hook in _HOOKS:
        _HOOKS.remove(hook)
        _rebuild_hooks()


def hooks() -> list[Any]:
    """The hooks, in the order they are called."""
    return list(_HOOKS)


def _rebuild_hooks() -> None:
    for lst, attr in ((_ENTER, "enter"), (_EXIT, "exit"), (_ERROR, "error"), (_WAIT, "wait"),
                      (_SPAN, "span")):
        lst[:] = [getattr(h, attr) for h in _HOOKS if getattr(h, attr, None) is not None]


# The step and phase every new Call records ([step, phase]).
_CTX: list[Any] = [-1, ""]
# Per thread: the call it is blocked in now (a blocking call, or a wait for a request).
_INSIDE: dict[int, Call] = {}
_PROGRESS = [time.monotonic()]
# Called with no arguments after each set_step and on entering each phase (the flight
# recorder's test hold); empty in ordinary runs.
_CONTEXT: list[Callable[[], None]] = []


def add_context_hook(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after every :func:`set_step` and on entering every :func:`phase` (it
    reads them with :func:`step_phase`). Not collective."""
    if fn not in _CONTEXT:
        _CONTEXT.append(fn)


def remove_context_hook(fn: Callable[[], None]) -> None:
    """Stop calling ``fn``. Not collective."""
    if fn in _CONTEXT:
        _CONTEXT.remove(fn)


def set_step(step: int) -> None:
    """The training step that calls from now on record. Not collective."""
    _CTX[0] = int(step)
    _PROGRESS[0] = time.monotonic()
    for f in _CONTEXT:
        f()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Calls inside the block record the phase ``name`` (forward, backward, optimizer,
    checkpoint, ...); the previous phase afterwards. The hooks' ``span`` sees the block
    when it ends (a phase entered inside the same phase is not a span of its own). Not
    collective."""
    previous, _CTX[1] = _CTX[1], name
    t0 = time.monotonic() if _SPAN and previous != name else 0.0
    try:
        for f in _CONTEXT:
            f()
        yield
    finally:
        _CTX[1] = previous
        if t0 and _SPAN:
            t1 = time.monotonic()
            for g in _SPAN:
                g(name, t0, t1)


def step_phase() -> tuple[int, str]:
    """The step and phase calls record now."""
    return _CTX[0], _CTX[1]


def inside() -> dict[int, Call]:
    """Per thread id, the MPI call that thread is blocked in now (a copy)."""
    return dict(_INSIDE)


def last_progress() -> float:
    """``time.monotonic()`` of the last completed MPI call or step change."""
    return _PROGRESS[0]


def _describe(args: Sequence[Any]) -> tuple[int, Any]:
    """Elements and type of the first buffer among ``args`` (an array, or a buffer spec
    ``[array, ...]``/``[array, MPI datatype]``), for the call record."""
    for a in args[:2]:
        if isinstance(a, (list, tuple)) and a:
            dt = a[-1] if len(a) > 1 and hasattr(a[-1], "Get_name") else None
            a = a[0]
            if dt is not None:
                n = getattr(a, "nbytes", None)
                size = dt.Get_size() or 1
                return (int(n) // size if n is not None else -1), dt.Get_name()
        dtype = getattr(a, "dtype", None)
        if dtype is not None:  # (made a string only when reported: str() costs microseconds)
            return int(getattr(a, "size", -1)), dtype
        if isinstance(a, (bytes, bytearray, memoryview)):
            return len(a), "byte"
    return 0, ""


def begin(comm: str, seq: int, kind: str, op: str, args: Sequence[Any], peer: int) -> Call:
    """A new call record, after the ``enter`` hooks saw it. Not collective."""
    if op[0].islower():  # mpi4py's pickled-object calls
        count, dtype = 1, "object"
    else:
        count, dtype = _describe(args) if args else (0, "")
    call = Call(comm, seq, kind, op, count, dtype, peer)
    for f in _ENTER:
        f(call)
    return call


def end(call: Call) -> None:
    """``call`` completed: the ``exit`` hooks see it. Not collective."""
    call.t_exit = _PROGRESS[0] = time.monotonic()
    for f in _EXIT:
        f(call)


def fail(call: Call, exc: BaseException) -> None:
    """MPI raised ``exc`` in ``call``: the ``error`` hooks see it (one may raise another
    exception instead). Not collective."""
    get = getattr(exc, "Get_error_class", None)
    call.error = get() if get is not None else -1
    call.t_exit = time.monotonic()
    for f in _ERROR:
        f(call, exc)


@contextlib.contextmanager
def blocked_in(call: Call | None) -> Iterator[None]:
    """This thread is blocked in ``call`` (for :func:`inside`) while the block runs; the
    hooks' ``wait`` sees how long."""
    if call is None:
        yield
        return
    tid = threading.get_ident()
    _INSIDE[tid] = call
    t0 = time.monotonic() if _WAIT else 0.0
    try:
        yield
    finally:
        _INSIDE.pop(tid, None)
        if t0 and _WAIT:
            t1 = time.monotonic()
            for f in _WAIT:
                f(call, t0, t1)


def run(call: Call, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` as the blocking MPI call ``call``: :func:`end` after it,
    :func:`fail` if it raises. Not collective (``fn`` may be)."""
    tid = call.thread
    _INSIDE[tid] = call
    try:
        out = fn(*args, **kwargs)
    except BaseException as exc:
        fail(call, exc)
        raise
    finally:
        _INSIDE.pop(tid, None)
    end(call)
    return out


# -- requests -----------------------------------------------------------------------------------
_REQUEST: list[Any] = []


def _request_type() -> Any:
    """A subclass of ``MPI.Request`` whose completion reaches the ``exit`` hooks."""
    if not _REQUEST:
        from mpi4py import MPI

        class TracedRequest(MPI.Request):
            """A request of a traced call (see :mod:`mpidist.core.calls`)."""

            def Wait(self, status: Any = None) -> bool:  # noqa: N802 - MPI's names
                call = self.__dict__.get("_mpd_call")
                try:
                    with blocked_in(call):
                        super().Wait(status)
                except BaseException as exc:
                    _failed([self], exc)
                    raise
                _finish([self])
                return True

            def Test(self, status: Any = None) -> bool:  # noqa: N802
                try:
                    done = super().Test(status)
                except BaseException as exc:
                    _failed([self], exc)
                    raise
                if done:
                    _finish([self])
                return bool(done)

        _REQUEST.append(TracedRequest)
    return _REQUEST[0]


def track(req: Any, call: Call) -> Any:
    """``req`` (a request ``call`` returned) as a request whose completion ends ``call``."""
    r = _request_type()(req)
    r.__dict__["_mpd_call"] = call
    r.__dict__["_mpd_orig"] = req  # keeps what mpi4py holds for MPI (the buffers) alive
    return r


def _finish(reqs: Sequence[Any]) -> None:
    for r in reqs:
        call = getattr(r, "__dict__", {}).pop("_mpd_call", None)
        if call is not None:
            end(call)


def pending(reqs: Sequence[Any]) -> Call | None:
    """The first call among traced requests ``reqs`` that has not completed (None: none)."""
    for r in reqs:
        call = getattr(r, "__dict__", {}).get("_mpd_call")
        if call is not None:
            return call
    return None


def _failed(reqs: Sequence[Any], exc: BaseException) -> None:
    call = pending(reqs)
    if call is not None:
        for r in reqs:
            getattr(r, "__dict__", {}).pop("_mpd_call", None)
        fail(call, exc)


def wait(req: Any) -> None:
    """Complete one request (traced or not). Not collective."""
    wait_all([req])


def wait_all(reqs: Sequence[Any], statuses: Any = None) -> None:
    """``MPI.Request.Waitall(reqs)``, reporting each traced request's completion to the
    hooks (and the wait itself as the call this thread is blocked in). Not collective."""
    if not reqs:
        return
    from mpi4py import MPI

    try:
        with blocked_in(pending(reqs)):
            if statuses is None:
                MPI.Request.Waitall(list(reqs))
            else:
                MPI.Request.Waitall(list(reqs), statuses)
    except BaseException as exc:
        _failed(reqs, exc)
        raise
    _finish(reqs)


def test_all(reqs: Sequence[Any], statuses: Any = None) -> bool:
    """``MPI.Request.Testall(reqs)``, reporting completions to the hooks. Not collective."""
    if not reqs:
        return True
    from mpi4py import MPI

    try:
        if statuses is None:
            done = MPI.Request.Testall(list(reqs))
        else:
            done = MPI.Request.Testall(list(reqs), statuses)
    except BaseException as exc:
        _failed(reqs, exc)
        raise
    if done:
        _finish(reqs)
    return bool(done)
