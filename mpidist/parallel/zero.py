"""ZeRO-2 and ZeRO-3 (FSDP): gradients reduce-scattered unit by unit; ZeRO-3 shards
parameters too and gathers each unit just in time.

Both work unit by unit on a :class:`~mpidist.buffers.ShardedLayout` in which every unit is
padded to a multiple of the group size, so one unit's reduce-scatter or allgather is one
``Reduce_scatter_block``/``Allgather`` with equal counts.

ZeRO-2 keeps the full parameters. During backward each unit's gradients go to a working
buffer of that unit's size, which is reduce-scattered (nonblocking) into this rank's
gradient shard as soon as the unit is done and then dropped; the optimizer updates the
shard and the parameters are allgathered.

ZeRO-3 keeps only the shard of the parameters. Before a unit runs, its parameters are
allgathered into a working buffer (the next unit's allgather is started with a nonblocking
call while the current unit computes) and dropped after use; backward gathers again,
computes, and reduce-scatters the unit's gradients into the local gradient shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpidist import collectives as C
from mpidist.parallel.engine import (
    ReplicatedParameters,
    ShardedModel,
    ShardedOptimizer,
    has_units,
)

__all__ = [
    "FSDPModel",
    "FSDPOptimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
]


class _ReduceScatterUnits:
    """Unit-wise gradient reduce-scatter into a local shard, shared by ZeRO-2 and ZeRO-3."""

    def _rs_init(self: Any) -> None:
        self.grad_shard = np.zeros(self.layout.local_size, dtype=self.dtype)
        self.memory["gradients"] = self.grad_shard.nbytes
        self._rs_pending: list[tuple[C.Request, np.ndarray, int]] = []

    def _start_reduce_scatter(self: Any, u: int, grad_full: np.ndarray) -> None:
        span = self.layout.units[u]
        tmp = np.empty(span.shard, dtype=self.dtype)
        req = C.ireduce_scatter(grad_full, "sum", comm=self.comm, out=tmp)
        self._rs_pending.append((req, grad_full, u))
        self._track(tmp.nbytes)

    def _progress_reduce_scatter(self: Any, wait: bool, max_pending: int = 1) -> None:
        """Fold finished reductions into the shard; with ``wait``, all of them. At most
        ``max_pending`` stay in flight, which bounds the working set to a few units."""
        keep = []
        for i, (req, buf, u) in enumerate(self._rs_pending):
            in_flight_after = len(self._rs_pending) - i - 1 + len(keep)
            if wait or in_flight_after >= max_pending or req.test():
                shard = req.wait()
                self.layout.unit_local(u, self.grad_shard)[:] += shard
                self._untrack(buf.nbytes + shard.nbytes)
            else:
                keep.append((req, buf, u))
        self._rs_pending = keep

    def zero_grad(self: Any) -> None:
        self.grad_shard.fill(0)

    def finish_gradient_sync(self: Any) -> None:
        self._progress_reduce_scatter(wait=True)

    def grad_sq_norm(self: Any) -> float:
        total = np.array([float(np.dot(self.grad_shard, self.grad_shard))])
        C.allreduce(total, "sum", comm=self.comm)
        return float(total[0])


class ZeRO2Model(_ReduceScatterUnits, ReplicatedParameters, ShardedModel):
    """Full parameters, sharded gradients and optimizer state (ZeRO stage 2).

    Construction is collective over the mesh. Parameters shared between units (tied
    weights) are not supported.
    """

    strategy = "zero2"
    shards_state = True

    def _allocate(self) -> None:
        self._check_untied("ZeRO-2")
        self.params = np.zeros(self.layout.full_size, dtype=self.dtype)
        self.memory["parameters"] = self.params.nbytes
        self._rs_init()

    def _bind(self) -> None:
        self.module.bind(self.layout.full_views(self.params), None)

    def _initialize(self) -> None:
        for u in range(len(self.units)):
            self.layout.unit_full(u, self.params)[:] = self._init_unit(u)
        C.broadcast(self.params, 0, comm=self.comm)

    def backward(self, dy: Any, ctx: Any = None) -> Any:
        """Backward unit by unit; each unit's gradients are reduce-scattered as soon as the
        unit is done. Collective over dp. Returns the input gradient of the first unit."""
        for u in range(len(self.units) - 1, -1, -1):
            span = self.layout.units[u]
            unit = self.units[u]
            gbuf = np.zeros(span.padded, dtype=self.dtype)
            self._track(gbuf.nbytes)
            pviews = self.layout.unit_views(u, self.layout.unit_full(u, self.params))
            unit.bind(pviews, self.layout.unit_views(u, gbuf))
            dy = unit.backward(dy, ctx)
            unit.bind(pviews, None)
            self._start_reduce_scatter(u, gbuf)
            self._progress_reduce_scatter(wait=False)
        return dy

    def update_pieces(self) -> list[tuple[np.ndarray, np.ndarray, slice]]:
        out = []
        for u, span in enumerate(self.layout.units):
            p = self.layout.unit_shard_of_full(u, self.params)
            g = self.layout.unit_local(u, self.grad_shard)
            out.append((p, g, slice(span.local_offset, span.local_offset + span.shard)))
        return out

    def after_update(self) -> None:
        """Allgather every unit's updated shards. Collective over dp."""
        self.allgather_shards()


