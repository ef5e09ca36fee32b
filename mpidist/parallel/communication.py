"""Communication-efficient data parallelism: Local SGD, gradient compression, async SGD.

Three strategies built on the DDP machinery (:mod:`mpidist.parallel.ddp`), each trading
exactness of the synchronous DDP step for less (or later) communication:

* :class:`LocalSGDOptimizer` — every rank takes ``sync_every`` local steps on its own
  gradient, then the replicas are averaged with one allreduce of the flat parameter buffer
  (optionally with the optimizer state in the same message).
* :class:`GradientCompressionOptimizer` — DDP's bucketed, overlapped gradient exchange with
  each bucket compressed: 16-bit floats (``fp16``, ``bf16``), top-k sparsification with
  error feedback (``topk``) or low-rank PowerSGD with error feedback (``powersgd``).
* :class:`AsyncSGDOptimizer` — the gradient of step t is allreduced with a nonblocking call
  that may stay in flight for up to ``staleness`` steps while later steps compute.

Every byte a strategy sends is counted where it is handed to MPI: the gradient/parameter
exchange goes through a :class:`CountingComm`, a thin proxy over the dp communicator that
adds the size of each send buffer passed to an MPI call (for in-place calls, the part of
the buffer this rank contributes). ``bytes_sent`` counters are therefore measured, not
derived from formulas. The base step's control messages (the 16-byte batch-size check and
the 8-byte loss allreduce) do not go through the proxy and are not counted.

Loss convention (see :mod:`mpidist.parallel.engine`): each rank normalises its local loss
by the global number of samples, so summing gradients over the dp group gives the global
mean gradient, and a rank's own gradient times the dp size is its local-mean gradient.

All exchanges here run on host (NumPy) arrays.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpidist import collectives as C
from mpidist.parallel.ddp import DDPModel
from mpidist.parallel.engine import ShardedModel, ShardedOptimizer

__all__ = [
    "METHODS",
    "AsyncSGDModel",
    "AsyncSGDOptimizer",
    "CountingComm",
    "GradientCompressionModel",
    "GradientCompressionOptimizer",
    "LocalSGDModel",
    "LocalSGDOptimizer",
    "PowerSGDCodec",
    "TopKCodec",
    "bf16_decode",
    "bf16_encode",
]

METHODS = ("none", "fp16", "bf16", "topk", "powersgd")


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


# -- measuring what is sent ---------------------------------------------------------------------
def _spec_bytes(spec: Any, skip: int | None = None) -> int:
    """Bytes of an mpi4py buffer spec: an array, or ``[array, (counts, displs), type]``."""
    if isinstance(spec, np.ndarray):
        return int(spec.nbytes)
    if isinstance(spec, (list, tuple)):
        arr = spec[0]
        if len(spec) >= 2 and isinstance(spec[1], (list, tuple)) and len(spec[1]) == 2 \
                and isinstance(spec[1][0], (list, tuple, np.ndarray)):
            counts = [int(c) for i, c in enumerate(spec[1][0]) if i != skip]
            return int(sum(counts)) * np.asarray(arr).itemsize
        return int(np.asarray(arr).nbytes)
    return int(memoryview(spec).nbytes)


class CountingComm:
    """A proxy over an mpi4py intracommunicator that counts the bytes this rank sends.

    Every collective called through it adds the size of the send buffer it is handed:
    the whole buffer for (all)reduce, this rank's segment for an in-place allgather, and
    the counts addressed to other ranks for ``Alltoallv``. Everything else (``Get_size``,
    ``Get_rank``...) is forwarded unchanged, so the proxy can be passed as ``comm=`` to
    :mod:`mpidist.collectives`. ``calls`` counts MPI calls, ``bytes`` the bytes sent.
    """

    def __init__(self, comm: Any, *, totals: CountingComm | None = None) -> None:
        self._comm = comm
        self._totals = totals  # another counter that also receives every count
        self.bytes = 0
        self.calls = 0
        self.by_op: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    @property
    def comm(self) -> Any:
        """The wrapped communicator."""
        return self._comm

    def _add(self, op: str, nbytes: int) -> None:
        self.bytes += int(nbytes)
        self.calls += 1
        self.by_op[op] = self.by_op.get(op, 0) + int(nbytes)
        if self._totals is not None:
            self._totals._add(op, nbytes)

    def _in_place(self, sendbuf: Any) -> bool:
        return sendbuf is _mpi().IN_PLACE

    def _reduce(self, name: str, sendbuf: Any, recvbuf: Any, *args: Any, **kw: Any) -> Any:
        self._add(name, _spec_bytes(recvbuf if self._in_place(sendbuf) else sendbuf))
        return getattr(self._comm, name)(sendbuf, recvbuf, *args, **kw)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, *a: Any, **kw: Any) -> Any:  # noqa: N802
        return self._reduce("Allreduce", sendbuf, recvbuf, *a, **kw)

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, *a: Any, **kw: Any) -> Any:  # noqa: N802
        return self._reduce("Iallreduce", sendbuf, recvbuf, *a, **kw)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, *a: Any, **kw: Any) -> Any:  # noqa: N802
        return self._reduce("Reduce_scatter_block", sendbuf, recvbuf, *a, **kw)

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, *a: Any, **kw: Any) -> Any:  # noqa: N802
        return self._reduce("Ireduce_scatter_block", sendbuf, recvbuf, *a, **kw)

    def _gather(self, name: str, sendbuf: Any, recvbuf: Any) -> Any:
        if self._in_place(sendbuf):
            nbytes = _spec_bytes(recvbuf) // self._comm.Get_size()
        else:
            nbytes = _spec_bytes(sendbuf)
        self._add(name, nbytes)
        return getattr(self._comm, name)(sendbuf, recvbuf)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        return self._gather("Allgather", sendbuf, recvbuf)

    def Iallgather(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        return self._gather("Iallgather", sendbuf, recvbuf)

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any) -> Any:  # noqa: N802
        self._add("Ialltoallv", _spec_bytes(sendbuf, skip=self._comm.Get_rank()))
        return self._comm.Ialltoallv(sendbuf, recvbuf)

    def Bcast(self, buf: Any, root: int = 0) -> Any:  # noqa: N802
        if self._comm.Get_rank() == root:
            self._add("Bcast", _spec_bytes(buf))
        return self._comm.Bcast(buf, root=root)


_IN_FLIGHT: list[_Chain] = []


class _Chain:
    """A multi-phase nonblocking exchange with DDP's request interface (``wait``/``test``).

    ``then()`` runs when the current phase's MPI requests are complete and returns the next
    phase ``(requests, then)`` or None when the exchange is finished.

    Nonblocking collectives must be started in the same order on every rank of a
    communicator, but phase 1 of different buckets completes in a timing-dependent order.
    So a two-phase chain starts its second phase on a second communicator, and only when it
    is at the head of the shared ``gate`` queue (chains enter it in bucket-start order):
    second phases therefore start in bucket order on every rank.
    """

    def __init__(self, reqs: Sequence[Any], then: Callable[[], Any] | None,
                 gate: deque[_Chain] | None = None) -> None:
        self._reqs = list(reqs)
        self._then = then
        self._gate = gate
        if gate is not None:
            gate.append(self)
        # An exchange still in flight must outlive whoever started it: were its MPI
        # requests (and with them its buffers) garbage-collected, MPI would write into
        # freed memory. Finished chains leave the registry when next it is swept.
        _IN_FLIGHT[:] = [c for c in _IN_FLIGHT if not c.done]
        if not self.done:
            _IN_FLIGHT.append(self)

    def _can_advance(self) -> bool:
        return self._gate is None or self._gate[0] is self

    def _advance(self) -> None:
        if self._gate is not None:
            self._gate.popleft()
            self._gate = None
        for r in self._reqs:  # this phase is complete: its buffers may go
            _PINNED.pop(id(r), None)
        nxt = self._then() if self._then is not None else None
        if nxt is None:
            self._reqs, self._then = [], None
        else:
            self._reqs, self._then = list(nxt[0]), nxt[1]

    @property
    def done(self) -> bool:
        return not self._reqs and self._then is None

    def test(self) -> bool:
        while not self.done:
            if self._reqs and not _mpi().Request.Testall(self._reqs):
                return False
            if not self._can_advance():
                return False
            self._advance()
        return True

    def wait(self) -> None:
        while not self.done:
            if self._reqs:
                _mpi().Request.Waitall(self._reqs)
            while not self._can_advance():
                assert self._gate is not None
                self._gate[0].wait()
            self._advance()


#: Buffers of nonblocking reductions in flight, by ``id`` of their MPI request. mpi4py
#: (4.1) keeps a reference to the buffers of a nonblocking Iallgather, Ialltoallv or
#: Isend, but not of an Iallreduce: were the array collected (its exchange dropped, say),
#: MPI would write into freed memory, which showed up as heap corruption inside Open MPI's
#: progress engine. A chain releases its phase's entries when the phase completes.
_PINNED: dict[int, tuple[Any, np.ndarray]] = {}


def _iallreduce(buf: np.ndarray, comm: Any) -> list[Any]:
    """Start an in-place sum allreduce; [] on a group of one (or no communicator).

    ``buf`` stays referenced (:data:`_PINNED`) until the :class:`_Chain` that holds the
    request sees it complete."""
    if comm is None or comm.Get_size() == 1:
        return []
    req = comm.Iallreduce(_mpi().IN_PLACE, buf.reshape(-1), op=_mpi().SUM)
    _PINNED[id(req)] = (req, buf)
    return [req]


def _iallgather(send: np.ndarray, recv: np.ndarray, comm: Any) -> list[Any]:
    if comm.Get_size() == 1:
        recv[:] = send.reshape(-1)
        return []
    return [comm.Iallgather(send, recv)]


# -- 16-bit codecs ------------------------------------------------------------------------------
def bf16_encode(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of ``x``, rounded to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bits."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


# fp16 chunks carry a power-of-two scale so that small gradients (the global normaliser
# makes them ~1/B) do not underflow the 6e-8 subnormal floor: scaled so |max| ~ 2**14.
_FP16_TARGET = 14


def _encode16(x: np.ndarray, kind: str, out: np.ndarray) -> None:
    """Encode ``x`` into ``out[:-1]`` (uint16) with its scale exponent in ``out[-1]``."""
    if kind == "bf16":
        out[:-1] = bf16_encode(x)
        out[-1] = 0
        return
    amax = float(np.max(np.abs(x))) if x.size else 0.0
    e = 0
    if amax > 0 and math.isfinite(amax):
        e = int(np.clip(_FP16_TARGET - math.frexp(amax)[1], -30000, 30000))
    out[:-1] = np.ldexp(x, e).astype(np.float16).view(np.uint16)
    out[-1] = np.array(e, dtype=np.int16).view(np.uint16)


def _decode16(bits: np.ndarray, kind: str, dtype: np.dtype) -> np.ndarray:
    if kind == "bf16":
        return bf16_decode(bits[:-1]).astype(dtype)
    e = int(bits[-1:].view(np.int16)[0])
    return np.ldexp(bits[:-1].view(np.float16).astype(dtype), -e)


# -- error-feedback codecs (pure NumPy, no communication; tested on their own) -----------------
class TopKCodec:
    """Top-k sparsification with error feedback for one bucket.

    ``compress(grad)`` adds the residual to ``grad``, keeps the ``k`` entries of largest
    magnitude, and stores what was not sent as the new residual, so over any number of
    steps ``sum(sent) + residual == sum(grads)`` (exactly, per element). Indices are int32
    (int64 for buckets of 2**31 elements or more).
    """

    def __init__(self, size: int, ratio: float, dtype: np.dtype) -> None:
        self.size = int(size)
        self.k = max(1, min(self.size, int(math.ceil(ratio * self.size))))
        self.index_dtype = np.dtype(np.int32 if self.size < 2**31 else np.int64)
        self.residual = np.zeros(self.size, dtype=dtype)

    def compress(self, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        acc = self.residual
        acc += grad
        if self.k == self.size:
            idx = np.arange(self.size, dtype=self.index_dtype)
        else:
            idx = np.argpartition(np.abs(acc), self.size - self.k)[self.size - self.k:]
            idx = np.sort(idx).astype(self.index_dtype)
        vals = acc[idx]
        acc[idx] = 0
        return idx, vals

    def decompress_sum(self, idx: np.ndarray, vals: np.ndarray, out: np.ndarray) -> None:
        """``out`` = the dense sum of every rank's (index, value) pairs, in rank order."""
        dense = np.bincount(idx, weights=vals, minlength=self.size)
        out[:] = dense[: self.size]


