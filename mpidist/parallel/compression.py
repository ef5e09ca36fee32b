"""Gradient compression: DDP's bucketed, overlapped gradient exchange with each bucket
compressed: 16-bit floats (``fp16``, ``bf16``), top-k sparsification with error feedback
(``topk``) or low-rank PowerSGD with error feedback (``powersgd``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpidist import collectives as C
from mpidist.parallel.codecs import PowerSGDCodec, TopKCodec, decode16, encode16
from mpidist.parallel.engine import ShardedModel
from mpidist.parallel.exchange import RequestChain, iallgather, iallreduce
from mpidist.parallel.metered import MeteredModel, MeteredOptimizer, check_int

METHODS = ("none", "fp16", "bf16", "topk", "powersgd")

__all__ = ["METHODS", "GradientCompressionModel", "GradientCompressionOptimizer"]


class GradientCompressionModel(MeteredModel):
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

        n, r = self.dp_size, self.dp_rank
        m = g.size
        c = -(-m // n)
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
        n = self.dp_size
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


class GradientCompressionOptimizer(MeteredOptimizer):
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
        self.rank = check_int("GradientCompressionOptimizer", "rank", rank, 1)
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
    def state_kind(self) -> str:  # type: ignore[override]
        return f"compression_{self.method}"

    def rank_state_arrays(self) -> list[np.ndarray]:
        """Error-feedback residuals (this rank's unsent gradient) and PowerSGD's warm-start
        factors, per bucket."""
        model = self.model
        if model is None:
            return []
        out = []
        for c in getattr(model, "codecs", ()):
            out.append(c.residual)
            out.extend(getattr(c, "qs", ()))
        return out

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


