"""The tensor side of the "mpidist" torch.distributed backend: MPI buffers of torch tensors,
element types, reductions, Work objects and the watchdog (docs/torch.md describes each).

Data movement carries any dtype bit for bit, as unsigned words of the element's size.
Reductions run in MPI on the types MPI has; float16, bfloat16 and float8 are reduced in
float32. ``AVG`` is a sum divided once by the group size; ``PREMUL_SUM`` scales each
input first; on bool tensors the ops are logical. The watchdog ends the job with
``MPI_Abort`` when an operation outlives its group's timeout (an MPI call cannot be
interrupted); ``Work.wait(timeout)`` with an explicit timeout raises instead.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mpidist.core.comms import mpi, test_all, wait_all
from mpidist.run.launch.guard import abort_with

__all__ = [
    "CommThread",
    "Reduction",
    "Work",
    "as_host",
    "reduction",
    "spec",
    "watch",
    "words",
    "words_array",
]

RedOpType = dist.ReduceOp.RedOpType

# torch dtype -> name of the MPI datatype that reduces it.
_REDUCE_TYPES = {
    torch.float32: "FLOAT", torch.float64: "DOUBLE",
    torch.int8: "INT8_T", torch.int16: "INT16_T", torch.int32: "INT32_T", torch.int64: "INT64_T",
    torch.uint8: "UINT8_T", torch.bool: "C_BOOL",
    torch.complex64: "C_FLOAT_COMPLEX", torch.complex128: "C_DOUBLE_COMPLEX",
}
for _name, _mpi_name in (("uint16", "UINT16_T"), ("uint32", "UINT32_T"), ("uint64", "UINT64_T")):
    if hasattr(torch, _name):
        _REDUCE_TYPES[getattr(torch, _name)] = _mpi_name
# Floating types MPI has no datatype for: reduced in float32.
_UPCAST = {torch.float16, torch.bfloat16} | {
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)}
# element size -> the torch dtype and MPI datatype of the words that carry it bit for bit
_WORDS = {1: (torch.uint8, "UINT8_T"), 2: (torch.int16, "UINT16_T"),
          4: (torch.int32, "UINT32_T"), 8: (torch.int64, "UINT64_T")}

_MPI_OPS = {
    RedOpType.SUM: "SUM", RedOpType.AVG: "SUM", RedOpType.PREMUL_SUM: "SUM",
    RedOpType.PRODUCT: "PROD", RedOpType.MIN: "MIN", RedOpType.MAX: "MAX",
    RedOpType.BAND: "BAND", RedOpType.BOR: "BOR", RedOpType.BXOR: "BXOR",
}
_BOOL_OPS = {
    RedOpType.SUM: "LOR", RedOpType.MAX: "LOR", RedOpType.BOR: "LOR",
    RedOpType.PRODUCT: "LAND", RedOpType.MIN: "LAND", RedOpType.BAND: "LAND",
    RedOpType.BXOR: "LXOR",
}
_BITWISE = {RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR}
# Reductions mpidist.core.collectives runs (on its reducible types): op -> its name there. AVG is
# a sum there, divided here (once, truncated for integers); PREMUL_SUM's inputs are scaled
# before.
_PLAIN_OPS = {RedOpType.SUM: "sum", RedOpType.AVG: "sum", RedOpType.PREMUL_SUM: "sum",
              RedOpType.MIN: "min", RedOpType.MAX: "max"}
_PLAIN_TYPES = {torch.float32, torch.float64, torch.int32, torch.int64}
_ORDERED = {RedOpType.MIN, RedOpType.MAX}


def _word_size(size: int) -> int:
    """Bytes of the words that carry elements of ``size`` bytes (8 for larger multiples of
    8, else 1)."""
    return size if size in _WORDS else 8 if size % 8 == 0 else 1


def words_array(t: torch.Tensor) -> Any:
    """A NumPy view of a contiguous CPU tensor's bytes as integer words of its element size
    (8-byte words for larger elements): what mpidist.core.collectives moves bit for bit."""
    word = _WORDS[_word_size(t.element_size())][0]
    flat = t.detach().reshape(-1)
    return flat.view(word).numpy() if flat.numel() else torch.empty(0, dtype=word).numpy()


def words(dtype: torch.dtype) -> tuple[Any, int]:
    """(MPI datatype, words per element) that carry ``dtype`` bit for bit."""
    size = _word_size(dtype.itemsize)
    return getattr(mpi(), _WORDS[size][1]), dtype.itemsize // size


# -- tensors as MPI buffers -----------------------------------------------------------------
def as_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``t``'s values: ``t`` itself when it already is one.

    A CUDA tensor is staged in pinned host memory (torch's caching host allocator) by a
    blocking copy on the current stream: it starts after the kernels queued there and
    returns when the values are on the host, so MPI never reads memory still being
    written. (As with torch's own backends, work on other streams must be ordered before
    the call by the caller.)"""
    host = scratch(t)
    if host is not t:
        host.copy_(t.detach())
    return host


