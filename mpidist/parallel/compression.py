"""Gradient compression as a gradient-communication hook: each gradient piece (a bucket
at sharding levels 0-1, a unit at levels 2-3, whose sum this rank then keeps its shard
of) is exchanged compressed: 16-bit floats (``fp16``, ``bf16``), top-k sparsification
with error feedback (``topk``) or low-rank PowerSGD with error feedback (``powersgd``)."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from mpidist.core.buffers import shard_size
from mpidist.parallel.codecs import PowerSGDCodec, TopKCodec, decode16, encode16
from mpidist.parallel.exchange import CountingComm, RequestChain, iallgather, iallreduce
from mpidist.parallel.hooks import GradientHook, check_int

METHODS = ("none", "fp16", "bf16", "topk", "powersgd")

__all__ = ["METHODS", "Compression"]


class Compression(GradientHook):
    """Each gradient piece exchanged compressed, at any sharding level.

    Args:
        method: ``"none"`` (an allreduce, bit for bit DDP's), ``"fp16"``/``"bf16"`` (16-bit
            reduce-scatter by Alltoallv + 16-bit allgather, sums in the gradient dtype),
            ``"topk"`` (per piece, the ``ceil(ratio*len)`` entries of largest magnitude of
            gradient + residual, exchanged as (int32 index, value) pairs by allgather and
            summed on every rank; the rest stays in the residual) or ``"powersgd"``
            (rank-``rank`` factors with warm start and error feedback; 1-D tensors dense).
        ratio: top-k's kept fraction in (0, 1].
        rank: PowerSGD's rank, >= 1.

    The error-feedback residuals and PowerSGD's warm starts are per-rank state, saved in
    checkpoints. Unlike the synchronous hooks, compression also runs on a group of one
    (its rounding and error feedback change the gradient there too).
    """

    name = "compressed"
    runs_on_device = False  # the codecs and the metered exchange work on host arrays
    metered = True

    def __init__(self, method: str = "topk", *, ratio: float = 0.01, rank: int = 4) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"Compression: method={method!r} is not one of {METHODS}")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) \
                or not 0 < ratio <= 1:
            raise ValueError(f"Compression: ratio={ratio!r} must be in (0, 1]")
        self.method = method
        self.ratio = float(ratio)
        self.rank = check_int("Compression", "rank", rank, 1)
        self.codecs: list[Any] = []
        self.meter2: CountingComm | None = None
        self._gate: deque[RequestChain] = deque()

    @property
    def state_kind(self) -> str:  # type: ignore[override]
        return f"compression_{self.method}"

    def strategy_name(self, level: int, base: str) -> str:
        name = f"compression-{self.method}"
        return name if level == 0 else f"{name}+{base}"

    def bind(self, model: Any, pieces: list[Any]) -> None:
        """Make a codec per piece; a two-phase method dups the group's communicator for its
        second phases. Collective over the shard group."""
        self.free()
        super().bind(model, pieces)
        if self.method in ("fp16", "bf16", "powersgd") and model.shard_size > 1:
            self.meter2 = CountingComm(model.shard_comm.Dup(), totals=self.meter)
        self._gate = deque()
        self.codecs = []
        if self.method == "topk":
            self.codecs = [TopKCodec(b.size, self.ratio, model.dtype) for b in pieces]
        elif self.method == "powersgd":
            self.codecs = [PowerSGDCodec(model.layout, b, self.rank, model.dtype, model.seed)
                           for b in pieces]

    def free(self) -> None:
        if self.meter2 is not None:
            self.meter2.comm.Free()
            self.meter2 = None

    def required(self) -> bool:
        return True

    def start(self, i: int, g: np.ndarray, *, blocking: bool = False) -> Any:
        """Start the compressed sum of piece ``i`` over the group, in place (``blocking``
        is ignored: compressed exchanges are always chains). Collective over the group."""
        self.dense_bytes += g.nbytes
        return getattr(self, f"_start_{self.method}")(i, g)

    def rank_state_arrays(self) -> list[np.ndarray]:
        """Error-feedback residuals (this rank's unsent gradient) and PowerSGD's warm-start
        factors, per piece."""
        out = []
        for c in self.codecs:
            out.append(c.residual)
            out.extend(getattr(c, "qs", ()))
        return out

    def extra_memory(self) -> dict[str, int]:
        return {"compression_state": int(sum(a.nbytes for a in self.rank_state_arrays()))}

    def _start_none(self, i: int, g: np.ndarray) -> RequestChain:
        return RequestChain(iallreduce(g, self.meter), None)

    def _start_fp16(self, i: int, g: np.ndarray) -> RequestChain:
        return self._start_16(g, "fp16")

    def _start_bf16(self, i: int, g: np.ndarray) -> RequestChain:
        return self._start_16(g, "bf16")

    def _start_16(self, g: np.ndarray, kind: str) -> RequestChain:
        """Reduce-scatter in 16 bits (Alltoallv), sum in the gradient dtype, allgather.

        The bucket is cut into n chunks; chunk j of every rank goes to rank j (this rank's
        own chunk stays local), rank j sums its chunk over the ranks in float32/float64 in
        rank order, rounds the sum to 16 bits and the rounded sums are allgathered. Each
        rank sends about ``2*len(bucket)`` bytes in all: half of a float32 allreduce.
        """
        from mpi4py import MPI

        n, r = self.model.shard_size, self.model.shard_rank
        m = g.size
        c = shard_size(m, n)
        w = c + 1  # one slot for the chunk's scale exponent
        padded = np.zeros(n * c, dtype=g.dtype)
        padded[:m] = g
        send = np.empty(n * w, dtype=np.uint16)
        for j in range(n):
            encode16(padded[j * c:(j + 1) * c], kind, send[j * w:(j + 1) * w])
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
                total += decode16(recv[j * w:(j + 1) * w], kind, g.dtype)
            encode16(total, kind, gathered[r * w:(r + 1) * w])
            more = [] if n == 1 else [self.meter2.Iallgather(MPI.IN_PLACE, gathered)]
            _ = send  # MPI reads ``send`` until the first phase completes
            return more, unpack

        def unpack() -> None:
            for j in range(n):
                lo, hi = j * c, min((j + 1) * c, m)
                if hi > lo:
                    g[lo:hi] = decode16(gathered[j * w:(j + 1) * w], kind, g.dtype)[:hi - lo]

        return RequestChain(reqs, reduce_chunk, self._gate)

    def _start_topk(self, i: int, g: np.ndarray) -> RequestChain:
        """Send (int32 indices, values) of the k largest |g + residual| with allgather."""
        codec: TopKCodec = self.codecs[i]
        idx, vals = codec.compress(g)
        n = self.model.shard_size
        all_idx = np.empty(n * codec.k, dtype=idx.dtype)
        all_vals = np.empty(n * codec.k, dtype=vals.dtype)
        reqs = iallgather(idx, all_idx, self.meter) + iallgather(vals, all_vals, self.meter)

        def unpack() -> None:
            _ = (idx, vals)  # send buffers stay alive until the gathers complete
            codec.decompress_sum(all_idx, all_vals, g)

        return RequestChain(reqs, unpack)

    def _start_powersgd(self, i: int, g: np.ndarray) -> RequestChain:
        """P = M Q and the dense part allreduced; then Q = Mᵀ P̂ allreduced."""
        codec: PowerSGDCodec = self.codecs[i]
        dense = codec.gather_dense(g)
        p = codec.compute_p(g)
        reqs = iallreduce(dense, self.meter) + (iallreduce(p, self.meter) if p.size else [])
        hold: dict[str, Any] = {}

        def second() -> tuple[list[Any], Any]:
            phats, q_local = codec.compute_q(p)
            q_sum = q_local.copy()
            hold.update(phats=phats, q_local=q_local, q_sum=q_sum)
            return (iallreduce(q_sum, self.meter2) if q_sum.size else []), unpack

        def unpack() -> None:
            codec.finish(hold["phats"], hold["q_local"], hold["q_sum"], g)
            codec.scatter_dense(dense, g)

        return RequestChain(reqs, second, self._gate)
