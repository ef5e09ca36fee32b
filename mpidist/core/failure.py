"""A lost rank, as the communication core sees it: detect, revoke everything, shrink, agree.

Under MPI's fault tolerance (ULFM, :mod:`mpidist.core.ft`), an MPI call that involves a dead
process fails with ``MPI_ERR_PROC_FAILED`` (or ``..._PENDING``), and a call on a communicator
that another rank revoked fails with ``MPI_ERR_REVOKED``. ULFM tells only the members of the
communicator where it happened: a rank blocked on another communicator would wait forever.
So the hook :func:`enable` installs (an ``error`` hook of :mod:`mpidist.core.calls`) revokes
*every* live traced communicator (:func:`mpidist.core.comms.live`) as soon as this rank sees
such an error, and raises one exception, :class:`ProcessFailure`, in MPI's place: every
survivor then gets a :class:`ProcessFailure` from its next MPI call, whatever it was doing.

What to do next is the caller's business (:mod:`mpidist.parallel.recovery` for the training
step): :func:`shrink` builds the survivors' communicator from a failed one (``Shrink``) and
gives every survivor the same table of what each survivor reports (an ``Allgather``), from
which they agree on the dead ranks and on where to go on; :func:`commit` is ULFM's uniform
agreement (``Agree``) that closes a recovery. A failure during either raises
:class:`ProcessFailure` again, and the caller starts over from the newest communicator.

A process that outlived a failure must not end with ``MPI_Finalize`` (Open MPI 5.0 may wait
forever in it, open-mpi/ompi#11404): :func:`leave` ends it after a barrier of the survivors,
with ``os._exit``; :func:`leave_if_survived` does that only where a failure was survived.

For tests and benchmarks, ``MPIDIST_FT_KILL="rank=R,step=S[,phase=P][,call=N][;...]"``
makes world rank R SIGKILL itself inside its N-th MPI call (default 1; 0: on entering the
phase, before any call) of phase P (:func:`mpidist.core.comms.phase`; default: any) of
training step S (:func:`mpidist.core.comms.set_step`): :func:`install_kill_points`. Several
kill points are separated by ``;``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpidist.core import calls
from mpidist.core.comms import comm_id, live, mpi
from mpidist.core.specs import key_values

__all__ = ["KILL_ENV", "KillPoint", "ProcessFailure", "Shrunk", "UnrecoverableFailure",
           "abort", "abort_leaves_the_job", "commit", "enable", "enabled", "exit_barrier",
           "failure_behind", "failure_classes", "install_kill_points", "is_failure",
           "job_comm", "keep_alive", "leave", "leave_if_survived", "on_shrink",
           "parse_kill_points", "revoke_all", "shrink", "survived"]

log = logging.getLogger("mpidist.failure")

#: the environment variable naming the ranks that kill themselves (tests, benchmarks)
KILL_ENV = "MPIDIST_FT_KILL"


class ProcessFailure(RuntimeError):
    """A rank of the job died (or another rank saw one die and revoked the communicators).

    Raised in MPI's place by every MPI call mpidist makes once :func:`enable` installed the
    hook. ``comm``, ``op``, ``step`` and ``phase`` say where this rank learned of it;
    ``error_class`` is MPI's (``ERR_PROC_FAILED``, ``ERR_PROC_FAILED_PENDING`` or
    ``ERR_REVOKED``); ``detected`` the wall time (``time.time()``) it was first seen.
    """

    def __init__(self, message: str, *, comm: str = "", op: str = "", step: int = -1,
                 phase: str = "", error_class: int = 0, detected: float = 0.0) -> None:
        super().__init__(message)
        self.comm, self.op, self.step, self.phase = comm, op, step, phase
        self.error_class = error_class
        self.detected = detected or time.time()


class UnrecoverableFailure(RuntimeError):
    """A failure the survivors cannot recover from in the job (a rank and the holder of its
    copy dead together, no copies kept, a strategy without in-job recovery, a failure
    during an MPI-IO checkpoint save). Its message is the one line a user reads; the job should
    end with a non-zero status so that a supervisor or requeue restarts it from its last
    checkpoint. Every survivor raises the same one (the decision is agreed)."""

    plain = True  # the command line prints the message alone, without a traceback


_FAILURE_CLASSES: list[int] = []


def failure_classes() -> tuple[int, ...]:
    """MPI's error classes of a lost process: ``ERR_PROC_FAILED``,
    ``ERR_PROC_FAILED_PENDING``, ``ERR_REVOKED`` (those mpi4py has)."""
    if not _FAILURE_CLASSES:
        MPI = mpi()
        _FAILURE_CLASSES.extend(getattr(MPI, n) for n in (
            "ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED") if hasattr(MPI, n))
    return tuple(_FAILURE_CLASSES)


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a :class:`ProcessFailure` or an MPI error of a lost process."""
    if isinstance(exc, ProcessFailure):
        return True
    get = getattr(exc, "Get_error_class", None)
    return get is not None and get() in failure_classes()


