"""The one way mpidist talks to MPI: traced communicators, their registry, and hooks.

``comm=None`` means one process without MPI (size 1, rank 0). mpi4py is imported only when
a communicator is actually used, so everything also runs under plain ``python``.

Every communicator mpidist uses is *traced*: an instance of a subclass of mpi4py's own
communicator class (so h5py, mpi4py and user code take it as they take any communicator)
whose communication methods report to hooks, and whose creation methods (``Dup``, ``Split``,
``Split_type``, ``Create_group``, ``Create_cart``, ``Sub``, ``Spawn``, ``Merge``, ``Shrink``)
return traced communicators registered under an identity that matches across their ranks:

- ``"world"`` for ``MPI.COMM_WORLD`` (``"self"`` for ``COMM_SELF``);
- ``"<parent>.<k>"`` for the k-th communicator created from ``<parent>`` (0, 1, ...): every
  member creates it collectively over the parent, in the same order, so k agrees;
- ``"<parent>.g<digest>.<k>"`` for ``Create_group`` (collective over its members only: the
  digest of their ranks in the parent, k counted per member set);
- ``Merge`` agrees on the new identity with one broadcast (the spawned side has another
  history); a communicator mpidist did not create is named by the digest of its members'
  ranks in ``COMM_WORLD`` (``"ext<digest>.<k>"``).

:func:`world` (the documented default of every entry point) and :func:`traced` turn a
user's communicator into a traced one (the same MPI handle; nothing is duplicated).

Hooks (:func:`add_hook`) see every call as a :class:`Call`: ``enter`` before it, ``exit``
after it completed (for nonblocking calls, when the request completed through
:func:`wait_all`, :func:`test_all` or the request's own ``Wait``/``Test``), ``error`` when
MPI raised (a hook may raise another exception in its place: fault tolerance does). The
flight recorder, the timeline and fault tolerance are such hooks. Calls carry the training
step and phase that :func:`set_step` and :func:`phase` set.
"""

from __future__ import annotations

import json
import threading
import weakref
import zlib
from collections.abc import Sequence
from typing import Any

from mpidist.core import calls
from mpidist.core.calls import (
    Call,
    add_hook,
    hooks,
    inside,
    last_progress,
    phase,
    remove_hook,
    set_step,
    step_phase,
    test_all,
    wait,
    wait_all,
)

__all__ = ["Call", "CommInfo", "add_hook", "bcast_json", "comm_id", "hooks", "in_place",
           "info", "inside", "label", "last_progress", "live", "mpi", "phase", "remove_hook",
           "set_step", "size_rank", "step_phase", "test_all", "traced", "wait", "wait_all",
           "world"]


_MPI: list[Any] = []


def mpi() -> Any:
    """The ``mpi4py.MPI`` module (imported on first use)."""
    if not _MPI:
        from mpi4py import MPI

        _MPI.append(MPI)
    return _MPI[0]


def in_place() -> Any:
    """``MPI.IN_PLACE``."""
    return mpi().IN_PLACE


def size_rank(comm: Any) -> tuple[int, int]:
    """``(size, rank)`` of ``comm``; ``(1, 0)`` for None. Not collective."""
    if comm is None:
        return 1, 0
    return comm.Get_size(), comm.Get_rank()


def world(comm: Any = None) -> Any:
    """``comm``, or every rank (``MPI.COMM_WORLD``) when None, traced. Not collective.

    The one place where the user-facing entry points (``ProcessMesh``, the default mesh of
    ``ShardingConfiguration``, ``HybridShardedOptimizer``, ``ElasticOptimizer``,
    ``run_training``, ``mpidist.torch``) resolve their documented default; the code below
    them takes its communicator from them.
    """
    return traced(mpi().COMM_WORLD if comm is None else comm)


def bcast_json(obj: Any, comm: Any, root: int = 0) -> Any:
    """``root``'s JSON-serialisable ``obj`` on every rank (its bytes, no pickle).
    Collective over ``comm``; None or a group of one returns ``obj``."""
    import numpy as np

    size, rank = size_rank(comm)
    if size == 1:
        return obj
    data = json.dumps(obj).encode() if rank == root else b""
    n = np.array([len(data)], dtype=np.int64)
    comm.Bcast(n, root=root)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if rank == root else \
        np.zeros(int(n[0]), dtype=np.uint8)
    comm.Bcast(buf, root=root)
    return json.loads(buf.tobytes().decode())


