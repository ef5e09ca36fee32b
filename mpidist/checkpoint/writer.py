"""One rank's bytes of a posix-mode save, and the test hook that stops or fails the writer.

:func:`write_rank_bytes` is the pass every rank makes over its pieces in the ``posix`` I/O
mode, blocking or in an asynchronous save's background thread alike: each 4 MB chunk
checksummed and written (``pwrite``) at its dataset's offset in file order, the kernel asked
to start writing back as it goes, and the rank's file descriptor fsynced at the end.
It does no MPI, so it may run in any thread.

**The writer hook** (for tests: crash safety, error paths). At three points of that pass
the hook, if one is set, is called as ``hook(point, context)``:

* ``"before-write"``: the file is open and laid out, no byte of this rank written;
* ``"mid-write"``: about half of this rank's bytes written;
* ``"before-commit"``: every byte written and fsynced; the save is not committed yet.

The hook may raise (the write fails with that error, as an I/O error would: the save
raises the same :class:`~mpidist.checkpoint.CheckpointError` on every rank and the
previous checkpoint stays), sleep, or block (the writer stops there; a test then kills the
processes). Set it with :func:`set_writer_hook`, or for a whole program (``mpidist train``
under ``mpiexec``) with the environment variable ``MPIDIST_CHECKPOINT_WRITER_HOOK``:
comma-separated ``key=value`` items ``point=<point>`` (required),
``action=fail|stop|delay|kill`` (required), ``seconds=S`` (for ``delay``), ``rank=R`` (only
that rank of the save's communicator; default every rank), ``step=S`` (only the save whose
``step`` attribute is S; default every save). ``stop``, ``delay`` and ``kill`` print one
line to stderr when they start (``mpidist: checkpoint writer hook: rank R (pid P) stop at
mid-write of step S``); ``stop`` waits until the save is abandoned (or forever in a
blocking save); ``fail`` raises ``OSError(ENOSPC)``; ``kill`` SIGKILLs the rank's process
there (a rank lost mid-write, for the tests of in-job recovery).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpidist.checkpoint import storage
from mpidist.checkpoint.format import Piece, TensorInfo
from mpidist.checkpoint.storage import Writeback, dataset_dtype, pwrite_array
from mpidist.core.specs import key_values

__all__ = ["HOOK_ENV", "WRITER_POINTS", "WriteCancelled", "WriterContext", "env_writer_hook",
           "set_writer_hook", "write_rank_bytes", "writer_hook"]

#: The points at which the writer hook is called, in order.
WRITER_POINTS = ("before-write", "mid-write", "before-commit")
#: The environment variable that sets a writer hook for a whole program.
HOOK_ENV = "MPIDIST_CHECKPOINT_WRITER_HOOK"
_ACTIONS = ("fail", "stop", "delay", "kill")


class WriteCancelled(Exception):  # noqa: N818 - not an error: the save was abandoned
    """The save this writer works for was abandoned; the writer stops between chunks."""


@dataclass
class WriterContext:
    """What the writer hook is told about the write it is called from."""

    rank: int  #: this rank in the save's communicator
    step: int | None  #: the save's ``step`` attribute, if it has an integer one
    path: str  #: the checkpoint's final path
    tmp: str  #: the temp file being written
    asynchronous: bool  #: whether this is an asynchronous save's background thread
    cancel: threading.Event = field(default_factory=threading.Event)  #: set by :meth:`stop`
    #: the same as an int64 flag, which the compiled write loop reads between chunks
    flag: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))

    def stop(self) -> None:
        """Ask the writer to stop between chunks (the save is abandoned). Any thread."""
        self.flag[0] = 1
        self.cancel.set()


_HOOK: dict[str, Callable[[str, WriterContext], None] | None] = {"set": None}


def set_writer_hook(hook: Callable[[str, WriterContext], None] | None) -> None:
    """Call ``hook(point, context)`` at each of :data:`WRITER_POINTS` of every posix-mode
    save's write pass from now on (None: no hook; the environment's, if any, applies
    again). Not collective: set it on the ranks it should act on."""
    if hook is not None and not callable(hook):
        raise ValueError(f"writer hook {hook!r} is not callable")
    _HOOK["set"] = hook


def writer_hook() -> Callable[[str, WriterContext], None] | None:
    """The hook in force: :func:`set_writer_hook`'s, else ``MPIDIST_CHECKPOINT_WRITER_HOOK``'s
    (parsed at each save; a bad value raises ValueError naming it), else None."""
    if _HOOK["set"] is not None:
        return _HOOK["set"]
    return env_writer_hook(os.environ.get(HOOK_ENV, ""))


def env_writer_hook(spec: str) -> Callable[[str, WriterContext], None] | None:
    """The hook that ``MPIDIST_CHECKPOINT_WRITER_HOOK=spec`` describes (None for an empty
    spec); ValueError naming the bad item. Pure."""
    spec = spec.strip()
    if not spec:
        return None
    try:
        items = key_values(spec, ("point", "action", "seconds", "rank", "step"))
    except ValueError:
        raise ValueError(f"{HOOK_ENV}={spec!r}: expected point=P,action=A[,seconds=T]"
                         "[,rank=R][,step=S] (each key once)") from None
    point, action = items.get("point"), items.get("action")
    if point not in WRITER_POINTS:
        raise ValueError(f"{HOOK_ENV}={spec!r}: point={point!r} is not one of {WRITER_POINTS}")
    if action not in _ACTIONS:
        raise ValueError(f"{HOOK_ENV}={spec!r}: action={action!r} is not one of {_ACTIONS}")
    try:
        seconds = float(items.get("seconds", "1"))
        rank = int(items["rank"]) if "rank" in items else None
        step = int(items["step"]) if "step" in items else None
    except ValueError:
        raise ValueError(f"{HOOK_ENV}={spec!r}: seconds, rank and step must be numbers") \
            from None
    return _EnvHook(point, action, seconds, rank, step)


@dataclass(frozen=True)
class _EnvHook:
    point: str
    action: str
    seconds: float
    rank: int | None
    step: int | None

    def __call__(self, point: str, ctx: WriterContext) -> None:
        if point != self.point or self.rank not in (None, ctx.rank) \
                or self.step not in (None, ctx.step):
            return
        if self.action == "fail":
            raise OSError(errno.ENOSPC, f"No space left on device (injected by {HOOK_ENV} "
                                        f"at {point})")
        sys.stderr.write(f"mpidist: checkpoint writer hook: rank {ctx.rank} (pid {os.getpid()}) "
                         f"{self.action} at {point} of step {ctx.step}\n")
        sys.stderr.flush()
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "delay":
            ctx.cancel.wait(self.seconds)
        else:
            ctx.cancel.wait()
        if ctx.cancel.is_set():
            raise WriteCancelled(ctx.tmp)


def _call(hook: Callable[[str, WriterContext], None] | None, point: str,
          ctx: WriterContext) -> None:
    if ctx.cancel.is_set():
        raise WriteCancelled(ctx.tmp)
    if hook is not None:
        hook(point, ctx)


def write_rank_bytes(tmp: str, names: Sequence[str], infos: Mapping[str, TensorInfo],
                     pieces: Sequence[Piece], rows: np.ndarray, offsets: np.ndarray,
                     writeback_bytes: int, ctx: WriterContext,
                     hook: Callable[[str, WriterContext], None] | None = None) -> np.ndarray:
    """Write this rank's pieces into the laid-out temp file and fsync it; the partial
    checksums ``(len(names), 2)`` (uint64) of what it wrote. Not collective; no MPI.

    One pass in file order: every 4 MB chunk is checksummed while in cache, written with
    ``pwrite``, and the kernel asked to start writing it back, so the final fsync finds
    little left to do. Pieces already in the stored byte order go through one compiled
    loop that holds no GIL (:mod:`mpidist.checkpoint.native`), others through
    :func:`~mpidist.checkpoint.storage.pwrite_array`. ``hook`` is called at
    :data:`WRITER_POINTS` ("mid-write" after the piece that crosses half of this rank's
    bytes); raises :class:`WriteCancelled` between chunks once ``ctx.stop()`` was called.
    """
    sums = np.zeros((len(names), 2), dtype=np.uint64)
    order = sorted(range(len(pieces)), key=lambda k: (int(offsets[rows[k, 0]]), int(rows[k, 1])))
    items = []  # (piece, tensor, first element, stored dtype), in file order
    for k in order:
        t, a, b = (int(x) for x in rows[k])
        if b > a:
            items.append((pieces[k], t, a, dataset_dtype(infos[names[t]].dtype)))
    sizes = np.cumsum([p.data.shape[0] * stored.itemsize for p, _, _, stored in items])
    half = int(np.searchsorted(sizes, sizes[-1] / 2)) + 1 if len(items) else 0
    kernel = native_writer() if all(_native(p.data, stored) for p, _, _, stored in items) \
        else None
    fd = os.open(tmp, os.O_WRONLY)
    try:
        _call(hook, "before-write", ctx)
        if kernel is not None:
            every = writeback_bytes if storage.sync_file_range() is not None else 0
            _write_native(kernel, fd, items[:half], offsets, sums, every, ctx)
            _call(hook, "mid-write", ctx)
            _write_native(kernel, fd, items[half:], offsets, sums, every, ctx)
        else:
            writeback = Writeback(fd, writeback_bytes)
            _write_python(fd, items[:half], offsets, sums, writeback, ctx)
            _call(hook, "mid-write", ctx)
            _write_python(fd, items[half:], offsets, sums, writeback, ctx)
            writeback.flush()
        # Every rank flushes what it wrote (on a shared file system the dirty pages live on
        # the writer's node); rank 0 fsyncs again after patching the checksums.
        os.fsync(fd)
    finally:
        os.close(fd)
    _call(hook, "before-commit", ctx)
    return sums


def _native(data: np.ndarray, stored: np.dtype) -> bool:
    return data.dtype == stored and data.flags.c_contiguous and stored.itemsize in (1, 2, 4, 8)


@functools.cache
def native_writer() -> Callable[..., None] | None:
    """The compiled write loop, or None where it cannot be built (no Numba, a libc
    without ``pwrite``/``sync_file_range``): the Python loop then writes."""
    try:
        from mpidist.checkpoint import native

        state = np.zeros(4, dtype=np.int64)
        native.write_table(-1, np.zeros((0, 6), dtype=np.int64),
                           np.zeros((1, 2), dtype=np.uint64), storage.FUSED_CHUNK_BYTES, 0,
                           np.zeros(1, dtype=np.int64), state)
    except Exception:  # noqa: BLE001 - any failure to build it means: the Python loop
        return None
    return native.write_table


def _write_native(kernel: Callable[..., None], fd: int, items: Sequence[Any],
                  offsets: np.ndarray, sums: np.ndarray, every: int,
                  ctx: WriterContext) -> None:
    from mpidist.checkpoint import native

    if not items:
        return
    table = np.array([(p.data.ctypes.data, p.data.nbytes, int(offsets[t]) + a * s.itemsize,
                       s.itemsize, a, t) for p, t, a, s in items], dtype=np.int64)
    state = np.zeros(4, dtype=np.int64)
    chunk = storage.FUSED_CHUNK_BYTES
    while True:
        kernel(fd, table, sums, chunk, every, ctx.flag, state)
        if state[3] == native.DONE:
            return
        if state[3] == native.CANCELLED:
            raise WriteCancelled(ctx.tmp)
        # pwrite failed: the rest of the chunk again from Python, for the OSError (or, if
        # it was interrupted, to go on)
        r, pos, done = (int(x) for x in state[:3])
        size = int(table[r, native.ITEMSIZE])
        n = min(max(1, chunk // size) * size, int(table[r, native.NBYTES]) - pos)
        view = memoryview(items[r][0].data.view(np.uint8))[pos + done:pos + n]
        at = int(table[r, native.OFFSET]) + pos + done
        while view.nbytes:
            k = os.pwrite(fd, view, at)
            if k <= 0:
                raise OSError(f"pwrite wrote {k} bytes at offset {at}")
            view, at = view[k:], at + k
        state[:] = (r, pos + n, 0, native.DONE)


def _write_python(fd: int, items: Sequence[Any], offsets: np.ndarray, sums: np.ndarray,
                  writeback: Writeback, ctx: WriterContext) -> None:
    def chunk_done(nbytes: int) -> None:
        if ctx.cancel.is_set():
            raise WriteCancelled(ctx.tmp)

    for p, t, a, stored in items:
        sums[t] = pwrite_array(fd, int(offsets[t]) + a * stored.itemsize, p.data, stored,
                               writeback, (int(sums[t, 0]), int(sums[t, 1])), a, chunk_done)