def scratch(t: torch.Tensor) -> torch.Tensor:
    """An output buffer for ``t``: ``t`` itself when MPI can write it directly, else a
    contiguous CPU tensor (pinned for a CUDA tensor) whose result :func:`write_back`
    copies into ``t``."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)


def write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a result from its buffer into the user's tensor (nothing when they are one)."""
    if src is not dst:
        with torch.no_grad():
            dst.copy_(src.reshape(dst.shape))


def _memory(t: torch.Tensor) -> Any:
    # A NumPy view of the bytes keeps the tensor alive for as long as MPI holds the buffer
    # (a raw address would not).
    if t.numel() == 0:
        return bytearray(0)
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def spec(t: torch.Tensor, datatype: Any = None, parts: int = 1) -> list[Any]:
    """``[buffer, count, datatype]`` of a contiguous CPU tensor: its elements in
    ``datatype`` (for reductions), else in the words that carry its dtype. ``parts``: the
    count is per part (the receive buffer of an allgather holds one part per rank)."""
    if datatype is not None:
        return [_memory(t), t.numel() // parts, datatype]
    word, per = words(t.dtype)
    return [_memory(t), t.numel() * per // parts, word]


def counts_spec(t: torch.Tensor, counts: Sequence[int]) -> list[Any]:
    """``[buffer, (counts, displacements), datatype]`` for a vector collective over a
    contiguous CPU tensor split into pieces of ``counts`` elements."""
    word, per = words(t.dtype)
    sizes = [c * per for c in counts]
    return [_memory(t), (sizes, [0, *itertools.accumulate(sizes)][:-1]), word]


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two CPU tensors overlaps."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


# -- reductions -----------------------------------------------------------------------------
class Reduction:
    """How one ``ReduceOp`` on one dtype runs: the MPI op, the dtype on the wire, the
    premultiplying factor and whether the sum is averaged."""

    def __init__(self, op: Any, dtype: torch.dtype, what: str) -> None:
        kind = getattr(op, "op", op)
        name = getattr(kind, "name", str(kind))
        if kind not in _MPI_OPS:
            raise ValueError(f"{what}: ReduceOp {name} is not supported by the mpidist backend")
        floating = dtype.is_floating_point or dtype.is_complex
        if dtype == torch.bool:
            if kind not in _BOOL_OPS:
                raise ValueError(f"{what}: ReduceOp.{name} is not defined on bool tensors")
            self.op_name = _BOOL_OPS[kind]
        else:
            if kind in _BITWISE and floating:
                raise ValueError(f"{what}: ReduceOp.{name} needs an integer or bool tensor; "
                                 f"got {dtype}")
            if kind in _ORDERED and dtype.is_complex:
                raise ValueError(f"{what}: ReduceOp.{name} is not defined on {dtype}")
            self.op_name = _MPI_OPS[kind]
        self.wire = torch.float32 if dtype in _UPCAST else dtype
        if self.wire not in _REDUCE_TYPES:
            raise ValueError(f"{what}: the mpidist backend cannot reduce {dtype} tensors")
        self.datatype = getattr(mpi(), _REDUCE_TYPES[self.wire])
        self.avg = kind == RedOpType.AVG
        # the op mpidist.core.collectives runs for this reduction (None: MPI's own op, here)
        self.plain = _PLAIN_OPS.get(kind) if self.wire in _PLAIN_TYPES else None
        self.factor: Any = op.factor if kind == RedOpType.PREMUL_SUM else None
        self.name = name

    @property
    def mpi_op(self) -> Any:
        return getattr(mpi(), self.op_name)

    def prepare(self, t: torch.Tensor) -> torch.Tensor:
        """The contiguous CPU tensor MPI reduces for ``t``: ``t`` itself when possible."""
        if self.factor is not None:
            factor = self.factor
            if isinstance(factor, torch.Tensor):
                factor = factor.detach().to("cpu", self.wire).reshape(())
            return t.detach().to("cpu", self.wire) * factor
        if t.dtype != self.wire:
            return t.detach().to("cpu", self.wire)
        return as_host(t)

    def finish(self, wire: torch.Tensor, size: int, out: torch.Tensor | None = None) -> None:
        """Average ``wire`` (a reduced buffer) if asked, then copy it into ``out``."""
        if self.avg and size > 1:
            if wire.dtype.is_floating_point or wire.dtype.is_complex:
                wire.div_(size)
            else:
                wire.div_(size, rounding_mode="trunc")
        if out is not None:
            write_back(out, wire)


_REDUCTIONS: dict[tuple[Any, torch.dtype], Reduction] = {}


def reduction(op: Any, dtype: torch.dtype, what: str) -> Reduction:
    """:class:`Reduction` of ``op`` on ``dtype``; ValueError naming both if unsupported.
    (Made once per op and dtype, except PREMUL_SUM, whose factor varies.)"""
    kind = getattr(op, "op", op)
    cached = _REDUCTIONS.get((kind, dtype))
    if cached is not None:
        return cached
    made = Reduction(op, dtype, what)
    if kind != RedOpType.PREMUL_SUM:
        _REDUCTIONS[(kind, dtype)] = made
    return made


# -- watchdog -------------------------------------------------------------------------------
class _Watchdog:
    """Deadlines of the operations in flight, checked by one daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[int, tuple[float, float, Any, int]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def start(self, deadline: float, what: str | Callable[[], str]) -> int:
        with self._lock:
            self._next += 1
            token = self._next
            self._active[token] = (time.monotonic(), deadline, what, threading.get_ident())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mpidist-watchdog",
                                                daemon=True)
                self._thread.start()
        return token

    def stop(self, token: int) -> None:
        with self._lock:
            self._active.pop(token, None)

    def _run(self) -> None:
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            with self._lock:
                late = [(s, w, t) for s, d, w, t in self._active.values() if now > d]
            if late:
                started, what, thread = late[0]
                what = what() if callable(what) else what
                frame = sys._current_frames().get(thread)
                where = "".join(traceback.format_stack(frame)[-12:]) if frame else ""
                abort_with(mpi().COMM_WORLD,
                           f"mpidist backend: {what} has not completed after "
                           f"{now - started:.0f} s, past its group's timeout; ending the job "
                           f"(MPI_Abort). It was called from:\n{where}",
                           1, sys.__stderr__ or sys.stderr)


_WATCHDOG = _Watchdog()


class watch:  # noqa: N801 - used as a statement: ``with watch(...):``
    """Register an operation with the watchdog for its duration (see the module docstring).
    ``what`` names it, or is a function that does (called only if it times out)."""

    __slots__ = ("_deadline", "_token", "_what")

    def __init__(self, what: str | Callable[[], str], timeout: timedelta) -> None:
        self._what = what
        self._deadline = max(timeout.total_seconds(), 0.001)
        self._token = 0

    def __enter__(self) -> None:
        self._token = _WATCHDOG.start(time.monotonic() + self._deadline, self._what)

    def __exit__(self, *exc: Any) -> None:
        _WATCHDOG.stop(self._token)


_ABANDONED: list[Any] = []  # requests left behind by a timeout: MPI may still use them


def abandon(request: Any) -> None:
    """Keep a request that timed out alive for as long as MPI may touch it."""
    _ABANDONED.append(request)


def poll(test: Callable[[], bool], seconds: float) -> bool:
    """Call ``test`` (which drives MPI progress) until it is true or ``seconds`` have
    passed; True when it became true. Spins at first, then sleeps between tests."""
    deadline = time.monotonic() + max(seconds, 0.0)
    spins = 0
    while not test():
        if time.monotonic() >= deadline:
            return False
        spins += 1
        if spins > 1000:
            time.sleep(0.0002)
    return True


def wait_until(request: Any, seconds: float, pending: dict[Any, Any] | None = None) -> bool:
    """Poll ``request`` (or every request of ``pending``) until done or ``seconds`` have
    passed; True when done. A request not done is abandoned (:func:`abandon`)."""
    requests = [request] if pending is None else list(pending.values())
    if poll(lambda: test_all(requests), seconds):
        return True
    if pending is None:
        abandon(request)
    return False


# -- works ----------------------------------------------------------------------------------
class Work(dist.Work):
    """The handle of one backend operation, as torch's ``Work``.

    Collectives complete before the call returns (their Work is already done); point-to-point
    operations hold MPI requests that :meth:`wait` completes. ``finish`` (copying a staged
    result into the user's tensor) runs once, when the requests are done. The tensors MPI
    reads or writes are kept alive until then.
    """

    def __init__(self, result: list[torch.Tensor], requests: Sequence[Any] = (),
                 finish: Callable[[], None] | None = None, keep: tuple = (),
                 what: str = "", timeout: timedelta = timedelta(minutes=30),
                 pending: bool = False) -> None:
        super().__init__()
        self._result = result
        self._requests = list(requests)
        self._finish = finish
        self._keep = keep
        self._what = what
        self._timeout = timeout
        self._statuses = [mpi().Status() for _ in self._requests]
        self._source = -1
        self._future: torch.futures.Future | None = None
        # pending: run by a communication thread, which calls _ran() when done
        self._event = threading.Event() if pending else None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._done = not self._requests and not pending
        if self._done:
            self._complete()

    def _ran(self, error: BaseException | None = None) -> None:
        """The communication thread has run the operation (or failed with ``error``)."""
        with self._lock:
            self._error = error
            self._done = True
            future = self._future
        if future is not None:
            self._settle(future)
        if self._event is not None:
            self._event.set()

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        self._keep = ()
        if self._statuses:
            self._source = self._statuses[0].Get_source()
        if self._future is not None:
            self._settle(self._future)

    def _settle(self, future: torch.futures.Future) -> None:
        if not future.done():
            if self._error is None:
                future.set_result(self._result)
            else:
                future.set_exception(self._error)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Complete the operation. With a positive ``timeout``: RuntimeError when it has not
        completed by then (the operation stays pending)."""
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        if self._event is not None:  # run by the communication thread
            done = self._event.wait(seconds if seconds > 0 else None)
        elif self._done:
            return True
        elif seconds > 0:
            done = poll(self._test, seconds)
        else:
            with watch(self._what, self._timeout):
                wait_all(self._requests, self._statuses)
            self._complete()
            return True
        if not done:
            raise RuntimeError(f"{self._what}: Timed out after {seconds:g} s in wait()")
        if self._error is not None:
            raise self._error
        return True

    def _test(self) -> bool:
        if not test_all(self._requests, self._statuses):
            return False
        self._complete()
        return True

    def is_completed(self) -> bool:
        """Whether the operation has completed (drives MPI progress). Not collective."""
        if self._event is not None:
            return self._event.is_set()
        return self._done or self._test()

    def is_success(self) -> bool:
        """Whether the operation completed without error."""
        return self.is_completed() and self._error is None

    def exception(self) -> Any:
        """The exception the operation ended with, if any (a failed MPI call ends the job
        instead)."""
        return self._error

    def synchronize(self) -> None:
        """Same as :meth:`wait`."""
        self.wait()

    def result(self) -> list[torch.Tensor]:
        """The operation's output tensors (after :meth:`wait`)."""
        self.wait()
        return self._result

    @property
    def outputs(self) -> list[torch.Tensor]:
        """The tensors the operation writes its result into (complete after a wait)."""
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A future completed with the output tensors. A pending operation is completed
        first, so waiting on the future (also from C++) never blocks forever."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
            future, running = self._future, self._event is not None and not self._done
        if running:  # the communication thread completes it
            return future
        if not self._done:
            self.wait()
        self._settle(future)
        return future

    def source_rank(self) -> int:
        """The rank (in the group) a receive from any source got its message from."""
        self.wait()
        return self._source

    def _source_rank(self) -> int:
        return self.source_rank()


class CommThread:
    """Runs one group's MPI calls on a thread of its own, in the order they were issued, so
    that they progress while the issuing thread computes (mpi4py releases the GIL inside MPI
    calls). ``submit`` queues a job and its pending Work; ``drain`` waits for the queue."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], work: Work) -> None:
        """Queue ``job``; ``work._ran()`` is called when it has run."""
        with self._idle:
            self._pending += 1
        self._queue.put((job, work))

    def drain(self) -> None:
        """Wait until every queued job has run."""
        with self._idle:
            while self._pending:
                self._idle.wait()

    def close(self) -> None:
        """Run what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, work = item
            try:
                job()
            except BaseException as exc:  # handed to whoever waits on the work
                work._ran(exc)
            else:
                work._ran()
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


class CoalescedWork(Work):
    """The Work of several operations (a coalesced batch): waits for each."""

    def __init__(self, works: Sequence[Work], result: list[torch.Tensor]) -> None:
        self._works = list(works)
        super().__init__(result, requests=(), what="coalesced operations")
        self._done = all(w._done for w in self._works)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for w in self._works:
            w.wait(timeout)
        self._done = True
        return True

    def _test(self) -> bool:
        self._done = all(w.is_completed() for w in self._works)
        return self._done
