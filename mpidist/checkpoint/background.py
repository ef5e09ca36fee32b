"""Asynchronous saves: a host snapshot, a background write, a commit later.

:func:`~mpidist.checkpoint.io.save_checkpoint` with ``async_=True`` takes the small
collective decisions of a save on the calling thread, as a blocking save does: the
agreement on the arguments, the temp file's name and the posix layout. In between it copies
the rank's pieces into a :class:`HostPool` (host buffers reused from save to save; pinned
memory when a piece lives on a GPU) and returns an :class:`AsyncCheckpoint`. A background
thread then writes the rank's bytes and their checksums
(:func:`~mpidist.checkpoint.writer.write_rank_bytes`: ``pwrite``, no MPI, the GIL held only
for each 4 MB chunk's Python glue) and fsyncs them. The file is the one a blocking save
writes, byte for byte in its tensor data and checksums.

**The commit** is collective and runs on the calling thread, never in the background: every
rank's write done (or the first failure raised on every rank, as a blocking save raises
it), the partial checksums summed over the ranks and written by rank 0, then rank 0's
rename, directory fsync, ``latest`` and retention, exactly as in a blocking save. It
happens in :meth:`AsyncCheckpoint.wait`, in :meth:`AsyncCheckpoint.poll` when every rank is
done, or in :meth:`AsyncCheckpoint.commit_agreed` (``mpidist train``: at the step boundary
where the between-steps agreement says every rank is done). Until then the previous
checkpoint is ``latest`` and the new one exists only as a hidden temp file, which no reader
takes for a checkpoint.

**At most one save in flight per process**: every save (blocking or not) first waits for
the one in flight and commits it (:func:`wait_in_flight`), collective over that save's
ranks: a program that saves over several communicators waits for one save before starting
a save over other ranks.

**Abandoning** (:meth:`AsyncCheckpoint.abandon`, not collective: for in-job recovery after
a rank died): the writer stops between chunks, the save never commits, ``latest`` stays,
and the temp file is left for the next committed save's cleanup.

Only the ``posix`` I/O mode writes in the background; under ``mpio`` or ``serial`` (see
:mod:`mpidist.checkpoint.io`) an asynchronous save writes and commits before returning,
from the snapshot, and returns a handle that is already committed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpidist.checkpoint.agreement import (
    ERRORS,
    Failure,
    capture_failure,
    describe_error,
    first_failure,
    size_rank,
)
from mpidist.checkpoint.format import CheckpointError, Piece
from mpidist.checkpoint.phases import SavePlan, commit_file, finish_sums, step_of
from mpidist.checkpoint.writer import (
    WriteCancelled,
    WriterContext,
    write_rank_bytes,
    writer_hook,
)
from mpidist.core.arrays import is_host, to_host
from mpidist.core.devices import copy_to_host, is_device, pinned_empty

__all__ = ["AsyncCheckpoint", "HostPool", "default_pool", "in_flight", "wait_in_flight"]

_ALIGN = 64


class HostPool:
    """Host memory an asynchronous save copies the rank's state into, kept from save to
    save (allocated at the first save, grown when a save needs more). Pinned (page-locked)
    memory, through :mod:`mpidist.core.devices`, when a piece lives on a GPU, so the copy
    from the device is one DMA per piece. One save uses the pool at a time."""

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None
        self.pinned = False
        self.busy = False
        self.last_seconds = 0.0  #: how long the last snapshot took (copies included)

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 before the first asynchronous save)."""
        return 0 if self._buf is None else int(self._buf.nbytes)

    def snapshot(self, pieces: Sequence[Piece]) -> list[Piece]:
        """Copies of ``pieces`` in the pool (the same names, ranges, shapes and dtypes,
        host arrays). Not collective. Raises RuntimeError while a save still uses the
        pool, TypeError/ValueError for data that is not an array."""
        if self.busy:
            raise RuntimeError("the host snapshot pool is still used by the save in flight")
        t0 = time.perf_counter()
        datas = [p.data if hasattr(p.data, "dtype") and hasattr(p.data, "shape")
                 else np.asarray(p.data) for p in pieces]
        offsets, need = [], 0
        for d in datas:
            offsets.append(need)
            nbytes = int(np.prod(d.shape, dtype=np.int64)) * np.dtype(d.dtype).itemsize
            need += -(-nbytes // _ALIGN) * _ALIGN
        device = any(is_device(d) for d in datas)
        if self._buf is None or self._buf.nbytes < need or (device and not self.pinned):
            self._buf = None  # let the old buffer go before the new one is made
            self._buf = pinned_empty(need) if device else np.empty(need, dtype=np.uint8)
            self.pinned = device
        out = []
        for p, d, off in zip(pieces, datas, offsets, strict=True):
            dt = np.dtype(d.dtype)
            n = int(np.prod(d.shape, dtype=np.int64))
            dst = self._buf[off:off + n * dt.itemsize].view(dt).reshape(d.shape)
            if is_device(d):
                copy_to_host(dst, d)
            else:
                np.copyto(dst, d if is_host(d) else to_host(d), casting="no")
            out.append(Piece(p.name, p.flat, dst))
        self.busy = True
        self.last_seconds = time.perf_counter() - t0
        return out

    def release(self) -> None:
        """The save that used the pool is over (committed, failed or abandoned)."""
        self.busy = False


_POOL = HostPool()
_IN_FLIGHT: list[AsyncCheckpoint] = []


def default_pool() -> HostPool:
    """The process's pool, which every asynchronous save uses unless given another."""
    return _POOL


def in_flight() -> AsyncCheckpoint | None:
    """The asynchronous save of this process not yet committed, failed or abandoned."""
    return _IN_FLIGHT[0] if _IN_FLIGHT else None


@atexit.register
def _never_committed() -> None:
    """Say so when the process ends with a save in flight (its temp file stays hidden)."""
    pending = in_flight()
    if pending is not None and not pending.committed:
        sys.stderr.write(f"mpidist: warning: the asynchronous checkpoint {pending.path} was "
                         "never committed (no wait(), step() or later save); the previous "
                         "checkpoint is the latest\n")


def wait_in_flight(step: int | None = None) -> None:
    """Wait for the save in flight, if any, and commit it (its error, if it failed, raises
    here). Collective over that save's ranks."""
    pending = in_flight()
    if pending is not None:
        pending.wait(step)


class AsyncCheckpoint:
    """An asynchronous save: its handle, and everything its background write and commit
    need (one object, so that one call commits it and one call abandons it).

    Not collective: :meth:`done`, :meth:`abandon`, the attributes. Collective over the
    save's ranks (every rank at the same point): :meth:`wait`, :meth:`poll`,
    :meth:`commit_agreed`. Attributes: ``path``; ``bytes`` (the checkpoint's tensor bytes,
    all ranks), ``local_bytes`` (this rank's); ``blocking_seconds`` (the save call; its
    parts in ``phase_seconds``), ``background_seconds`` (this rank's write, once done),
    ``commit_seconds``, ``commit_step`` (as given to the committing call); ``committed``;
    ``error``.
    """

    def __init__(self, path: str, plan: SavePlan, *, comm: Any = None,
                 keep: int | None = None, owner: Any = None) -> None:
        self.path = path
        self.owner = owner  #: who polls it between steps (an optimizer), or None
        self._plan, self._own, self._keep = plan, comm, keep
        self._pool: HostPool | None = None
        self.bytes = sum(i.nbytes for i in plan.infos.values())
        self.local_bytes = sum(int(p.data.nbytes) for p in plan.pieces)
        self.tmp, self.started_ns = "", 0
        self._ctx = WriterContext(rank=size_rank(comm)[1], path=path, tmp="",
                                  step=step_of(plan.plain), asynchronous=True)
        self._offsets = np.empty(0, dtype=np.int64)
        self.blocking_seconds = self.background_seconds = self.commit_seconds = 0.0
        #: the save call's parts: snapshot (the copy), agreement, layout, start (thread)
        self.phase_seconds: dict[str, float] = {}
        self.commit_step: int | None = None
        self.committed = self.abandoned = False
        self.error: CheckpointError | None = None
        self._failure: Failure | None = None
        self._sums: np.ndarray | None = None
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None

    # -- not collective ---------------------------------------------------------------------
    def done(self) -> bool:
        """Whether this rank has nothing left to wait for: its background write finished
        (successfully or not), or the save was committed or abandoned. Not collective; the
        commit itself still needs :meth:`wait` (or the next save, or the next step)."""
        return self._finished.is_set() or self.committed or self.abandoned

    def failed(self) -> bool:
        """Whether this rank's background write failed. Not collective."""
        return self._finished.is_set() and self._failure is not None

    def abandon(self) -> None:
        """Give the save up on this rank: the writer stops between chunks (it is waited
        for), nothing is committed, ``latest`` does not move; the temp file stays hidden
        until the next committed save of the directory deletes it. Not collective and
        uses no MPI (after a rank's death, each survivor calls it); the save's own
        communicator is left as it is (revoked, it is its recovery's to free:
        :meth:`free_communicator`)."""
        if self.committed or self.abandoned:
            return
        self._ctx.stop()
        if self._thread is not None:
            self._thread.join()
        self.abandoned = True
        self._release()

    def free_communicator(self) -> None:
        """Free an abandoned save's own communicator: the recovery that abandoned the save
        calls it once the survivors have shrunk (the communicator is revoked, as the
        model's are, which that recovery frees the same way). Nothing for a save not
        abandoned."""
        if self.abandoned and self._own is not None:
            own, self._own = self._own, None
            own.Free()

    # -- collective -------------------------------------------------------------------------
    def wait(self, step: int | None = None) -> None:
        """Wait for this rank's write, then commit. Collective over the save's ranks; every
        rank raises the same :class:`CheckpointError` if a rank's write or the commit
        failed (the previous checkpoint stays ``latest``). ``step`` is recorded as
        :attr:`commit_step`. Returns at once if already committed; raises the error again
        if the save failed."""
        if self.committed or self.abandoned:
            return
        if self.error is not None:
            raise self.error
        self._finished.wait()
        self._commit(step)

    def poll(self, step: int | None = None) -> bool:
        """Commit if every rank's write is done (or a rank's failed: then raise its error
        everywhere); whether the save is committed now. Collective over the save's ranks:
        one allreduce of two integers (a library's training loop calls it once per step,
        :meth:`mpidist.parallel.ShardedOptimizer.step` does)."""
        if self.committed or self.abandoned:
            return True
        if self.error is not None:
            raise self.error
        flags = np.array([0 if self.done() else 1, 1 if self.failed() else 0], dtype=np.int64)
        if self._own is not None:
            from mpi4py import MPI

            self._own.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        return self.commit_agreed(all_done=not flags[0], any_failed=bool(flags[1]), step=step)

    def commit_agreed(self, *, all_done: bool, any_failed: bool, step: int | None = None
                      ) -> bool:
        """Commit (or raise a rank's failure everywhere) when the ranks agreed that every
        write is done or one failed; whether the save is committed now. Collective over
        the save's ranks when it commits or raises (every rank passes the same agreed
        values); nothing when neither flag is set. A write still running when another rank
        failed is stopped first."""
        if self.committed or self.abandoned:
            return True
        if any_failed and not self._finished.is_set():
            self._ctx.stop()
        if not (all_done or any_failed):
            return False
        self._finished.wait()
        self._commit(step)
        return True

    # -- the machinery ----------------------------------------------------------------------
    def start(self, pool: HostPool, tmp: str, started_ns: int, offsets: np.ndarray) -> None:
        """Start the background write of the laid-out temp file ``tmp`` (offsets from
        :func:`~mpidist.checkpoint.phases.layout_posix`) from the snapshot in ``pool``, and
        make this the save in flight. Called by
        :func:`~mpidist.checkpoint.io.save_checkpoint`; not collective."""
        self._pool, self.tmp, self.started_ns, self._offsets = pool, tmp, started_ns, offsets
        self._ctx.tmp = tmp
        self._thread = threading.Thread(target=self._write, name="mpidist-checkpoint-writer",
                                        args=(writer_hook(),), daemon=True)
        self._thread.start()
        # the save in flight only once its writer runs: a thread that failed to start
        # leaves no handle that would never finish for the next save or load to wait on
        _IN_FLIGHT[:] = [self]

    def _write(self, hook: Any) -> None:
        """The background thread: this rank's bytes, checksums and fsync; no MPI."""
        plan, ctx = self._plan, self._ctx
        t0 = time.perf_counter()
        try:
            with capture_failure() as box:
                self._sums = write_rank_bytes(self.tmp, plan.names, plan.infos, plan.pieces,
                                              plan.rows, self._offsets, plan.writeback, ctx,
                                              hook)
            self._failure = first_failure(box)
        except WriteCancelled:
            pass  # abandoned, or stopped after another rank failed: that rank's error counts
        except BaseException as exc:  # a bug must reach the commit, not end the thread
            self._failure = Failure(describe_error(exc))
        finally:
            self.background_seconds = time.perf_counter() - t0
            self._finished.set()

    def _commit(self, step: int | None) -> None:
        """Every rank's verdict, the checksums, then rank 0's rename and ``latest``."""
        t0 = time.perf_counter()
        own = self._own
        try:
            sums = _agree_on_writes(own, self._failure, self._sums)
            finish_sums(self.tmp, self._plan.names, sums, own)
            commit_file(self.path, self.tmp, os.path.dirname(os.path.abspath(self.path)),
                        self._keep, self.started_ns, own)
            self.committed = True
            self.commit_step = step
        except CheckpointError as exc:
            self.error = exc
            if own is None or own.Get_rank() == 0:
                with contextlib.suppress(OSError):
                    os.remove(self.tmp)
            raise
        finally:
            self.commit_seconds = time.perf_counter() - t0
            self._release()
            if own is not None:
                own.Free()
                self._own = None

    def _release(self) -> None:
        self._plan.pieces = []  # the snapshot's views: the pool is the next save's now
        if self._pool is not None:
            self._pool.release()
            self._pool = None
        if _IN_FLIGHT and _IN_FLIGHT[0] is self:
            _IN_FLIGHT.clear()


def _agree_on_writes(own: Any, failure: Failure | None, sums: np.ndarray | None
                     ) -> np.ndarray:
    """:func:`~mpidist.checkpoint.agreement.agree` on the writes' outcome, where a write
    stopped (no ``sums``) because another rank's failed yields to that rank's failure: every
    rank raises the first failed rank's error, as a blocking save does. This rank's partial
    checksums when every write succeeded. Collective over ``own``."""
    stopped = sums is None
    if own is None and failure is not None:  # one process: as agree() raises it
        raise failure.cls(str(failure))
    mine = None if failure is None else (failure.cls.__name__, str(failure))
    everyone = [(mine, stopped)] if own is None else own.allgather((mine, stopped))
    for r, (item, _) in enumerate(everyone):
        if item is not None:
            raise ERRORS.get(item[0], CheckpointError)(f"[rank {r}] {item[1]}")
    halted = [r for r, (_, was) in enumerate(everyone) if was]
    if halted or sums is None:
        raise CheckpointError(f"[rank {halted[0] if halted else 0}] the background write "
                              "was stopped")
    return sums