class ZeRO3Model(_ReduceScatterUnits, ShardedModel):
    """Parameters, gradients and optimizer state all sharded (ZeRO stage 3 / FSDP).

    Construction is collective over the mesh and needs a model with units (one unit would
    gather the whole model, which defeats the purpose). Forward and backward are collective
    over dp: every rank must run them the same number of times.
    """

    strategy = "zero3"
    shards_state = True
    shards_params = True

    def _allocate(self) -> None:
        if not has_units(self.module):
            raise ValueError(
                f"ZeRO-3 needs a model made of units (a .units list of 2 or more); "
                f"{type(self.module).__name__} has none"
            )
        self._check_untied("ZeRO-3")
        self.param_shard = np.zeros(self.layout.local_size, dtype=self.dtype)
        self.memory["parameters"] = self.param_shard.nbytes
        self._rs_init()

    def _initialize(self) -> None:
        for u in range(len(self.units)):
            full = self._init_unit(u)
            self.layout.unit_local(u, self.param_shard)[:] = \
                self.layout.unit_shard_of_full(u, np.concatenate(
                    [np.zeros(self.layout.units[u].full_offset, dtype=self.dtype), full]))

    # -- gathering units ------------------------------------------------------------------
    def _gather(self, u: int) -> C.Request:
        span = self.layout.units[u]
        buf = np.empty(span.padded, dtype=self.dtype)
        self._track(buf.nbytes)
        return C.iallgather(self.layout.unit_local(u, self.param_shard), comm=self.comm, out=buf)

    def _release(self, u: int, buf: np.ndarray) -> None:
        self.units[u].unbind()
        self._untrack(buf.nbytes)

    def forward(self, x: Any, ctx: Any = None) -> Any:
        """Forward unit by unit, each gathered just in time. Collective over dp."""
        n = len(self.units)
        prefetch = self.config.prefetch
        pending = self._gather(0)
        h = x
        for u in range(n):
            buf = pending.wait()
            if prefetch and u + 1 < n:
                pending = self._gather(u + 1)
            self.units[u].bind(self.layout.unit_views(u, buf), None)
            h = self.units[u].forward(h, ctx)
            self._release(u, buf)
            del buf
            if not prefetch and u + 1 < n:
                pending = self._gather(u + 1)
        return h

    def backward(self, dy: Any, ctx: Any = None) -> Any:
        """Backward unit by unit: gather, compute, reduce-scatter the gradients, drop.
        Collective over dp. Returns the input gradient of the first unit."""
        n = len(self.units)
        prefetch = self.config.prefetch
        pending = self._gather(n - 1)
        for u in range(n - 1, -1, -1):
            buf = pending.wait()
            if prefetch and u > 0:
                pending = self._gather(u - 1)
            span = self.layout.units[u]
            gbuf = np.zeros(span.padded, dtype=self.dtype)
            self._track(gbuf.nbytes)
            self.units[u].bind(self.layout.unit_views(u, buf), self.layout.unit_views(u, gbuf))
            dy = self.units[u].backward(dy, ctx)
            self._release(u, buf)
            del buf
            self._start_reduce_scatter(u, gbuf)
            self._progress_reduce_scatter(wait=False)
            if not prefetch and u > 0:
                pending = self._gather(u - 1)
        return dy

    def update_pieces(self) -> list[tuple[np.ndarray, np.ndarray, slice]]:
        sl = slice(0, self.layout.local_size)
        return [(self.param_shard, self.grad_shard, sl)]

    def full_parameters(self) -> dict[str, np.ndarray]:
        full = self.gather_state(self.param_shard)
        return {n: v.copy() for n, v in self.layout.full_views(full).items()}

    def load_full_parameters(self, params: dict[str, np.ndarray]) -> None:
        full = np.zeros(self.layout.full_size, dtype=self.dtype)
        views = self.layout.full_views(full)
        for name, arr in params.items():
            views[name][...] = arr
        self.scatter_state(full, self.param_shard)


class ZeRO2Optimizer(ShardedOptimizer):
    """ZeRO stage 2: gradients reduce-scattered unit by unit into the local shard;
    optimizer state sharded; parameters allgathered after the shard update."""

    model_class = ZeRO2Model


class ZeRO3Optimizer(ShardedOptimizer):
    """ZeRO stage 3 / FSDP: parameters, gradients and optimizer state sharded; each unit
    gathered just in time with the next one prefetched."""

    model_class = ZeRO3Model


FSDPModel = ZeRO3Model
FSDPOptimizer = ZeRO3Optimizer