_KEPT: list[Any] = []


def keep_alive(*objs: Any) -> None:
    """Keep ``objs`` (the buffers of an MPI operation that failed) alive for the rest of
    the process: Open MPI may still touch the buffers of an operation it aborted after a
    failure, although mpi4py let go of them. Not collective."""
    _KEPT.append(objs)


def revoke_all() -> int:
    """Revoke every live traced communicator (but ``COMM_SELF``); the number revoked. Not
    collective: every rank blocked on one of them returns with ``ERR_REVOKED``."""
    MPI = mpi()
    n = 0
    for c in live():
        if comm_id(c) == "self" or c == MPI.COMM_NULL:
            continue
        try:
            MPI.Comm.Revoke(c)
            n += 1
        except Exception:  # noqa: BLE001 - freed meanwhile, or the library refuses: go on
            continue
    return n


# -- the hook --------------------------------------------------------------------------------
class _State:
    enabled = False
    detected = 0.0  # when this rank first saw the current failure (0: none pending)
    survived = False
    comm: Any = None  # the survivors' communicator after the last recovery
    listeners: list[Callable[[Any], None]] = []
    stale: set[int] = set()  # ids of the communicators a recovery left behind (revoked)


def _knows_a_failure(call: calls.Call, wait: float = 0.0) -> bool:
    """Whether the call's communicator is revoked or knows of a failed process, asking
    again (with MPI progress) for up to ``wait`` seconds."""
    comm = next((c for c in live() if comm_id(c) == call.comm), None)
    return comm is not None and _any_knows([comm], wait)


def _knows(comm: Any) -> bool:
    """Whether ``comm`` is revoked or knows of a failed process (False where it cannot
    say: freed meanwhile, not ULFM's)."""
    try:
        if comm.Is_revoked():
            return True
        failed = comm.Get_failed()
        n = failed.Get_size()
        failed.Free()
        return n > 0
    except Exception:  # noqa: BLE001 - a communicator that cannot say: not ours
        return False


def _any_knows(comms: Sequence[Any], wait: float) -> bool:
    """Whether one of ``comms`` is revoked or knows of a failed process, asking again
    (with MPI progress) for up to ``wait`` seconds."""
    MPI = mpi()
    end = time.monotonic() + wait
    while True:
        for comm in comms:
            if _knows(comm):
                return True
            with contextlib.suppress(Exception):  # (progress)
                MPI.Comm.Iprobe(comm, MPI.ANY_SOURCE, MPI.ANY_TAG)
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)


