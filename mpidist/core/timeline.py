"""The timeline: what this rank did, call by call and block by block, in a window of steps;
and the clock of time spent blocked in MPI that per-rank time tables are made from.

Recording (:class:`Recorder`) is a hook of :mod:`mpidist.core.calls` installed only for the
trace window (``mpidist train --trace``): outside it nothing is installed and nothing is
recorded. Inside it the recorder keeps

- every MPI call (its ``enter`` is the list's own ``append``: the :class:`~mpidist.core.calls.Call`
  objects themselves, their exit time filled in place, as the flight recorder keeps them);
- every wait for a nonblocking call's request (``wait``) and every :func:`~mpidist.core.calls.phase`
  (``span``);
- the blocks the code marks with :func:`span` (forward and backward of a unit, a pipeline
  operation, the optimizer update, data loading), which cost one function call and a
  comparison when no recorder is active.

:meth:`Recorder.chrome` turns them into Chrome trace events ("X" complete events, times in
microseconds on rank 0's clock, see :func:`align`): blocking calls, waits and blocks on the
track of the thread that ran them (properly nested: each is a block of code), nonblocking
calls from their start to their completion on tracks of their own ("MPI in flight": they
overlap the computation and each other, so they are dealt onto as many tracks as are needed
for none to overlap on one).

:class:`PhaseClock` is the cheap always-on hook of ``mpidist train``'s per-rank times:
seconds the main thread was blocked in MPI (blocking calls, and waits for requests) and wall
seconds spent in each phase.

``MPIDIST_TEST_CLOCK_OFFSET="R:SECONDS[,R:SECONDS...]"`` makes world rank R's timeline
clock read SECONDS more than its ``time.monotonic()`` (a host whose clock differs), for the
tests of :func:`align`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidist.core import calls, comms

__all__ = ["Alignment", "PhaseClock", "Recorder", "active", "align", "assign_lanes",
           "clock_skew", "record", "span", "unit_span"]

_ACTIVE: list[Recorder | None] = [None]
_NULL = contextlib.nullcontext()
_TAG = 7301  # point-to-point tag of the clock alignment's messages
#: bytes per element of the MPI datatypes calls name (others: the array's dtype)
_MPI_SIZES = {"MPI_DOUBLE": 8, "MPI_FLOAT": 4, "MPI_INT": 4, "MPI_LONG": 8, "MPI_BYTE": 1,
              "MPI_CHAR": 1, "MPI_INT64_T": 8, "MPI_INT32_T": 4, "MPI_UINT8_T": 1, "byte": 1}


class _Span:
    __slots__ = ("args", "cat", "name", "rec", "t0")

    def __init__(self, rec: Recorder, name: str, cat: str, args: dict[str, Any]) -> None:
        self.rec, self.name, self.cat, self.args = rec, name, cat, args
        self.t0 = 0.0

    def __enter__(self) -> _Span:
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.rec.blocks.append((self.name, self.cat, self.t0, time.monotonic(),
                                threading.get_ident(), self.args))


def span(name: str, cat: str = "compute", **args: Any) -> contextlib.AbstractContextManager:
    """A block of code as a slice of the trace (``name``, category ``cat``, ``args`` shown
    with it) while a recorder is active; else a no-op context (nothing recorded). Not
    collective."""
    rec = _ACTIVE[0]
    if rec is None:
        return _NULL
    return _Span(rec, name, cat, args)


def unit_span(kind: str, unit: int, **args: Any) -> contextlib.AbstractContextManager:
    """:func:`span` ``"<kind> unit <unit>"`` of category ``unit``, its name formatted only
    while a recorder is active (the layers' passes call it per unit and micro-batch). Not
    collective."""
    rec = _ACTIVE[0]
    if rec is None:
        return _NULL
    return _Span(rec, f"{kind} unit {unit}", "unit", args)


def record(name: str, cat: str, t0: float, t1: float, **args: Any) -> None:
    """Record a block that ran from ``t0`` to ``t1`` (``time.monotonic()``) on this thread,
    when a recorder is active. Not collective."""
    rec = _ACTIVE[0]
    if rec is not None:
        rec.blocks.append((name, cat, t0, t1, threading.get_ident(), args))


def active() -> Recorder | None:
    """The recorder recording now (None: none). Not collective."""
    return _ACTIVE[0]


# -- the clock ---------------------------------------------------------------------------------
def clock_skew(world_rank: int, spec: str | None = None) -> float:
    """Seconds ``MPIDIST_TEST_CLOCK_OFFSET`` (or ``spec``) adds to world rank
    ``world_rank``'s timeline clock (0.0 when it names another rank or is unset).
    ValueError naming the text when it is malformed."""
    text = (os.environ.get("MPIDIST_TEST_CLOCK_OFFSET", "") if spec is None else spec).strip()
    if not text:
        return 0.0
    out = 0.0
    for part in text.split(","):
        rank, colon, seconds = part.partition(":")
        try:
            r, s = int(rank), float(seconds)
        except ValueError:
            r, s = -1, float("nan")
        if not colon or r < 0 or s != s:
            raise ValueError(f"MPIDIST_TEST_CLOCK_OFFSET={text!r}: expected RANK:SECONDS[,...]")
        if r == world_rank:
            out = s
    return out


@dataclass(frozen=True)
class Alignment:
    """How this rank's timeline clock maps onto rank 0's: ``reference(t) = t + skew +
    offset`` for a ``time.monotonic()`` reading ``t``. ``offset`` was measured with the
    round trip ``rtt`` that was shortest of :func:`align`'s rounds; it is exact within
    ``rtt / 2`` (rank 0's reading of its own clock before and after the round bracket this
    rank's reading). ``base``: rank 0's clock when the alignment ended (the trace's zero)."""

    offset: float = 0.0
    rtt: float = 0.0
    skew: float = 0.0
    base: float = 0.0

    @property
    def bound(self) -> float:
        """Seconds within which ``offset`` is exact (``rtt / 2``)."""
        return self.rtt / 2

    def micros(self, t: float) -> float:
        """``t`` (``time.monotonic()`` seconds) as microseconds after ``base`` on rank 0's
        clock, rounded to nanoseconds."""
        return round((t + self.skew + self.offset - self.base) * 1e6, 3)


def align(comm: Any, *, rounds: int = 10, world_rank: int | None = None) -> Alignment:
    """Measure this rank's clock against rank 0's: rank 0 sends each rank in turn ``rounds``
    pings, the rank answers with its clock's reading, and the round with the shortest round
    trip gives the offset (NTP's estimate: rank 0's midpoint minus the reading). Collective
    over ``comm`` (None or one rank: offset 0). Ranks waiting for their turn sleep between
    tests rather than spin, so that the measured ranks have the cores. ``world_rank``
    (default: this process's) picks the ``MPIDIST_TEST_CLOCK_OFFSET`` entry that applies."""
    if world_rank is None:
        world_rank = 0 if comm is None else comms.mpi().COMM_WORLD.Get_rank()
    skew = clock_skew(world_rank)
    size, rank = comms.size_rank(comm)
    if size == 1:
        return Alignment(skew=skew, base=time.monotonic() + skew)
    buf = np.zeros(3)
    if rank == 0:
        results = [_measure(comm, r, rounds, skew) for r in range(1, size)]
        base = time.monotonic() + skew
        for r, (offset, rtt) in enumerate(results, start=1):
            buf[:] = (offset, rtt, base)
            comm.Send(buf, dest=r, tag=_TAG)
        return Alignment(0.0, 0.0, skew, base)
    first = comm.Irecv(buf[:1], source=0, tag=_TAG)
    while not calls.test_all([first]):
        time.sleep(0.0005)
    for k in range(rounds):
        if k:
            comm.Recv(buf[:1], source=0, tag=_TAG)
        buf[0] = time.monotonic() + skew
        comm.Send(buf[:1], dest=0, tag=_TAG)
    comm.Recv(buf, source=0, tag=_TAG)
    return Alignment(float(buf[0]), float(buf[1]), skew, float(buf[2]))


def _measure(comm: Any, peer: int, rounds: int, skew: float) -> tuple[float, float]:
    """Rank 0's side of :func:`align` with ``peer``: (offset, round trip) of the best round."""
    ping, pong = np.zeros(1), np.zeros(1)
    best = (0.0, float("inf"))
    for _ in range(rounds):
        t0 = time.monotonic() + skew
        comm.Send(ping, dest=peer, tag=_TAG)
        comm.Recv(pong, source=peer, tag=_TAG)
        t3 = time.monotonic() + skew
        if t3 - t0 < best[1]:
            best = ((t0 + t3) / 2 - float(pong[0]), t3 - t0)
    return best


# -- recording -----------------------------------------------------------------------------------
class Recorder:
    """The trace window's hook (see the module docstring): :meth:`start`, the steps,
    :meth:`stop`, then :meth:`chrome`. Not collective."""

    def __init__(self) -> None:
        self.calls: list[calls.Call] = []
        self.enter = self.calls.append  # (a C-level append per call: no Python frame)
        self.blocks: list[tuple[str, str, float, float, int, Any]] = []
        self.waits: list[tuple[calls.Call, float, float, int]] = []
        self.t_start = self.t_stop = 0.0

    def wait(self, call: calls.Call, t0: float, t1: float) -> None:
        self.waits.append((call, t0, t1, threading.get_ident()))

    def span(self, name: str, t0: float, t1: float) -> None:
        self.blocks.append((name, "phase", t0, t1, threading.get_ident(), None))

    def start(self) -> None:
        """Record from now on (this process's only active recorder)."""
        if _ACTIVE[0] is not None:
            _ACTIVE[0].stop()
        self.t_start = time.monotonic()
        _ACTIVE[0] = self
        calls.add_hook(self)

    def stop(self) -> None:
        """Record no more: the hook is removed."""
        calls.remove_hook(self)
        if _ACTIVE[0] is self:
            _ACTIVE[0] = None
        self.t_stop = time.monotonic()

    def count(self) -> int:
        """Events recorded so far."""
        return len(self.calls) + len(self.blocks) + len(self.waits)

    def chrome(self, *, rank: int, pid: int, alignment: Alignment,
               labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """This rank's events in the Chrome trace event format: "X" events on threads
        ``rank * 1000 + lane`` of process ``pid`` (lane 0 the main thread, then the other
        threads that ran recorded code, 500 + k the k-th track of nonblocking calls), and
        "M" events naming those threads. Times on rank 0's clock (``alignment``)."""
        labels = labels or {}
        us = alignment.micros
        lanes: dict[int, int] = {threading.main_thread().ident or 0: 0}
        names = {t.ident: t.name for t in threading.enumerate()}

        def tid(thread: int) -> int:
            if thread not in lanes:
                lanes[thread] = len(lanes)
            return rank * 1000 + lanes[thread]

        out: list[dict[str, Any]] = []

        def add(name: str, cat: str, t0: float, t1: float, thread_tid: int,
                args: dict[str, Any] | None) -> None:
            ts = us(t0)
            ev = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": round(us(t1) - ts, 3),
                  "pid": pid, "tid": thread_tid}
            if args:
                ev["args"] = args
            out.append(ev)

        for name, cat, t0, t1, thread, args in self.blocks:
            add(name, cat, t0, t1, tid(thread), args)
        for call, t0, t1, thread in self.waits:
            add(f"wait {call.op}", "mpi-wait", t0, t1, tid(thread),
                {"comm": call.comm, "label": labels.get(call.comm, ""), "seq": call.seq})
        in_flight = []
        for c in self.calls:
            end = c.t_exit if c.t_exit is not None else self.t_stop
            if c.op[0] == "I":
                in_flight.append((c, end))
            else:
                add(c.op, "mpi", c.t_enter, end, tid(c.thread), _call_args(c, labels))
        lane_of = assign_lanes([(c.t_enter, end) for c, end in in_flight])
        for (c, end), lane in zip(in_flight, lane_of, strict=True):
            add(c.op, "mpi-async", c.t_enter, end, rank * 1000 + 500 + lane,
                _call_args(c, labels))
        meta = [(rank * 1000 + lane, f"rank {rank}" if lane == 0 else
                 f"rank {rank} thread {names.get(thread, thread)}")
                for thread, lane in lanes.items()]
        meta += [(rank * 1000 + 500 + k, f"rank {rank} MPI in flight {k + 1}")
                 for k in range(max(lane_of, default=-1) + 1)]
        for t, name in meta:
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": t,
                        "args": {"name": name}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": t,
                        "args": {"sort_index": t}})
        return out


def _call_args(c: calls.Call, labels: dict[str, str]) -> dict[str, Any]:
    size = getattr(c.dtype, "itemsize", None)
    if size is None:
        size = _MPI_SIZES.get(str(c.dtype))
    args = {"comm": c.comm, "label": labels.get(c.comm, ""), "seq": c.seq,
            "count": c.count, "dtype": str(c.dtype),
            "bytes": c.count * size if size is not None and c.count >= 0 else None,
            "step": c.step, "phase": c.phase}
    if c.peer >= 0:
        args["peer" if c.kind == "p2p" else "root"] = c.peer
    if c.t_exit is None:
        args["completed"] = False
    if c.error:
        args["error"] = c.error
    return args


def assign_lanes(intervals: Sequence[tuple[float, float]]) -> list[int]:
    """The track of each ``(start, end)`` interval, given in order of start: the lowest
    track whose last interval ended by then, so that no two on one track overlap. Pure."""
    ends: list[float] = []
    out = []
    for t0, t1 in intervals:
        for k, e in enumerate(ends):
            if e <= t0:
                ends[k] = t1
                out.append(k)
                break
        else:
            ends.append(t1)
            out.append(len(ends) - 1)
    return out


# -- the per-rank clock ------------------------------------------------------------------------
class PhaseClock:
    """The hook behind per-rank times: seconds the main thread spent blocked in MPI
    (blocking calls, and waits for nonblocking ones), by the phase it was in, and wall
    seconds per phase (:attr:`blocked`, :attr:`wall`; they only grow). Not collective."""

    def __init__(self) -> None:
        self.main = threading.main_thread().ident
        self.blocked: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    def exit(self, call: calls.Call) -> None:
        if call.thread == self.main and call.op[0] != "I" and call.t_exit is not None:
            self.blocked[call.phase] = self.blocked.get(call.phase, 0.0) \
                + call.t_exit - call.t_enter

    def wait(self, call: calls.Call, t0: float, t1: float) -> None:
        if threading.get_ident() == self.main:
            name = calls.step_phase()[1]
            self.blocked[name] = self.blocked.get(name, 0.0) + t1 - t0

    def span(self, name: str, t0: float, t1: float) -> None:
        if threading.get_ident() == self.main:
            self.wall[name] = self.wall.get(name, 0.0) + t1 - t0
