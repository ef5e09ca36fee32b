"""DDP and ZeRO-1: replicated parameters, gradients allreduced in buckets during backward.

Both keep every parameter and gradient on every rank in one flat buffer. Buckets are
contiguous ranges of the gradient buffer in reverse layer order; when backward has finished
every unit that touches a bucket, the bucket's nonblocking allreduce starts, and pending
requests are tested between units so Open MPI progresses them while backward continues.
DDP then updates the whole buffer on every rank (replicated optimizer state); ZeRO-1 updates
only this rank's shard of each unit (sharded optimizer state) and allgathers the parameters.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpidist import collectives as C
from mpidist.parallel.engine import ReplicatedParameters, ShardedModel, ShardedOptimizer

__all__ = ["DDPModel", "DDPOptimizer", "ZeRO1Model", "ZeRO1Optimizer"]


class DDPModel(ReplicatedParameters, ShardedModel):
    """A model whose gradients are averaged over the data-parallel group (PyTorch DDP).

    Construction is collective over the mesh: the parameters are initialised
    deterministically and then broadcast from dp rank 0, so every replica starts equal.
    ``backward`` starts each bucket's allreduce as soon as the bucket is complete (when
    ``config.overlap``; else after the whole backward) unless inside :meth:`no_sync`;
    :meth:`finish_gradient_sync` waits for all of them.
    """

    strategy = "ddp"
    shards_state = False

    def _allocate(self) -> None:
        n = self.layout.full_size
        self.params = np.zeros(n, dtype=self.dtype)
        self.grads = np.zeros(n, dtype=self.dtype)
        self.memory["parameters"] = self.params.nbytes
        self.memory["gradients"] = self.grads.nbytes
        self.buckets = self.layout.buckets(self.config.bucket_bytes, self.dtype.itemsize)
        # A bucket is final once the lowest-indexed unit using any of its tensors has run
        # backward (backward visits units from last to first).
        final_after = {name: min(us) for name, us in self._users.items()}
        self._bucket_unit = [
            min((final_after[n] for n in b.names), default=0) for b in self.buckets
        ]
        self._pending: dict[int, C.Request] = {}

    def _initialize(self) -> None:
        # Initialise through the whole module so a weight shared between units (tied
        # embeddings) is visible to every unit that reads it.
        self.module.bind(self.layout.full_views(self.params), None)
        self.module.init_parameters(self.seed)
        self.module.unbind()
        # Replicas must start identical even if initialisation differed (it should not).
        C.broadcast(self.params, 0, comm=self.comm)

    def _bind(self) -> None:
        self.module.bind(self.layout.full_views(self.params), self.layout.full_views(self.grads))

    def zero_grad(self) -> None:
        self.grads.fill(0)

    def _start_bucket(self, i: int) -> None:
        b = self.buckets[i]
        if i not in self._pending:
            self._pending[i] = C.iallreduce(self.grads[b.start:b.stop], "sum", comm=self.comm)

    def _progress(self) -> None:
        for req in self._pending.values():
            req.test()

    def backward(self, dy: Any, ctx: Any = None) -> Any:
        """Backward through every unit, starting bucket allreduces as they fill; returns the
        input gradient of the first unit.

        Collective over dp when gradients are synchronised (every rank must run the same
        number of synchronised backwards).
        """
        sync = self._sync_enabled and self.config.auto_sync_gradients
        overlap = sync and self.config.overlap and self.dp_size > 1
        for u in range(len(self.units) - 1, -1, -1):
            dy = self.units[u].backward(dy, ctx)
            if overlap:
                for i, after in enumerate(self._bucket_unit):
                    if after == u:
                        self._start_bucket(i)
                self._progress()
        if sync and not overlap:
            self.sync_gradients()
        return dy

    def sync_gradients(self) -> None:
        """Reduce every bucket not yet started, with blocking allreduces (Open MPI's
        blocking collectives are tuned better than its nonblocking ones, so without
        overlap there is nothing to gain from nonblocking calls). Collective over dp."""
        for i, b in enumerate(self.buckets):
            if i not in self._pending:
                C.allreduce(self.grads[b.start:b.stop], "sum", comm=self.comm)
                self._pending[i] = C.Request([], None)

    def finish_gradient_sync(self) -> None:
        """Wait for every started bucket (reducing any that were not). Collective over dp."""
        if self.dp_size > 1:
            self.sync_gradients()
        C.wait_all(list(self._pending.values()))
        self._pending.clear()

    def update_pieces(self) -> list[tuple[np.ndarray, np.ndarray, slice]]:
        return [(self.params, self.grads, slice(0, self.layout.full_size))]

    def grad_sq_norm(self) -> float:
        # Synchronised gradients are identical on every rank: no communication needed.
        return float(np.dot(self.grads, self.grads))



class ZeRO1Model(DDPModel):
    """DDP's replicated parameters and allreduced gradients, with the optimizer state
    sharded: each rank updates only its shard of each unit, then the parameters are
    allgathered (ZeRO stage 1)."""

    strategy = "zero1"
    shards_state = True

    def update_pieces(self) -> list[tuple[np.ndarray, np.ndarray, slice]]:
        out = []
        for u, span in enumerate(self.layout.units):
            p = self.layout.unit_shard_of_full(u, self.params)
            g = self.layout.unit_shard_of_full(u, self.grads)
            out.append((p, g, slice(span.local_offset, span.local_offset + span.shard)))
        return out

    def after_update(self) -> None:
        """Allgather every unit's updated shards. Collective over dp."""
        self.allgather_shards()


class DDPOptimizer(ShardedOptimizer):
    """Data-parallel training with gradients averaged by MPI Allreduce (PyTorch DDP).

    Every rank holds the whole model and the whole optimizer state; gradients are
    bucketed and allreduced while backward runs; every rank applies the same fused update.
    """

    model_class = DDPModel


class ZeRO1Optimizer(ShardedOptimizer):
    """ZeRO stage 1: optimizer state sharded over the data-parallel group.

    Gradients are allreduced as in DDP; each rank updates its shard with the fused kernel
    and the parameters are allgathered.
    """

    model_class = ZeRO1Model