def failure_behind(exc: BaseException, wait: float = 5.0) -> ProcessFailure | None:
    """The :class:`ProcessFailure` behind ``exc``, an error that is not MPI's (a check of a
    collective's result that failed, say), where a rank was lost meanwhile; None where the
    hook is off, ``exc`` is a ProcessFailure or an UnrecoverableFailure already, or no
    live communicator of this process learns of a failure within ``wait`` seconds (the
    error is the program's own).

    ULFM lets a collective return *success* on a survivor although a member died in it,
    the dead member's part of the buffer unwritten (seen across nodes: an ``Allreduce``
    max of a table whose dead rank's slots kept their initial value): the check then fails
    on garbage before any MPI call reports the failure. Revokes every live communicator
    when it finds one, as the hook does. Not collective."""
    if not _State.enabled or isinstance(exc, (ProcessFailure, UnrecoverableFailure)) \
            or not isinstance(exc, Exception):
        return None
    fresh = [c for c in live() if comm_id(c) != "self" and id(c) not in _State.stale]
    if not _any_knows(fresh, wait):
        return None
    if not _State.detected:
        _State.detected = time.time()
    revoke_all()
    step, where = calls.step_phase()
    return ProcessFailure(f"a rank was lost: {type(exc).__name__} on a collective's result "
                          f"({exc}) at step {step}", step=step, phase=where,
                          detected=_State.detected)


def _lost_in_status(call: calls.Call, exc: BaseException) -> bool:
    """Whether an ``MPI_ERR_IN_STATUS`` of a wait (one of several requests failed) is a
    lost process: the call's communicator is revoked or knows of a failed process."""
    get = getattr(exc, "Get_error_class", None)
    if get is None or get() != mpi().ERR_IN_STATUS:
        return False
    return _knows_a_failure(call)


def _garbled(call: calls.Call, exc: BaseException) -> bool:
    """Whether a pickled-object call (mpi4py's lower-case methods) that failed to unpickle
    what it received saw a lost process: ULFM lets a collective return on some ranks
    although a member died in it, the dead member's part of the buffer unwritten (seen
    here: ``allgather`` raising ``UnpicklingError`` on a survivor). Waits up to 2 s for
    the communicator to learn of the failure."""
    if hasattr(exc, "Get_error_class") or not call.op[:1].islower():
        return False
    return _knows_a_failure(call, wait=2.0)


class _Revoker:
    """The ``error`` hook: a lost process revokes everything and raises ProcessFailure."""

    def error(self, call: calls.Call, exc: BaseException) -> None:
        if isinstance(exc, ProcessFailure) or not (is_failure(exc)
                                                   or _lost_in_status(call, exc)
                                                   or _garbled(call, exc)):
            return
        if not _State.detected:
            _State.detected = time.time()
        revoke_all()
        error = exc.Get_error_string() if hasattr(exc, "Get_error_string") \
            else f"{type(exc).__name__}: {exc}"
        raise ProcessFailure(
            f"a rank was lost: {call.op} on {call.comm or 'a communicator'} failed "
            f"({error.split(':')[0]}) at step {call.step}"
            + (f", phase {call.phase}" if call.phase else ""),
            comm=call.comm, op=call.op, step=call.step, phase=call.phase,
            error_class=call.error, detected=_State.detected) from exc


_REVOKER = _Revoker()


def enable() -> bool:
    """Install the hook (idempotent) where MPI's fault tolerance is on in this process
    (:func:`mpidist.core.ft.fault_tolerance`); whether it is installed. Not collective; the
    kill points of ``MPIDIST_FT_KILL`` are installed with it."""
    from mpidist.core.ft import fault_tolerance

    if not _State.enabled and fault_tolerance().available:
        calls.add_hook(_REVOKER)
        _State.enabled = True
        install_kill_points()
    return _State.enabled


def enabled() -> bool:
    """Whether the hook is installed."""
    return _State.enabled


def on_shrink(fn: Callable[[Any], None]) -> None:
    """Call ``fn(comm)`` with the survivors' communicator after every recovery, on every
    survivor, in the order registered (``fn`` may be collective over ``comm``)."""
    if fn not in _State.listeners:
        _State.listeners.append(fn)


def survived() -> bool:
    """Whether this process outlived a failure of another rank (and recovered)."""
    return _State.survived


def job_comm() -> Any:
    """The survivors' communicator of the last recovery (None: no failure survived)."""
    return _State.comm