# -- the registry -------------------------------------------------------------------------------
class CommInfo:
    """What the registry knows of one traced communicator: ``id`` (agreed across its
    ranks), ``label`` (what mpidist uses it for, e.g. "dp"), ``size``, ``rank``,
    ``members`` (their ranks in ``COMM_WORLD``, -1 where they have none, e.g. spawned
    processes; empty for an intercommunicator), and its call counters."""

    __slots__ = ("children", "coll_seq", "groups", "id", "label", "members", "p2p_seq",
                 "rank", "size", "__weakref__")

    def __init__(self, cid: str, label: str, size: int, rank: int, members: list[int]) -> None:
        self.id, self.label, self.size, self.rank, self.members = cid, label, size, rank, members
        self.coll_seq = self.p2p_seq = self.children = 0
        self.groups: dict[str, int] = {}

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable: id, label, size, rank, members, coll_seq, p2p_seq."""
        return {"id": self.id, "label": self.label, "size": self.size, "rank": self.rank,
                "members": self.members, "coll_seq": self.coll_seq, "p2p_seq": self.p2p_seq}


_LIVE: dict[str, Any] = {}  # id -> weakref to the traced communicator
_LOCK = threading.Lock()
_FOREIGN: dict[int, tuple[Any, Any]] = {}  # handle -> (the user's object, traced)
_FOREIGN_COUNT: dict[str, int] = {}


def _world_ranks(comm: Any) -> list[int]:
    MPI = mpi()
    if isinstance(comm, MPI.Intercomm):
        return []
    try:
        group = comm.Get_group()
        wgroup = MPI.COMM_WORLD.Get_group()
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), wgroup)
        group.Free()
        wgroup.Free()
    except Exception:  # noqa: BLE001 - a revoked or odd communicator: members unknown
        return []
    return [-1 if r == MPI.UNDEFINED else int(r) for r in ranks]


def _register(comm: Any, cid: str | None, label: str = "") -> CommInfo:
    MPI = mpi()
    members = _world_ranks(comm)
    if cid is None:
        digest = f"{zlib.crc32(json.dumps(members).encode()):08x}"
        with _LOCK:
            k = _FOREIGN_COUNT.get(digest, 0)
            _FOREIGN_COUNT[digest] = k + 1
        cid = f"ext{digest}.{k}"
    if isinstance(comm, MPI.Intercomm):
        size, rank = comm.Get_size() + comm.Get_remote_size(), comm.Get_rank()
    else:
        size, rank = comm.Get_size(), comm.Get_rank()
    st = CommInfo(cid, label, size, rank, members)
    comm.__dict__["_mpd"] = st
    with _LOCK:
        _LIVE[cid] = weakref.ref(comm)
    return st


def _unregister(comm: Any) -> None:
    st = comm.__dict__.pop("_mpd", None)
    if st is not None:
        with _LOCK:
            ref = _LIVE.get(st.id)
            if ref is not None and ref() in (comm, None):
                del _LIVE[st.id]


def _child_id(parent: Any) -> str:
    st = parent.__dict__.get("_mpd") or _register(parent, None)
    k = st.children
    st.children += 1
    return f"{st.id}.{k}"


def _adopt(raw: Any, cid: str, label: str = "") -> Any:
    """``raw`` (a new communicator, or COMM_NULL) as a traced one registered as ``cid``."""
    MPI = mpi()
    if raw == MPI.COMM_NULL:
        return raw
    cls = _types()[_kind(raw)]
    comm = raw if type(raw) is cls else cls(raw)
    _register(comm, cid, label)
    return comm


def _kind(comm: Any) -> str:
    MPI = mpi()
    if isinstance(comm, MPI.Cartcomm):
        return "cart"
    if isinstance(comm, MPI.Intercomm):
        return "inter"
    return "intra"


def traced(comm: Any) -> Any:
    """``comm`` as a traced communicator (the same MPI handle), registered under its
    identity; None, ``COMM_NULL`` and objects that are not MPI communicators as they are.
    Not collective (a user's communicator is named by its members' ranks, a purely local
    computation)."""
    if comm is None or "_mpd" in getattr(comm, "__dict__", {}):
        return comm
    MPI = mpi()
    if not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        return comm  # (a proxy over a traced communicator, such as a byte counter)
    handle = comm.py2f()
    with _LOCK:
        known = _FOREIGN.get(handle)
    # (the user's object itself is kept: a freed handle may be reused by another object)
    if known is not None and known[0] is comm and "_mpd" in known[1].__dict__:
        return known[1]
    cid = "world" if comm == MPI.COMM_WORLD else "self" if comm == MPI.COMM_SELF else None
    wrapped = _LIVE[cid]() if cid is not None and cid in _LIVE else None
    if wrapped is None:
        wrapped = _types()[_kind(comm)](comm)
        _register(wrapped, cid)
    with _LOCK:
        _FOREIGN[handle] = (comm, wrapped)
    return wrapped


def comm_id(comm: Any) -> str:
    """The identity of a traced communicator ("" for None or an untraced one)."""
    st = getattr(comm, "__dict__", {}).get("_mpd")
    return st.id if st is not None else ""


def info(comm: Any) -> CommInfo | None:
    """The registry's record of a traced communicator (None for None or untraced)."""
    return getattr(comm, "__dict__", {}).get("_mpd")


