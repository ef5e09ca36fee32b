"""The execution plumbing of the "mpidist" backend's process group: :class:`GroupBase`.

A group's communicators, identity and lifecycle (``shutdown``), and how one operation runs:
the thread that issues it picks the communicator, the debug check and the watchdog wrap
the MPI call (``_on``, ``_Call``), and an asynchronous call can run on the group's
communication thread (``_run``); coalescing and the other backends of a mixed group
(``backend_for``). The operations themselves are in :mod:`mpidist.torch.process_group`
(collectives) and :mod:`mpidist.torch.group_p2p` (barriers, point to point).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mpidist.core import collectives as C
from mpidist.core.comms import mpi
from mpidist.torch import ops
from mpidist.torch._common import overlap
from mpidist.torch.mixed import make_backend, parse_config
from mpidist.torch.ops import Work

__all__ = ["BACKEND", "GroupBase", "live_communicators", "one_tensor"]

BACKEND = "mpidist"
_GROUPS: weakref.WeakSet = weakref.WeakSet()


def live_communicators() -> int:
    """How many MPI communicators the backend's groups hold now (two per live group)."""
    return sum(g.communicators() for g in list(_GROUPS))


def one_tensor(tensors: Sequence[Any], what: str) -> Any:
    """The single tensor (or list) of a torch call's argument list; ValueError naming
    ``what`` when there are several. Not collective."""
    if len(tensors) != 1:
        raise ValueError(f"{what}: the mpidist backend takes one tensor (or one list) per "
                         f"call; got {len(tensors)}")
    return tensors[0]


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


class _Call:
    """One operation's stay in MPI (see :meth:`GroupBase._on`)."""

    __slots__ = ("_extra", "_group", "_guard", "_lock", "_tensors", "_what", "side")

    def __init__(self, group: GroupBase, what: str, tensors: tuple, extra: Any) -> None:
        self._group, self._what, self._tensors, self._extra = group, what, tensors, extra
        self._lock: Any = None
        self._guard: Any = None
        # Which communicator is decided by the thread that issues the call (the group's
        # communication thread runs calls issued by the thread that made the group).
        self.side = threading.get_ident() != group._owner

    def _label(self) -> str:
        g = self._group
        return f"{self._what} on group {g._name or '?'} ({g._n} ranks)"

    def __enter__(self) -> Any:
        g = self._group
        g._check_live(self._what)
        if not self.side:
            comm = g._comm
        else:
            comm, self._lock = g._side, g._side_lock
            self._lock.acquire()
        try:
            if C.debug_enabled():
                shapes = " ".join(_describe(t) for t in self._tensors)
                C.check_signature(comm, f"{self._what} {self._extra} {shapes}")
            self._guard = ops.watch(self._label, g._timeout)
            self._guard.__enter__()
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        return comm

    def __exit__(self, *exc: Any) -> None:
        self._guard.__exit__(*exc)
        if self._lock is not None:
            self._lock.release()


def _execute(call: _Call, body: Callable[[Any], None]) -> None:
    with call as comm:
        body(comm)


class GroupBase(dist.ProcessGroup):
    """What every operation of :class:`mpidist.torch.process_group.ProcessGroupMPI` runs
    on: the group's communicators, identity, lifecycle and the plumbing of one call."""

    def __init__(self, comm: Any, side: Any, base: Any, timeout: timedelta,
                 store: Any = None) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._comm, self._side, self._base = comm, side, base
        self._n, self._r = comm.Get_size(), comm.Get_rank()
        self._owner = threading.get_ident()
        self._side_lock = threading.RLock()
        self._timeout = timeout
        self._store = store
        self._name = ""
        self._desc = ""
        self._coalescing: list[Work] | None = None
        self._config: dict[str, str] | None = None
        self._others: dict[str, Any] = {}
        self._overlap = overlap()
        self._thread: ops.CommThread | None = None
        _GROUPS.add(self)

    # -- identity ------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's C++ name
        return BACKEND

    name = _get_backend_name = getBackendName

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def comm(self) -> Any:
        """The group's MPI communicator (the backend's own duplicate; use it only for
        reading its size and ranks, or for MPI calls no torch operation overlaps)."""
        return self._comm

    @property
    def base(self) -> Any:
        """The communicator this group's ranks are numbered in (the world it was made in)."""
        return self._base

    def communicators(self) -> int:
        """How many MPI communicators this group still holds."""
        return int(self._comm is not None) + int(self._side is not None)

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the group's timeout (see the module docstring)."""
        self._timeout = timeout

    def shutdown(self) -> None:
        """Free the group's communicators (torch calls it in ``destroy_process_group``)."""
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        finalized = mpi().Is_finalized()
        for attr in ("_side", "_comm"):
            comm = getattr(self, attr)
            if comm is not None and comm != mpi().COMM_NULL and not finalized:
                comm.Free()
            setattr(self, attr, None)
        for other in self._others.values():
            with contextlib.suppress(Exception):
                other.shutdown()
        self._others.clear()

    def abort(self) -> None:
        """Same as :meth:`shutdown` (MPI operations cannot be cancelled)."""
        self.shutdown()

    # -- plumbing ------------------------------------------------------------------------
    def _on(self, what: str, *tensors: torch.Tensor, extra: Any = "") -> _Call:
        """``with self._on(...) as comm``: the communicator to use from this thread, after
        the debug check (``what``, ``extra``, the tensors' dtypes and shapes), under the
        watchdog."""
        return _Call(self, what, tensors, extra)

    def _check_live(self, what: str) -> None:
        if self._comm is None:
            raise RuntimeError(f"{what}: process group {self._name!r} was destroyed")

    def _work(self, work: Work) -> Work:
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _done(self, result: list[torch.Tensor]) -> Work:
        return self._work(Work(result))

    def _run(self, call: _Call, body: Callable[[Any], None], result: list[torch.Tensor],
             opts: Any) -> Work:
        """Run an operation's MPI call and what follows it (``body(comm)``): now, on this
        thread; or, for an asynchronous call (``opts.asyncOp``) with overlap on, on the
        group's communication thread, in the order the calls were issued."""
        if not call.side and self._overlap and getattr(opts, "asyncOp", False):
            if self._thread is None:
                self._thread = ops.CommThread(f"mpidist-comm-{self._name or '?'}")
            work = Work(result, pending=True, what=call._what, timeout=self._timeout)
            self._thread.submit(lambda: _execute(call, body), work)
            return self._work(work)
        if not call.side:
            self._drain()
        _execute(call, body)
        return self._done(result)

    def _drain(self) -> None:
        """Wait until the communication thread has run every call issued before."""
        if self._thread is not None:
            self._thread.drain()

    def backend_for(self, device: str) -> Any:
        """The torch backend that runs this group's operations on ``device`` tensors when
        the group was made with a mixed backend string (``"cpu:mpidist,cuda:nccl"``),
        created on first use (collective over the group); None where mpidist runs them."""
        if self._config is None:
            try:
                self._config = parse_config(dist.get_backend_config(self))
            except Exception:  # not registered with torch (yet): ours alone
                return None
        name = self._config.get(device, BACKEND)
        if name == BACKEND:
            return None
        if device not in self._others:
            self._others[device] = make_backend(name, device, self._store, self._r, self._n,
                                                self._timeout, self._name)
        return self._others[device]

    def _start_coalescing(self, device: Any = None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: Any = None) -> Work:
        works, self._coalescing = self._coalescing or [], None
        result = [t for w in works for t in w.outputs]
        return ops.CoalescedWork(works, result)