# -- shrinking and agreeing ----------------------------------------------------------------
@dataclass
class Shrunk:
    """The survivors after :func:`shrink`: their communicator, their ranks in the original
    one (``survivors[i]`` is new rank i's), the original ranks that died, and each
    survivor's reported values (``values[i]`` is new rank i's)."""

    comm: Any
    survivors: list[int]
    dead: list[int]
    values: np.ndarray
    seconds: float = 0.0
    timing: dict[str, float] = field(default_factory=dict)


def shrink(comm: Any, *, original_size: int, original_rank: int,
           values: Sequence[int] = ()) -> Shrunk:
    """The survivors' communicator of ``comm`` (a failed, revoked, or already shrunk one)
    and what every survivor reports. Collective over the survivors of ``comm``.

    ``original_rank``/``original_size``: this rank's rank in, and the size of, the
    communicator the recovery started from (the same through retries, so that the table is
    about it); ``values``: int64 values every survivor reports (the same number on each).
    Raises :class:`ProcessFailure` when another rank fails meanwhile: start over with the
    communicator :func:`shrink` returned last (or ``comm``).
    """
    MPI = mpi()
    t0 = time.perf_counter()
    try:
        MPI.Comm.Revoke(comm)
    except Exception:  # noqa: BLE001 - revoked already; Shrink takes it either way
        pass
    new = comm.Shrink()
    t1 = time.perf_counter()
    mine = np.array([original_rank, *values], dtype=np.int64)
    table = np.zeros((new.Get_size(), mine.size), dtype=np.int64)
    new.Allgather(mine, table)
    t2 = time.perf_counter()
    survivors = [int(r) for r in table[:, 0]]
    dead = [r for r in range(original_size) if r not in set(survivors)]
    return Shrunk(new, survivors, dead, table[:, 1:], t2 - t0,
                  {"shrink": t1 - t0, "agree": t2 - t1})


def commit(comm: Any, flag: int = 1) -> int:
    """ULFM's uniform agreement (``Agree``): the bitwise AND of every survivor's ``flag``,
    the same on every survivor. Collective over ``comm``; raises :class:`ProcessFailure`
    when a rank failed meanwhile. On success, ``comm`` is the job's communicator from now
    on (:func:`job_comm`) and the :func:`on_shrink` listeners are called with it."""
    agreed = int(comm.Agree(int(flag)))
    _State.comm = comm
    _State.survived = True
    _State.detected = 0.0
    _State.stale = {id(c) for c in live() if c is not comm and _knows(c)}
    for fn in list(_State.listeners):
        fn(comm)
    return agreed


def abort(comm: Any, code: int, leave: bool | None = None) -> None:
    """End the MPI job from this rank alone, with ``code``; does not return. Not collective.
    ``leave``: what :func:`abort_leaves_the_job` said when the caller wrote its line
    (default: ask now), so that the line and the act agree.

    ``MPI_Abort`` ends every rank, except under MPI's fault tolerance (ULFM, seen with Open
    MPI 5.0 ``--with-ft ulfm``) before any process has failed: there the runtime neither
    ends the other ranks nor reports the aborted (or exited) process as failed, so they
    wait forever in their next collective (after a failure, it ends the job as usual). In
    that case this rank SIGKILLs itself instead, a loss the others do see: they recover
    without it (a rank that fails alone is a lost rank, as a crashed one is) or, where they
    cannot, end the job in one line."""
    if abort_leaves_the_job() if leave is None else leave:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    comm.Abort(code)


def abort_leaves_the_job() -> bool:
    """Whether :func:`abort` ends only this rank: MPI's fault tolerance is on and this
    process knows of no failed process yet. Not collective."""
    from mpidist.core.ft import fault_tolerance

    if not (_State.enabled or fault_tolerance().available):
        return False
    if _State.detected or _State.survived:
        return False
    return not _knows(mpi().COMM_WORLD)