def label(comm: Any, text: str) -> Any:
    """Label a traced communicator with what mpidist uses it for ("dp", "checkpoint", ...)
    for reports; returns ``comm``. Not collective."""
    st = info(comm)
    if st is not None:
        st.label = text
    return comm


def live() -> list[Any]:
    """Every traced communicator alive now (not freed), in creation order."""
    with _LOCK:
        refs = list(_LIVE.values())
    return [c for c in (r() for r in refs) if c is not None]


# -- the traced types ----------------------------------------------------------------------------
class _Traced:
    """The methods every traced communicator adds to its mpi4py base class."""

    def Dup(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - MPI's names
        cid = _child_id(self)
        return _adopt(self._collective("Dup", args, kwargs), cid)

    def Split(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        cid = _child_id(self)
        return _adopt(self._collective("Split", args, kwargs), cid)

    def Split_type(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        cid = _child_id(self)
        return _adopt(self._collective("Split_type", args, kwargs), cid)

    def Create(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        cid = _child_id(self)
        return _adopt(self._collective("Create", args, kwargs), cid)

    def Create_cart(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        cid = _child_id(self)
        return _adopt(self._collective("Create_cart", args, kwargs), cid)

    def Sub(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        cid = _child_id(self)
        return _adopt(self._collective("Sub", args, kwargs), cid)

    def Shrink(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        cid = _child_id(self)
        return _adopt(self._collective("Shrink", args, kwargs), cid)

    def Spawn(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        cid = _child_id(self)
        return _adopt(self._collective("Spawn", args, kwargs), cid)

    def Create_group(self, group: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        # Collective over the group's members only: named by them, counted per member set.
        MPI = mpi()
        pgroup = self.Get_group()
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), pgroup)
        pgroup.Free()
        digest = f"{zlib.crc32(json.dumps([int(r) for r in ranks]).encode()):08x}"
        st = self.__dict__.get("_mpd") or _register(self, None)
        k = st.groups.get(digest, 0)
        st.groups[digest] = k + 1
        # Not counted among the parent's collective calls: its other ranks do not take part.
        raw = self._collective("Create_group", (group, *args), kwargs, kind="group")
        return _adopt(raw, f"{st.id}.g{digest}.{k}")

    def Merge(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        # The two sides have different histories: rank 0 of the union names it for all.
        import numpy as np

        cid = _child_id(self)
        raw = self._collective("Merge", args, kwargs)
        buf = np.zeros(96, dtype=np.uint8)
        if raw.Get_rank() == 0:
            mine = cid.encode()[:96]
            buf[:len(mine)] = np.frombuffer(mine, dtype=np.uint8)
        raw.Bcast(buf, root=0)
        return _adopt(raw, bytes(buf).rstrip(b"\0").decode())

    def Free(self) -> None:  # noqa: N802
        _unregister(self)
        super().Free()  # type: ignore[misc]

    def Disconnect(self) -> None:  # noqa: N802
        _unregister(self)
        super().Disconnect()  # type: ignore[misc]

    def _collective(self, op: str, args: Sequence[Any], kwargs: dict[str, Any],
                    kind: str = "coll") -> Any:
        return calls.run(_start(self, kind, op, (), -1), getattr(super(), op), args, kwargs)


_TYPES: dict[str, Any] = {}


def _types() -> dict[str, Any]:
    """The traced subclasses of mpi4py's communicator types (made once)."""
    if not _TYPES:
        MPI = mpi()

        class TracedIntracomm(_Traced, MPI.Intracomm):
            """A traced ``MPI.Intracomm`` (see :mod:`mpidist.core.comms`)."""

        class TracedCartcomm(_Traced, MPI.Cartcomm):
            """A traced ``MPI.Cartcomm``."""

        class TracedIntercomm(_Traced, MPI.Intercomm):
            """A traced ``MPI.Intercomm``."""

        _TYPES.update(intra=TracedIntracomm, cart=TracedCartcomm, inter=TracedIntercomm)
    return _TYPES


def _start(comm: Any, kind: str, op: str, args: Sequence[Any], peer: int) -> Call:
    """The record of a call on ``comm`` (numbered among its calls of that kind)."""
    st = comm.__dict__.get("_mpd")
    if st is None:  # a communicator that lost its registration (freed)
        st = _register(comm, None)
    if kind == "coll":
        seq = st.coll_seq
        st.coll_seq += 1
    else:
        seq = st.p2p_seq
        st.p2p_seq += 1
    return calls.begin(st.id, seq, kind, op, args, peer)


def _blocking(op: str, kind: str, peer_arg: str | None = None, peer_pos: int = -1) -> Any:
    """A method that runs the base class's ``op`` between the enter and exit hooks."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start(self, kind, op, args, _peer(args, kwargs, peer_arg, peer_pos))
        return calls.run(call, getattr(super(_Traced, self), op), args, kwargs)

    method.__name__ = op
    return method


def _nonblocking(op: str, kind: str, peer_arg: str | None = None, peer_pos: int = -1) -> Any:
    """A method that posts the base class's ``op`` and returns a traced request."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _start(self, kind, op, args, _peer(args, kwargs, peer_arg, peer_pos))
        try:
            req = getattr(super(_Traced, self), op)(*args, **kwargs)
        except BaseException as exc:
            calls.fail(call, exc)
            raise
        return calls.track(req, call)

    method.__name__ = op
    return method

def _peer(args: Sequence[Any], kwargs: dict[str, Any], name: str | None, pos: int) -> int:
    if name is None:
        return -1
    v = kwargs.get(name, args[pos] if 0 <= pos < len(args) else 0)
    return int(v) if isinstance(v, int) else -1


# (method, kind, name of its peer/root argument, its position): the calls traced.
_BLOCKING = [
    *((m, "coll", None, -1) for m in (
        "Allreduce", "Allgather", "Allgatherv", "Alltoall", "Alltoallv", "Alltoallw",
        "Reduce_scatter", "Reduce_scatter_block", "Scan", "Exscan", "Barrier", "Agree",
        "allreduce", "allgather", "alltoall", "barrier", "scan", "exscan")),
    *((m, "coll", "root", 1) for m in ("Bcast", "Gather", "Gatherv", "Scatter", "Scatterv")),
    ("Reduce", "coll", "root", 3),
    *((m, "coll", "root", 1) for m in ("bcast", "gather", "scatter", "reduce")),
    *((m, "p2p", "dest", 1) for m in ("Send", "Ssend", "Rsend", "send", "ssend")),
    *((m, "p2p", "source", 1) for m in ("Recv", "recv", "Probe", "Mprobe")),
    ("Sendrecv", "p2p", "dest", 1),
    ("sendrecv", "p2p", "dest", 1),
]
_NONBLOCKING = [
    *((m, "coll", None, -1) for m in (
        "Iallreduce", "Iallgather", "Iallgatherv", "Ialltoall", "Ialltoallv", "Ialltoallw",
        "Ireduce_scatter", "Ireduce_scatter_block", "Iscan", "Iexscan", "Ibarrier", "Iagree")),
    *((m, "coll", "root", 1) for m in ("Ibcast", "Igather", "Igatherv", "Iscatter",
                                       "Iscatterv")),
    ("Ireduce", "coll", "root", 3),
    *((m, "p2p", "dest", 1) for m in ("Isend", "Issend", "Irsend")),
    ("Irecv", "p2p", "source", 1),
]


for _m, _k, _p, _i in _BLOCKING:
    setattr(_Traced, _m, _blocking(_m, _k, _p, _i))
for _m, _k, _p, _i in _NONBLOCKING:
    setattr(_Traced, _m, _nonblocking(_m, _k, _p, _i))
