"""Pipeline parallelism: stage partitioning, the schedules' runner.

A model's units are split into ``pp`` contiguous stages (:func:`partition_units`, uniform or
balanced by parameter count), or, for the interleaved schedule, into ``pp * v`` virtual
stages of which stage ``s`` holds the ``v`` non-adjacent chunks ``c * pp + s``
(:func:`cut_virtual_stages`). Each stage runs its micro-batches in the order a schedule
gives (:func:`mpidist.parallel.schedules.orders`); activations go forward and their
gradients backward between neighbouring virtual stages with nonblocking point-to-point
messages on the pp communicator (``mesh.group("pp")``, whose ranks are the pp coordinates):
the last stage's chunk ``c`` sends to the first stage's chunk ``c + 1``.

* **GPipe**: every forward, then every backward. Up to ``m`` micro-batches are live
  (forward done, backward not yet) on every stage.
* **1F1B** (PipeDream-flush): stage ``s`` of ``p`` runs ``p - s - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards. At most
  ``p - s`` micro-batches are live, with the same bubble as GPipe.

* **interleaved** (Megatron): 1F1B over the ``v`` chunks of each stage, which divides the
  bubble by ``v`` (needs ``m`` a multiple of ``pp``); every chunk's last backward is
  micro-batch ``m - 1``, chunks finishing from the last to the first.
* **zero-bubble** (ZB-H1): each backward split into the input gradient (B, sent upstream
  at once) and the weight gradients (W, deferred into the bubble).

In GPipe and 1F1B, every stage runs the backwards in micro-batch order 0..m-1, so gradients
accumulate in the same order (GPipe and 1F1B give bit-identical gradients) and the last
backward is always micro-batch ``m - 1`` (where a data-parallel model synchronises).

:class:`PipelineStage` runs one stage and measures the time it waits in receives (its idle
time: the bubble) and the peak number of live micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.comms import size_rank
from mpidist.core.timeline import span
from mpidist.parallel.schedules import SCHEDULES, orders

__all__ = [
    "SCHEDULES",
    "PipelineStage",
    "PipelineStats",
    "bubble_fraction",
    "check_schedule",
    "cut_virtual_stages",
    "partition_units",
]

#: how the stages are cut (the schedules the runtime runs, and their orders, are in
#: :mod:`mpidist.parallel.schedules`)
BALANCES = ("uniform", "parameters")

_TAG_HEADER, _TAG_ACTIVATION, _TAG_GRADIENT = 11, 12, 13
_TAG_CHUNK = 8  # tags of messages to chunk c: the tags above + 8 * c
_HEADER = 8  # int64 words: ndim, dtype code, up to 6 dims
_DTYPES = [np.dtype(t) for t in (np.float32, np.float64, np.int64, np.int32, np.float16)]
try:  # bfloat16 activations (mixed precision on a GPU)
    import ml_dtypes

    _DTYPES.append(np.dtype(ml_dtypes.bfloat16))
except ImportError:  # pragma: no cover - without ml_dtypes there is no bfloat16 to send
    pass


def check_schedule(schedule: str) -> str:
    """The schedule name, lower-cased; ValueError naming it unless one of :data:`SCHEDULES`.
    Pure."""
    s = str(schedule).lower()
    if s not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    return s


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """The ideal idle fraction ``(p - 1) / (m + p - 1)`` of GPipe and 1F1B."""
    return (pp - 1) / (micro_batches + pp - 1)


# -- partitioning ----------------------------------------------------------------------------
def partition_units(weights: Sequence[int], pp: int, balance: str = "uniform"
                    ) -> list[tuple[int, int]]:
    """Split ``len(weights)`` units into ``pp`` contiguous non-empty stages. Pure.

    ``balance="uniform"`` gives every stage ``n // pp`` units (the first ``n % pp`` stages
    one more); ``"parameters"`` minimises the largest stage's total weight (parameter count).
    Returns ``[(start, stop), ...]`` per stage. ValueError if ``pp`` exceeds the units.
    """
    n = len(weights)
    if isinstance(pp, bool) or not isinstance(pp, (int, np.integer)) or pp < 1:
        raise ValueError(f"pp={pp!r} must be a positive integer")
    if pp > n:
        raise ValueError(f"pp={pp} is larger than the number of units ({n})")
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r} is not one of {BALANCES}")
    if balance == "uniform":
        base, extra = divmod(n, pp)
        sizes = [base + (1 if s < extra else 0) for s in range(pp)]
    else:
        sizes = _balanced_sizes([int(w) for w in weights], pp)
    out, start = [], 0
    for k in sizes:
        out.append((start, start + k))
        start += k
    return out


def cut_stages(units: Sequence[Any], pp: int, balance: str = "uniform"
               ) -> tuple[list[tuple[int, int]], list[list[str]]]:
    """Cut a model's ``units`` (modules with ``named_parameter_shapes()``) into ``pp``
    pipeline stages: ``([(start, stop) per stage], [tensor names per stage])``. Pure;
    ValueError (see :func:`partition_units`) when they cannot be cut so."""
    shapes = [u.named_parameter_shapes() for u in units]
    bounds = partition_units([sum(int(np.prod(s)) for _, s in sh) for sh in shapes], pp,
                             balance)
    names = [[n for sh in shapes[a:b] for n, _ in sh] for a, b in bounds]
    return bounds, names


def cut_virtual_stages(units: Sequence[Any], pp: int, virtual_stages: int = 1,
                       balance: str = "uniform"
                       ) -> tuple[list[tuple[int, int]], list[list[str]]]:
    """Cut ``units`` into ``pp * virtual_stages`` virtual stages, stage ``s`` holding the
    chunks (virtual stages) ``c * pp + s``: ``([(start, stop) per virtual stage], [tensor
    names per stage, its chunks in order])``; with one virtual stage, :func:`cut_stages`.
    Pure; ValueError naming the values when there are fewer units than virtual stages."""
    v = virtual_stages
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"virtual_stages={v!r} must be a positive integer")
    if v > 1 and len(units) < pp * v:
        raise ValueError(f"virtual_stages={v} with pp={pp} needs at least {pp * v} units "
                         f"(pp x virtual_stages chunks); the model has {len(units)}")
    bounds, names = cut_stages(units, pp * v, balance)
    return bounds, [[n for c in range(v) for n in names[c * pp + s]] for s in range(pp)]


def _balanced_sizes(w: list[int], pp: int) -> list[int]:
    # Linear partition by dynamic programming: best[k][i] = least possible max stage weight
    # of the first i units in k stages. n and pp are small (units of a model).
    n = len(w)
    prefix = np.concatenate([[0], np.cumsum(w)]).astype(np.int64)
    inf = np.iinfo(np.int64).max
    best = np.full((pp + 1, n + 1), inf, dtype=np.int64)
    cut = np.zeros((pp + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0
    for k in range(1, pp + 1):
        for i in range(k, n - (pp - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1, j] == inf:
                    continue
                cost = max(int(best[k - 1, j]), int(prefix[i] - prefix[j]))
                if cost < best[k, i]:
                    best[k, i], cut[k, i] = cost, j
    sizes, i = [], n
    for k in range(pp, 0, -1):
        j = int(cut[k, i])
        sizes.append(i - j)
        i = j
    return sizes[::-1]


# -- running one stage ----------------------------------------------------------------------
@dataclass
class PipelineStats:
    """What one :meth:`PipelineStage.run` measured on this stage."""

    seconds: float = 0.0  # wall time of the whole schedule, sends included
    wait_seconds: float = 0.0  # time blocked in receives (the bubble, seen by this stage)
    send_wait_seconds: float = 0.0  # time waiting for sends to complete at the end
    #: most micro-batches holding activations: forward done, and backward (under the
    #: zero-bubble schedule, its deferred weight gradients, W) not yet
    peak_live: int = 0
    messages: int = 0

    @property
    def idle_fraction(self) -> float:
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0


class PipelineStage:
    """One stage of a pipeline: runs a schedule over micro-batches on the pp communicator.

    Args:
        forward: ``forward(x, ctx) -> y`` of this stage's units (with ``virtual_stages``
            > 1: ``forward(x, ctx, chunk)`` of one chunk's).
        backward: ``backward(dy, ctx) -> dx`` of this stage's units (dx is ignored on the
            first stage; with ``virtual_stages`` > 1 ``backward(dy, ctx, chunk)``). Under
            GPipe and 1F1B called for micro-batches 0..m-1 in order. Under the zero-bubble
            schedule it computes the input gradient only (B), and
        backward_weight: ``backward_weight(ctx)`` the weight gradients (W), deferred into
            the bubble (required by the zero-bubble schedule).
        comm: the pp communicator (rank = stage index); None for a single stage.
        xp: the array library activations are received into (NumPy, or CuPy on a GPU).
        loss: on the last stage, ``loss.forward(y, target, normalizer=, ctx=) -> float`` and
            ``loss.backward(ctx=) -> dy``.
        virtual_stages: the chunks this stage holds (the interleaved schedule): chunk ``c``
            is virtual stage ``c * pp + stage``.

    ``run`` is collective over ``comm``: every stage runs it with the same number of
    micro-batches, schedule and virtual stages. Messages carry a small header with the
    activation's shape and dtype, so stages need not know each other's output shapes;
    their tags say the chunk they go to, so the messages of different chunks between
    the same two stages never mix.
    """

    def __init__(self, forward: Callable[..., Any], backward: Callable[..., Any],
                 *, comm: Any = None, loss: Any = None,
                 backward_weight: Callable[[Any], None] | None = None,
                 virtual_stages: int = 1, xp: Any = np) -> None:
        self.xp = xp
        self.forward = forward
        self.backward = backward
        self.backward_weight = backward_weight
        self.comm = comm
        self.n_stages, self.stage = size_rank(comm)
        self.loss = loss
        self.virtual_stages = int(virtual_stages)
        self.stats = PipelineStats()
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.n_stages - 1

    # -- messages -------------------------------------------------------------------------
    def _next(self, chunk: int) -> tuple[int, int]:
        """The (stage, chunk) of the virtual stage after this stage's ``chunk``."""
        s = self.stage + 1
        return (s, chunk) if s < self.n_stages else (0, chunk + 1)

    def _previous(self, chunk: int) -> tuple[int, int]:
        """The (stage, chunk) of the virtual stage before this stage's ``chunk``."""
        return (self.stage - 1, chunk) if self.stage > 0 else (self.n_stages - 1, chunk - 1)

    def _send_activation(self, y: np.ndarray, chunk: int = 0) -> list[C.Request]:
        y = self.xp.ascontiguousarray(y)
        if y.ndim > _HEADER - 2 or y.dtype not in _DTYPES:
            raise ValueError(
                f"stage {self.stage}: cannot send an activation of shape {y.shape}, "
                f"dtype {y.dtype} (at most {_HEADER - 2} dims of {[d.name for d in _DTYPES]})"
            )
        head = np.zeros(_HEADER, dtype=np.int64)
        head[0], head[1] = y.ndim, _DTYPES.index(y.dtype)
        head[2:2 + y.ndim] = y.shape
        dst, to = self._next(chunk)
        self.stats.messages += 2
        return [C.isend(head, dst, comm=self.comm, tag=_TAG_HEADER + _TAG_CHUNK * to),
                C.isend(y, dst, comm=self.comm, tag=_TAG_ACTIVATION + _TAG_CHUNK * to)]

    def _recv_activation(self, chunk: int = 0) -> np.ndarray:
        src, _ = self._previous(chunk)
        head = np.empty(_HEADER, dtype=np.int64)
        t0 = time.perf_counter()
        C.irecv(head, src, comm=self.comm, tag=_TAG_HEADER + _TAG_CHUNK * chunk).wait()
        nd = int(head[0])
        x = self.xp.empty(tuple(int(d) for d in head[2:2 + nd]), dtype=_DTYPES[int(head[1])])
        C.irecv(x, src, comm=self.comm, tag=_TAG_ACTIVATION + _TAG_CHUNK * chunk).wait()
        self.stats.wait_seconds += time.perf_counter() - t0
        return x

    def _recv_gradient(self, shape: tuple[int, ...], dtype: np.dtype, chunk: int = 0
                       ) -> np.ndarray:
        dy = self.xp.empty(shape, dtype=dtype)
        src, _ = self._next(chunk)
        t0 = time.perf_counter()
        C.irecv(dy, src, comm=self.comm, tag=_TAG_GRADIENT + _TAG_CHUNK * chunk).wait()
        self.stats.wait_seconds += time.perf_counter() - t0
        return dy

    def _send_gradient(self, dx: Any, chunk: int) -> C.Request:
        if dx is None:
            raise ValueError(f"stage {self.stage}: backward returned no input gradient to "
                             f"send to stage {self._previous(chunk)[0]}")
        dst, to = self._previous(chunk)
        self.stats.messages += 1
        return C.isend(self.xp.ascontiguousarray(dx), dst, comm=self.comm,
                       tag=_TAG_GRADIENT + _TAG_CHUNK * to)

    def _order(self, schedule: str, m: int, train: bool) -> list[tuple[str, int, int]]:
        """This stage's ``(kind, micro-batch, chunk)`` operations (ValueError, the same on
        every stage, for a schedule that cannot run)."""
        v = self.virtual_stages
        if not train:  # evaluation: every forward, chunk by chunk
            return [("F", i, c) for c in range(v) for i in range(m)]
        schedule = check_schedule(schedule)
        if schedule == "zero-bubble" and self.backward_weight is None:
            raise ValueError("the zero-bubble schedule needs backward_weight")
        return orders(schedule, self.n_stages, m, v)[self.stage]

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, the chunk (the last argument) left out with one virtual stage."""
        return fn(*args) if self.virtual_stages > 1 else fn(*args[:-1])

    # -- the schedule -----------------------------------------------------------------------
    def run(self, inputs: Sequence[Any], targets: Sequence[Any] | None = None, *,
            schedule: str = "1f1b", normalizer: float | None = None,
            train: bool = True) -> float:
        """Run every micro-batch forward and backward; returns the sum of the micro-batch
        losses on the last stage (0.0 elsewhere). Collective over the pp communicator.

        ``inputs[i]`` is micro-batch i's input (read on the first stage only);
        ``targets[i]`` its target (read on the last stage only). Statistics are in
        :attr:`stats`. With ``train=False`` only the forwards run (evaluation).
        """
        m = len(inputs)
        order = self._order(schedule, m, train)
        if self.is_last and (self.loss is None or targets is None or len(targets) != m):
            raise ValueError(f"the last stage needs a loss and {m} targets")
        last_chunk = self.virtual_stages - 1
        self.stats = PipelineStats()
        sends: list[C.Request] = []
        sent_shape: dict[tuple[int, int], tuple[tuple[int, ...], np.dtype]] = {}
        total = 0.0
        live = 0
        t_start = time.perf_counter()
        for kind, i, c in order:
            first = self.is_first and c == 0
            last = self.is_last and c == last_chunk
            # (the trace's block of this operation: its computation, not its receive)
            block = (f"{kind} {i}" + (f" c{c}" if self.virtual_stages > 1 else ""),
                     "pipeline")
            info = {"kind": kind, "micro_batch": i, "chunk": c, "stage": self.stage}
            if kind == "F":
                x = inputs[i] if first else self._recv_activation(c)
                with span(*block, **info):
                    y = self._call(self.forward, x, i, c)
                    if last and targets is not None:  # (checked above: the last has them)
                        total += self.loss.forward(y, targets[i], normalizer=normalizer,
                                                   ctx=i)
                if not last or targets is None:
                    y = self.xp.ascontiguousarray(y)
                    sent_shape[(i, c)] = (y.shape, y.dtype)
                    sends += self._send_activation(y, c)
                live += 1
                self.stats.peak_live = max(self.stats.peak_live, live)
            elif kind == "W":
                # No wait here for the input gradient just sent upstream: its receiver may
                # post the receive only after operations of its own, and waiting for that
                # idled this rank (zero-bubble at 0.96 of 1F1B's step instead of 0.87-0.90
                # at p=2, m=4); the receiver takes a large message when it gets to it.
                with span(*block, **info):
                    self.backward_weight(i)  # type: ignore[misc]
                live -= 1  # what the W kept (the layers' inputs) is released
            else:  # "B" (the input gradient) or "BW" (a whole backward)
                dy = None if last else self._recv_gradient(*sent_shape.pop((i, c)), chunk=c)
                with span(*block, **info):
                    if dy is None:
                        dy = self.loss.backward(ctx=i)
                    dx = self._call(self.backward, dy, i, c)
                if not first:
                    sends.append(self._send_gradient(dx, c))
                if kind == "BW":
                    live -= 1
            # Completed sends release their buffers (and drive MPI progress).
            sends = [r for r in sends if not r.test()]
        t0 = time.perf_counter()
        C.wait_all(sends)
        t1 = time.perf_counter()
        self.stats.send_wait_seconds = t1 - t0
        self.stats.seconds = t1 - t_start
        return total