def leave(status: int, comm: Any = None) -> None:
    """End this process after a survived failure: flush the output and the logs, a barrier
    of the survivors (``comm``, default :func:`job_comm`), then ``os._exit(status)``
    without ``MPI_Finalize``. The launcher ends the job with ``status`` when every
    survivor leaves with it. Collective over ``comm``; does not return."""
    comm = comm if comm is not None else _State.comm
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    if comm is not None:
        try:
            exit_barrier(comm)
        except Exception:  # noqa: BLE001 - a failure on the way out: leave anyway
            pass
    os._exit(status)


def exit_barrier(comm: Any) -> None:
    """The barrier every process of a job that survived a failure passes on its way out
    (survivors, released ranks, newcomers alike): an ``Ibarrier`` polled with short sleeps,
    so that a rank released early waits without spinning (a blocking ``Barrier`` would not
    match it: MPI never matches blocking and nonblocking collectives). Collective over
    ``comm``."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.01)


def leave_if_survived(status: int) -> int:
    """``status`` where no failure was survived; else :func:`leave` with it (no return)."""
    if _State.survived:
        leave(status)
    return status


# -- kill points (tests and benchmarks) ------------------------------------------------------
@dataclass(frozen=True)
class KillPoint:
    """World rank ``rank`` SIGKILLs itself in its ``call``-th MPI call (0: on entering the
    phase) of phase ``phase`` ("*": any) of step ``step``."""

    rank: int
    step: int
    phase: str = "*"
    call: int = 1


def parse_kill_points(text: str) -> list[KillPoint]:
    """``"rank=R,step=S[,phase=P][,call=N];..."`` as kill points; ValueError naming a bad
    one. Pure."""
    out = []
    for item in (t.strip() for t in text.split(";")):
        if not item:
            continue
        try:
            want = key_values(item, ("rank", "step", "phase", "call"))
            point = KillPoint(int(want["rank"]), int(want["step"]), want.get("phase") or "*",
                              int(want.get("call", 1)))
            if min(point.rank, point.step, point.call) < 0 \
                    or (point.call == 0 and point.phase == "*"):
                raise ValueError
        except (KeyError, ValueError):
            raise ValueError(f"{KILL_ENV}={text!r}: {item!r} is not rank=R,step=S[,phase=P]"
                             "[,call=N] (whole numbers >= 0; call=0, on entering the phase, "
                             "needs a phase)") from None
        out.append(point)
    return out


class _Killer:
    """``enter`` and context hooks that SIGKILL this process at its kill points."""

    def __init__(self, points: list[KillPoint], rank: int) -> None:
        self.points = [p for p in points if p.rank == rank]
        self.rank = rank
        self.counts: dict[KillPoint, int] = {}

    def _kill(self, p: KillPoint, what: str) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"[rank {self.rank}] {KILL_ENV}: SIGKILL of rank {p.rank} at step "
                         f"{p.step}, phase {p.phase} ({what}) at {time.time():.6f}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def enter(self, call: calls.Call) -> None:
        for p in self.points:
            if p.call > 0 and call.step == p.step and p.phase in (call.phase, "*"):
                n = self.counts.get(p, 0) + 1
                self.counts[p] = n
                if n == p.call:
                    self._kill(p, f"call {n}: {call.op} on {call.comm}")

    def context(self) -> None:
        step, phase_ = calls.step_phase()
        for p in self.points:
            if p.call == 0 and step == p.step and phase_ == p.phase:
                self._kill(p, "entering the phase")


_KILLER: list[_Killer] = []


def install_kill_points(text: str | None = None) -> list[KillPoint]:
    """Install the kill points of ``text`` (default: ``$MPIDIST_FT_KILL``) for this world
    rank; the points of this rank. Not collective. For tests and benchmarks only."""
    text = os.environ.get(KILL_ENV, "") if text is None else text
    points = parse_kill_points(text)
    if _KILLER:
        calls.remove_hook(_KILLER[0])
        calls.remove_context_hook(_KILLER[0].context)
        _KILLER.clear()
    if not points:
        return []
    killer = _Killer(points, mpi().COMM_WORLD.Get_rank())
    if killer.points:
        _KILLER.append(killer)
        calls.add_hook(killer)
        calls.add_context_hook(killer.context)
    return killer.points