class PowerSGDCodec:
    """PowerSGD (Vogels et al., 2019) state for one bucket: rank-r factors with warm start.

    Two-dimensional tensors whose factors are smaller than the tensor (``r*(a+b) < a*b``)
    are compressed; everything else in the bucket (biases, norms, padding, small matrices)
    is sent dense, as in the paper. For a compressed matrix M (gradient + residual):
    ``P = M Q`` (summed over ranks), ``P̂ = orth(P)``, ``Q = Mᵀ P̂`` (summed), result
    ``P̂ Qᵀ``; the residual keeps ``M - P̂ (Mᵀ P̂)ᵀ``, this rank's unsent part, and the
    summed Q is the next step's warm start.
    """

    def __init__(self, layout: Any, bucket: Any, rank: int, dtype: np.dtype, seed: int) -> None:
        self.start = bucket.start
        self.size = bucket.stop - bucket.start
        self.rank = int(rank)
        self.residual = np.zeros(self.size, dtype=dtype)
        self.matrices: list[tuple[str, int, int, int]] = []  # name, offset in bucket, a, b
        self.qs: list[np.ndarray] = []
        covered = np.zeros(self.size, dtype=bool)
        for name in sorted(bucket.names, key=lambda n: layout.spec(n).offset):
            spec = layout.spec(name)
            if len(spec.shape) < 2:
                continue
            a, b = spec.shape[0], int(np.prod(spec.shape[1:]))
            if self.rank * (a + b) >= a * b:
                continue
            off = spec.offset - self.start
            self.matrices.append((name, off, a, b))
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            self.qs.append(rng.standard_normal((b, self.rank)).astype(dtype))
            covered[off:off + a * b] = True
        self.dense_index = np.flatnonzero(~covered)
        self._dense_runs = _runs(self.dense_index)
        self.p_size = sum(a * self.rank for _, _, a, _ in self.matrices)
        self.q_size = sum(b * self.rank for _, _, _, b in self.matrices)

    def _views(self, flat: np.ndarray) -> list[np.ndarray]:
        return [flat[off:off + a * b].reshape(a, b) for _, off, a, b in self.matrices]

    def gather_dense(self, grad: np.ndarray) -> np.ndarray:
        return np.concatenate([grad[s:e] for s, e in self._dense_runs]) if self._dense_runs \
            else np.zeros(0, dtype=grad.dtype)

    def scatter_dense(self, dense: np.ndarray, out: np.ndarray) -> None:
        pos = 0
        for s, e in self._dense_runs:
            out[s:e] = dense[pos:pos + e - s]
            pos += e - s

    def compute_p(self, grad: np.ndarray) -> np.ndarray:
        """Add the gradient to the residual (error feedback) and return the packed M Q."""
        self.residual += grad
        ps = [m @ q for m, q in zip(self._views(self.residual), self.qs, strict=True)]
        return np.concatenate([p.reshape(-1) for p in ps]) if ps \
            else np.zeros(0, dtype=grad.dtype)

    def compute_q(self, p_sum: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """Orthonormalise the summed P factors; return them and the packed local Mᵀ P̂."""
        phats, qs, pos = [], [], 0
        for m, (_, _, a, _) in zip(self._views(self.residual), self.matrices, strict=True):
            p = p_sum[pos:pos + a * self.rank].reshape(a, self.rank)
            pos += a * self.rank
            # Householder QR: deterministic (same bits on every rank) and stable for
            # rank-deficient P, unlike Gram-Schmidt.
            phat = np.linalg.qr(p)[0]
            phats.append(phat)
            qs.append(m.T @ phat)
        packed = np.concatenate([q.reshape(-1) for q in qs]) if qs \
            else np.zeros(0, dtype=p_sum.dtype)
        return phats, packed

    def finish(self, phats: list[np.ndarray], q_local: np.ndarray, q_sum: np.ndarray,
               out: np.ndarray) -> None:
        """Write the summed low-rank gradients into ``out``; keep the residual and warm start.

        ``out`` is this bucket of the gradient buffer; its dense part is filled separately.
        """
        pos = 0
        for j, (m, phat, (_, off, a, b)) in enumerate(
                zip(self._views(self.residual), phats, self.matrices, strict=True)):
            ql = q_local[pos:pos + b * self.rank].reshape(b, self.rank)
            qs = q_sum[pos:pos + b * self.rank].reshape(b, self.rank)
            pos += b * self.rank
            m -= phat @ ql.T
            out[off:off + a * b] = (phat @ qs.T).reshape(-1)
            self.qs[j] = qs.copy()
        # Dense entries are sent exactly: nothing of them is left over.
        self.residual[self.dense_index] = 0


def _runs(index: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous [start, stop) runs of a sorted index array."""
    if index.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(index) != 1)
    starts = np.concatenate([[index[0]], index[breaks + 1]])
    stops = np.concatenate([index[breaks], [index[-1]]]) + 1
    return [(int(s), int(e)) for s, e in zip(starts, stops, strict=True)]


# -- shared pieces of the three strategies -------------------------------------------------------
class _MeteredModel(DDPModel):
    """A DDP model whose strategy-specific exchanges go through a :class:`CountingComm`."""

    #: whether the strategy needs a second communicator for second-phase exchanges
    two_phase = False

    def _allocate(self) -> None:
        super()._allocate()
        self.meter = CountingComm(self.comm)
        self.meter2: CountingComm | None = None
        if self.two_phase and self.dp_size > 1:
            self.meter2 = CountingComm(self.comm.Dup(), totals=self.meter)
        self._gate: deque[_Chain] = deque()
        self.dense_bytes = 0  # bytes of the uncompressed buffers handed to the exchange

    def free(self) -> None:
        """Free the communicators this wrapper created. Collective over the mesh."""
        if self.meter2 is not None:
            self.meter2.comm.Free()
            self.meter2 = None
        super().free()


class _MeteredOptimizer(ShardedOptimizer):
    """Adds the measured ``bytes_sent`` counters to a strategy optimizer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bytes_sent_last_step = 0
        self._bytes_before = 0

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has passed to MPI for gradient/parameter exchange since wrap."""
        model = self.model
        return 0 if model is None else int(model.meter.bytes)

    @property
    def bytes_sent_per_step(self) -> float:
        """Mean bytes sent per step since wrap (:attr:`bytes_sent` / steps)."""
        return self.bytes_sent / self.step_count if self.step_count else 0.0

    def step(self, model: Any, batch: tuple[Any, Any]) -> float:
        model = self._resolve(model)
        before = model.meter.bytes
        loss = self._step(model, batch)
        self.bytes_sent_last_step = int(model.meter.bytes - before)
        return loss

    def _step(self, model: Any, batch: tuple[Any, Any]) -> float:
        return super().step(model, batch)

    def memory_report(self) -> dict[str, int]:
        out = super().memory_report()
        extra = self._extra_memory()
        out.update(extra)
        out["total"] += sum(extra.values())
        return out

    def _extra_memory(self) -> dict[str, int]:
        return {}

    def _local_gradients(self, model: ShardedModel, x: Any, y: Any,
                         progress: Callable[[], None] | None = None) -> float:
        """Forward/backward of every micro-batch without gradient sync; the local loss."""
        b = self._check_batch(model, x, y)
        m = self.config.micro_batches
        normalizer = self._count(y, self.loss) * model.dp_size
        model.zero_grad()
        local_loss = 0.0
        size = b // m
        with model.no_sync():
            for i in range(m):
                xs, ys = x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]
                out = model.forward(xs, ctx=i)
                local_loss += self.loss.forward(out, ys, normalizer=normalizer, ctx=i)
                model.backward(self.loss.backward(ctx=i), ctx=i)
                if progress is not None:
                    progress()
        return local_loss


def _check_int(owner: str, name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{owner}: {name}={value!r} must be an integer >= {low}")
    return int(value)


# -- Local SGD ----------------------------------------------------------------------------------
class LocalSGDModel(_MeteredModel):
    """Replicas that train on their own gradients; backward never synchronises."""

    strategy = "local_sgd"

    def backward(self, dy: Any, ctx: Any = None) -> Any:
        """Backward into the local gradients; returns the input gradient. Not collective."""
        for u in range(len(self.units) - 1, -1, -1):
            dy = self.units[u].backward(dy, ctx)
        return dy

    def sync_gradients(self) -> None:
        """Local SGD does not synchronise gradients."""

    def finish_gradient_sync(self) -> None:
        """Nothing to wait for."""

    def grad_sq_norm(self) -> float:
        return float(np.dot(self.grads, self.grads))


class LocalSGDOptimizer(_MeteredOptimizer):
    """Local SGD (a.k.a. periodic model averaging, Stich 2019; Lin et al. 2020).

    Each rank updates its replica with its own local-mean gradient (the rank's gradient,
    normalised by the global batch, times the dp size, folded into the kernel's
    ``grad_scale``) for ``sync_every`` steps; then the replicas are averaged with one
    allreduce of the flat parameter buffer, and with ``average_optimizer_state`` the
    optimizer state (momentum, Adam moments) travels in the same message. With
    ``sync_every=1`` and SGD without momentum this is DDP up to rounding.

    ``step`` is collective over dp: it checks the batch sizes, returns the global loss
    (one 8-byte allreduce; ``sync_loss=False`` returns this replica's local-mean loss
    instead, with no per-step communication at all), and averages on every
    ``sync_every``-th step. Clipping (``config.max_grad_norm``) clips each rank's local-mean
    gradient by its own norm.
    """

    model_class = LocalSGDModel

    def __init__(self, base: Any, config: Any = None, *, sync_every: int = 8,
                 average_optimizer_state: bool = False, sync_loss: bool = True,
                 loss: Any = None, lr_schedule: Any = None) -> None:
        self.sync_every = _check_int("LocalSGDOptimizer", "sync_every", sync_every, 1)
        for name, v in (("average_optimizer_state", average_optimizer_state),
                        ("sync_loss", sync_loss)):
            if not isinstance(v, bool):
                raise ValueError(f"LocalSGDOptimizer: {name}={v!r} must be True or False")
        self.average_optimizer_state = average_optimizer_state
        self.sync_loss = sync_loss
        super().__init__(base, config, loss=loss, lr_schedule=lr_schedule)
        self.averages = 0

    def _step(self, model: Any, batch: tuple[Any, Any]) -> float:
        x, y = batch
        t0 = time.perf_counter()
        local_loss = self._local_gradients(model, x, y)
        t1 = time.perf_counter()
        n = model.dp_size
        scale = float(n)
        if self.config.max_grad_norm is not None:
            norm = n * float(np.sqrt(model.grad_sq_norm()))
            scale *= min(1.0, self.config.max_grad_norm / (norm + 1e-6))
        self._apply_update(scale)
        self.step_count += 1
        t2 = time.perf_counter()
        if self.step_count % self.sync_every == 0:
            self.average_replicas()
        loss = self._global_loss(model, local_loss) if self.sync_loss else local_loss * n
        t3 = time.perf_counter()
        self.timers["compute"] += t1 - t0
        self.timers["update"] += t2 - t1
        self.timers["communication"] += t3 - t2
        return loss

    def average_replicas(self) -> None:
        """Average the parameters (and, if configured, optimizer state) over dp.

        Collective over the dp group: one allreduce of one contiguous buffer.
        """
        model = self._require_model()
        assert self.state is not None
        n = model.dp_size
        bufs = [model.params]
        if self.average_optimizer_state:
            bufs += [b for _, b in sorted(self.state.buffers.items())]
        if len(bufs) == 1:
            C.allreduce(model.params, "sum", comm=model.meter)
            model.params *= model.dtype.type(1.0 / n)
        else:
            packed = np.concatenate(bufs)
            C.allreduce(packed, "sum", comm=model.meter)
            packed *= packed.dtype.type(1.0 / n)
            pos = 0
            for b in bufs:
                b[:] = packed[pos:pos + b.size]
                pos += b.size
        model.dense_bytes += sum(b.nbytes for b in bufs)
        self.averages += 1

    def state_dict(self) -> dict[str, Any]:
        """The replica average (parameters, and state if averaged) as a state dict.

        Collective over dp. The replicas themselves are left as they were; the bytes of
        this average are not counted in :attr:`bytes_sent`.
        """
        model = self._require_model()
        assert self.state is not None
        saved = [model.params.copy()] + [b.copy() for _, b in sorted(self.state.buffers.items())]
        counted = (model.meter.bytes, model.meter.calls, model.dense_bytes, self.averages)
        self.average_replicas()
        try:
            return super().state_dict()
        finally:
            model.params[:] = saved[0]
            for (_, b), s in zip(sorted(self.state.buffers.items()), saved[1:], strict=True):
                b[:] = s
            model.meter.bytes, model.meter.calls, model.dense_bytes, self.averages = counted


# -- gradient compression -----------------------------------------------------------------------
class GradientCompressionModel(_MeteredModel):
    """DDP's bucketed, overlapped gradient exchange with each bucket compressed.

    Construction is collective over the mesh (as :class:`DDPModel`). ``method`` is one of
    :data:`METHODS`; ``ratio`` is top-k's kept fraction, ``rank`` PowerSGD's rank.
    """

    strategy = "compression"

    def __init__(self, module: Any, config: Any = None, *, seed: int = 0,
                 method: str = "none", ratio: float = 0.01, rank: int = 4) -> None:
        self.method = method
        self.ratio = ratio
        self.rank = rank
        self.two_phase = method in ("fp16", "bf16", "powersgd")
        super().__init__(module, config, seed=seed)

    def _allocate(self) -> None:
        super()._allocate()
        self.codecs: list[Any] = []
        if self.method == "topk":
            self.codecs = [TopKCodec(b.size, self.ratio, self.dtype) for b in self.buckets]
        elif self.method == "powersgd":
            self.codecs = [PowerSGDCodec(self.layout, b, self.rank, self.dtype, self.seed)
                           for b in self.buckets]
        self.memory["compression_state"] = int(sum(
            c.residual.nbytes + sum(q.nbytes for q in getattr(c, "qs", ()))
            for c in self.codecs))

    def sync_gradients(self) -> None:
        # DDP skips starting buckets on a group of one; compression must still run there
        # (error feedback and 16-bit rounding change the gradient even on one rank).
        for i in range(len(self.buckets)):
            self._start_bucket(i)

    def finish_gradient_sync(self) -> None:
        self.sync_gradients()
        C.wait_all(list(self._pending.values()))
        self._pending.clear()

    def _start_bucket(self, i: int) -> None:
        if i in self._pending:
            return
        b = self.buckets[i]
        g = self.grads[b.start:b.stop]
        self.dense_bytes += g.nbytes
        start = getattr(self, f"_start_{self.method}")
        self._pending[i] = start(i, g)

    def _start_none(self, i: int, g: np.ndarray) -> _Chain:
        return _Chain(_iallreduce(g, self.meter), None)

    def _start_fp16(self, i: int, g: np.ndarray) -> _Chain:
        return self._start_16(g, "fp16")

    def _start_bf16(self, i: int, g: np.ndarray) -> _Chain:
        return self._start_16(g, "bf16")

    def _start_16(self, g: np.ndarray, kind: str) -> _Chain:
        """Reduce-scatter in 16 bits (Alltoallv), sum in the gradient dtype, allgather.

        The bucket is cut into n chunks; chunk j of every rank goes to rank j (this rank's
        own chunk stays local), rank j sums its chunk over the ranks in float32/float64 in
        rank order, rounds the sum to 16 bits and the rounded sums are allgathered. Each
        rank sends about ``2*len(bucket)`` bytes in all: half of a float32 allreduce.
        """
        MPI = _mpi()
        n, r = self.dp_size, self.dp_rank
        m = g.size
        c = -(-m // n)
        w = c + 1  # one slot for the chunk's scale exponent
        padded = np.zeros(n * c, dtype=g.dtype)
        padded[:m] = g
        send = np.empty(n * w, dtype=np.uint16)
        for j in range(n):
            _encode16(padded[j * c:(j + 1) * c], kind, send[j * w:(j + 1) * w])
        recv = np.empty(n * w, dtype=np.uint16)
        recv[r * w:(r + 1) * w] = send[r * w:(r + 1) * w]
        counts = [w] * n
        counts[r] = 0
        displs = [j * w for j in range(n)]
        reqs = []
        if n > 1:
            reqs = [self.meter.Ialltoallv([send, (counts, displs), MPI.UINT16_T],
                                          [recv, (counts, displs), MPI.UINT16_T])]
        gathered = np.empty(n * w, dtype=np.uint16)

        def reduce_chunk() -> tuple[list[Any], Any]:
            total = np.zeros(c, dtype=g.dtype)
            for j in range(n):
                total += _decode16(recv[j * w:(j + 1) * w], kind, g.dtype)
            _encode16(total, kind, gathered[r * w:(r + 1) * w])
            more = [] if n == 1 else [self.meter2.Iallgather(MPI.IN_PLACE, gathered)]
            _ = send  # MPI reads ``send`` until the first phase completes
            return more, unpack

        def unpack() -> None:
            for j in range(n):
                lo, hi = j * c, min((j + 1) * c, m)
                if hi > lo:
                    g[lo:hi] = _decode16(gathered[j * w:(j + 1) * w], kind, g.dtype)[:hi - lo]

        return _Chain(reqs, reduce_chunk, self._gate)

    def _start_topk(self, i: int, g: np.ndarray) -> _Chain:
        """Send (int32 indices, values) of the k largest |g + residual| with allgather."""
        codec: TopKCodec = self.codecs[i]
        idx, vals = codec.compress(g)
        n = self.dp_size
        all_idx = np.empty(n * codec.k, dtype=idx.dtype)
        all_vals = np.empty(n * codec.k, dtype=vals.dtype)
        reqs = _iallgather(idx, all_idx, self.meter) + _iallgather(vals, all_vals, self.meter)

        def unpack() -> None:
            _ = (idx, vals)  # send buffers stay alive until the gathers complete
            codec.decompress_sum(all_idx, all_vals, g)

        return _Chain(reqs, unpack)

    def _start_powersgd(self, i: int, g: np.ndarray) -> _Chain:
        """P = M Q and the dense part allreduced; then Q = Mᵀ P̂ allreduced."""
        codec: PowerSGDCodec = self.codecs[i]
        dense = codec.gather_dense(g)
        p = codec.compute_p(g)
        reqs = _iallreduce(dense, self.meter) + (_iallreduce(p, self.meter) if p.size else [])
        hold: dict[str, Any] = {}

        def second() -> tuple[list[Any], Any]:
            phats, q_local = codec.compute_q(p)
            q_sum = q_local.copy()
            hold.update(phats=phats, q_local=q_local, q_sum=q_sum)
            return (_iallreduce(q_sum, self.meter2) if q_sum.size else []), unpack

        def unpack() -> None:
            codec.finish(hold["phats"], hold["q_local"], hold["q_sum"], g)
            codec.scatter_dense(dense, g)

        return _Chain(reqs, second, self._gate)


class GradientCompressionOptimizer(_MeteredOptimizer):
    """DDP with compressed gradient exchange.

    Args:
        base: the optimizer applied to the (decompressed) summed gradients.
        config: :class:`ShardingConfiguration` (buckets, overlap, clipping...).
        method: ``"none"`` (DDP's allreduce, bit for bit), ``"fp16"``/``"bf16"`` (16-bit
            reduce-scatter by Alltoallv + 16-bit allgather, sums in the gradient dtype),
            ``"topk"`` (per bucket, the ``ceil(ratio*len)`` entries of largest magnitude of
            gradient + residual, exchanged as (int32 index, value) pairs by allgather and
            summed on every rank; the rest stays in the residual) or ``"powersgd"``
            (rank-``rank`` factors with warm start and error feedback; 1-D tensors dense).
        ratio: top-k's kept fraction in (0, 1].
        rank: PowerSGD's rank, >= 1.

    ``step`` is collective over dp. ``compression_ratio`` = bytes sent / bytes of the
    uncompressed buckets, both measured.
    """

    model_class = GradientCompressionModel

    def __init__(self, base: Any, config: Any = None, *, method: str = "topk",
                 ratio: float = 0.01, rank: int = 4, loss: Any = None,
                 lr_schedule: Any = None) -> None:
        if method not in METHODS:
            raise ValueError(f"GradientCompressionOptimizer: method={method!r} is not one of "
                             f"{METHODS}")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) \
                or not 0 < ratio <= 1:
            raise ValueError(f"GradientCompressionOptimizer: ratio={ratio!r} must be in (0, 1]")
        self.method = method
        self.ratio = float(ratio)
        self.rank = _check_int("GradientCompressionOptimizer", "rank", rank, 1)
        super().__init__(base, config, loss=loss, lr_schedule=lr_schedule)

    @property
    def strategy(self) -> str:
        return f"compression-{self.method}"

    def wrap(self, module: Any, *, seed: int = 0) -> ShardedModel:
        """Wrap ``module`` (collective over the mesh) and set up the optimizer state."""
        model = GradientCompressionModel(module, self.config, seed=seed, method=self.method,
                                         ratio=self.ratio, rank=self.rank)
        self.attach(model)
        return model

    @property
    def compression_ratio(self) -> float:
        """Measured bytes sent / bytes of the uncompressed gradient buckets exchanged."""
        model = self.model
        if model is None or model.dense_bytes == 0:
            return float("nan")
        return self.bytes_sent / model.dense_bytes

    def _extra_memory(self) -> dict[str, int]:
        model = self.model
        return {} if model is None else {"compression_state": model.memory["compression_state"]}


# -- bounded-staleness asynchronous SGD --------------------------------------------------------
class AsyncSGDModel(_MeteredModel):
    """A DDP model whose backward does not synchronise; the optimizer exchanges copies."""

    strategy = "async_sgd"

    def backward(self, dy: Any, ctx: Any = None) -> Any:
        """Backward into the local gradients, driving pending exchanges between units;
        returns the input gradient. Not collective."""
        for u in range(len(self.units) - 1, -1, -1):
            dy = self.units[u].backward(dy, ctx)
            self.progress()
        return dy

    def progress(self) -> None:
        """Let MPI advance the in-flight gradient allreduces. Not collective."""
        for req, _ in getattr(self, "inflight", ()):
            req.test()

    def sync_gradients(self) -> None:
        """Exchanges are started by the optimizer."""

    def finish_gradient_sync(self) -> None:
        """Exchanges are completed by the optimizer."""


class AsyncSGDOptimizer(_MeteredOptimizer):
    """SGD with bounded staleness: gradient allreduces overlap the next ``staleness`` steps.

    At step t the local gradient is copied into a buffer whose nonblocking allreduce is
    started at once; then, while more than ``staleness`` exchanges are in flight, the
    oldest is waited for and applied. So in steady state step t applies the summed
    gradient of step t - s; the first s steps apply nothing (the parameters stay at their
    initial values while the pipeline fills); :meth:`flush` applies every pending
    gradient. ``staleness=0`` is DDP (one allreduce of the whole buffer instead of buckets).

    Every rank applies the same summed gradients in the same order, so replicas stay
    identical. ``step`` is collective over dp. Clipping uses the norm of the applied
    (summed) gradient; the learning-rate schedule is evaluated at the applying step.
    :meth:`state_dict` flushes first (collective), so a checkpoint holds every gradient.
    """

    model_class = AsyncSGDModel

    def __init__(self, base: Any, config: Any = None, *, staleness: int = 1,
                 loss: Any = None, lr_schedule: Any = None) -> None:
        self.staleness = _check_int("AsyncSGDOptimizer", "staleness", staleness, 0)
        super().__init__(base, config, loss=loss, lr_schedule=lr_schedule)
        self._pool: list[np.ndarray] = []
        self.applied = 0

    def attach(self, model: ShardedModel) -> None:
        super().attach(model)
        model.inflight = deque()  # type: ignore[attr-defined]
        self._buffers_made = 0

    def _step(self, model: Any, batch: tuple[Any, Any]) -> float:
        x, y = batch
        t0 = time.perf_counter()
        local_loss = self._local_gradients(model, x, y, progress=model.progress)
        t1 = time.perf_counter()
        buf = self._pool.pop() if self._pool else None
        if buf is None:
            buf = np.empty_like(model.grads)
            self._buffers_made += 1
        buf[:] = model.grads
        model.dense_bytes += buf.nbytes
        model.inflight.append((_Chain(_iallreduce(buf, model.meter), None), buf))
        self.step_count += 1
        t_update = 0.0
        while len(model.inflight) > self.staleness:
            t_update += self._apply_oldest(model)
        loss = self._global_loss(model, local_loss)
        t2 = time.perf_counter()
        self.timers["compute"] += t1 - t0
        self.timers["update"] += t_update
        self.timers["communication"] += t2 - t1 - t_update
        return loss

    def _apply_oldest(self, model: Any) -> float:
        req, buf = model.inflight.popleft()
        req.wait()
        t0 = time.perf_counter()
        scale = 1.0
        if self.config.max_grad_norm is not None:
            norm = float(np.sqrt(np.dot(buf, buf)))
            scale = min(1.0, self.config.max_grad_norm / (norm + 1e-6))
        st = self._pieces[0][2]
        self.base.update(model.params, buf, st, grad_scale=scale, lr=self._lr())
        assert self.state is not None
        self.state.step = st.step
        self._pool.append(buf)
        self.applied += 1
        return time.perf_counter() - t0

    @property
    def in_flight(self) -> int:
        """Gradient exchanges started but not yet applied."""
        return 0 if self.model is None else len(self.model.inflight)

    def flush(self) -> None:
        """Wait for and apply every in-flight gradient, oldest first. Collective over dp."""
        model = self._require_model()
        while model.inflight:
            self._apply_oldest(model)

    def state_dict(self) -> dict[str, Any]:
        """:meth:`flush`, then the state dict (collective over dp)."""
        self.flush()
        return super().state_dict()

    def _extra_memory(self) -> dict[str, int]:
        model = self.model
        return {"gradient_copies": 0 if model is None
                else self._buffers_made * model.grads.nbytes}


STRATEGY_CLASSES: dict[str, type[ShardedOptimizer]] = {
    "local_sgd": LocalSGDOptimizer,
    "compression": GradientCompressionOptimizer,
    "async_sgd": AsyncSGDOptimizer,
}
