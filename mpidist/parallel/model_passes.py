"""Gradient synchronisation and the forward and backward passes of a sharded model.

:class:`ModelPasses` is part of :class:`~mpidist.parallel.model.ShardedModel` (which builds
the storage and the hook these methods run on): ``forward`` and ``backward`` through this
rank's units (at level 3 each unit gathered just in time, the next one prefetched), the
activation checkpointing of ``config.recompute``, and the gradient pieces handed to the
hook as backward produces them -- buckets of the full gradient at levels 0-1, each unit's
reduce-scattered shard folded into the gradient shard at levels 2-3 -- with ``no_sync``
for gradient accumulation and ``finish_gradient_sync`` to complete them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from mpidist.core import collectives as C
from mpidist.core.timeline import unit_span

__all__ = ["ModelPasses"]


class ModelPasses:
    """The forward, backward and gradient-synchronisation half of
    :class:`~mpidist.parallel.model.ShardedModel` (see the module docstring)."""

    # (provided by ShardedModel and StageChunks)
    units: list[Any]
    level: int
    layout: Any
    dtype: np.dtype
    config: Any
    hook: Any
    xp: Any
    local_module: Any
    compute_dtype: Any
    shard_comm: Any
    buckets: list[Any]
    grads: np.ndarray
    grad_shard: np.ndarray
    parameter_storage: np.ndarray
    _compute: np.ndarray
    _recompute: bool
    _kept: dict[tuple[int, Any], Any]
    _sync_enabled: bool
    _bucket_unit: list[int]
    _pending: dict[int, Any]
    _rs_pending: list[tuple[Any, np.ndarray, int]]
    _track: Any
    _untrack: Any
    chunk_span: Any

    # -- gradient synchronisation ------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward accumulates gradients locally without synchronising them
        (gradient accumulation); the first synchronised backward after it reduces the sum.
        Levels 2-3 reduce-scatter every backward and ignore it."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        """The context a training step runs a micro-batch in: synchronise on the last."""
        return contextlib.nullcontext() if last else self.no_sync()

    def zero_grad(self) -> None:
        """Zero this rank's gradient storage. Not collective."""
        (self.grads if self.level < 2 else self.grad_shard).fill(0)

    def _start_bucket(self, i: int, *, blocking: bool = False) -> None:
        if i not in self._pending:
            b = self.buckets[i]
            self._pending[i] = self.hook.start(i, self.grads[b.start:b.stop], blocking=blocking)

    def _progress(self) -> None:
        if self.level < 2:
            for req in self._pending.values():
                req.test()
        else:
            self._fold(wait=False)
        self.hook.progress()

    def sync_gradients(self) -> None:
        """Start every bucket not yet started (levels 0-1; blocking for the synchronous
        hooks: Open MPI's blocking collectives are tuned better than its nonblocking ones,
        so without overlap there is nothing to gain from nonblocking calls). Collective
        over the shard group."""
        if self.level < 2:
            for i in range(len(self.buckets)):
                self._start_bucket(i, blocking=True)

    def finish_gradient_sync(self) -> None:
        """Complete every pending gradient reduction. Collective over the shard group."""
        if self.level >= 2:
            self._fold(wait=True)
            return
        if self.hook.exchanges_in_backward and self.hook.required():
            self.sync_gradients()
        C.wait_all(list(self._pending.values()))
        self._pending.clear()

    def _start_unit(self, u: int, gbuf: np.ndarray) -> None:
        req = self.hook.start_scatter(u, gbuf)
        self._rs_pending.append((req, gbuf, u))
        self._track(self.layout.units[u].shard * self.dtype.itemsize)

    def _fold(self, wait: bool, max_pending: int = 1) -> None:
        """Fold finished unit reductions into the gradient shard; with ``wait``, all of
        them. At most ``max_pending`` stay in flight (a working set of a few units)."""
        keep = []
        for i, (req, buf, u) in enumerate(self._rs_pending):
            in_flight_after = len(self._rs_pending) - i - 1 + len(keep)
            if wait or in_flight_after >= max_pending or req.test():
                shard = req.wait()
                self.layout.unit_local(u, self.grad_shard)[:] += shard
                self._untrack(buf.nbytes + self.layout.units[u].shard * self.dtype.itemsize)
            else:
                keep.append((req, buf, u))
        self._rs_pending = keep

    # -- forward and backward ---------------------------------------------------------------
    def _gather(self, u: int) -> Any:
        buf = self.xp.empty(self.layout.units[u].padded, dtype=self._compute.dtype)
        self._track(buf.nbytes)
        return C.iallgather(self.layout.unit_local(u, self._compute), comm=self.shard_comm, out=buf)

    def sync_compute_parameters(self) -> None:
        """Mixed precision: copy the master weights into the 16-bit copy the layers run with
        (the engine does before each step and evaluation). Not collective."""
        if self.compute_dtype is not None:
            self._compute[...] = self.parameter_storage

    def _release(self, u: int, buf: np.ndarray) -> None:
        self.units[u].unbind()
        self._untrack(buf.nbytes)

    # -- activation checkpointing ------------------------------------------------------------
    def _unit_forward(self, u: int, h: Any, ctx: Any) -> Any:
        with unit_span("forward", u, micro_batch=ctx):
            if not self._recompute:
                return self.units[u].forward(h, ctx)
            self._kept[(u, ctx)] = h  # only the unit's input stays alive until its backward
            out = self.units[u].forward(h, ctx)
            self.units[u].clear_cache(ctx, every=False)
            return out

    def _unit_backward(self, u: int, dy: Any, ctx: Any) -> Any:
        with unit_span("backward", u, micro_batch=ctx):
            if self._recompute:
                self.units[u].forward(self._kept.pop((u, ctx)), ctx)
            return self.units[u].backward(dy, ctx)

    def clear_cache(self) -> None:
        """Forget every activation kept for backward (after an evaluation forward)."""
        self.local_module.clear_cache()
        self._kept.clear()

    def forward(self, x: Any, ctx: Any = None, chunk: int | None = None) -> Any:
        """Forward through this rank's units (of ``chunk`` only, when given). Collective
        over the shard group at level 3 (each unit gathered just in time, the next one
        prefetched); not collective else."""
        lo, n = self.chunk_span(chunk)
        if self.level < 3:
            h = x
            for u in range(lo, n):
                h = self._unit_forward(u, h, ctx)
            return h
        prefetch = self.config.prefetch
        pending = self._gather(lo)
        h = x
        for u in range(lo, n):
            buf = pending.wait()
            if prefetch and u + 1 < n:
                pending = self._gather(u + 1)
            self.units[u].bind(self.layout.unit_views(u, buf), None)
            h = self._unit_forward(u, h, ctx)
            self._release(u, buf)
            del buf
            if not prefetch and u + 1 < n:
                pending = self._gather(u + 1)
        return h

    def backward(self, dy: Any, ctx: Any = None, chunk: int | None = None) -> Any:
        """Backward through this rank's units (of ``chunk`` only, when given), handing each
        finished gradient piece to the hook; returns the input gradient of the first unit.
        Collective over the shard group when gradients are synchronised (every rank runs
        the same number of backwards). A step's backwards of several chunks must end with
        chunk 0's (as the interleaved schedule does): a gradient bucket starts once the
        lowest unit it holds has run its synchronised backward."""
        lo, hi = self.chunk_span(chunk)
        if self.level >= 2:
            return self._backward_units(dy, ctx, lo, hi)
        sync = self._sync_enabled and self.config.auto_sync_gradients \
            and self.hook.exchanges_in_backward
        overlap = sync and self.config.overlap and self.hook.required()
        for u in range(hi - 1, lo - 1, -1):
            dy = self._unit_backward(u, dy, ctx)
            if overlap:
                for i, after in enumerate(self._bucket_unit):
                    if after == u:
                        self._start_bucket(i)
            self._progress()
        if sync and not overlap and self.hook.required() and lo == 0:
            self.sync_gradients()
        return dy

    def _backward_units(self, dy: Any, ctx: Any, lo: int, hi: int) -> Any:
        """Levels 2-3: each unit's gradients go to a working buffer handed to the hook as
        soon as the unit is done (at level 3 the unit is gathered first)."""
        gathered = self.level == 3
        prefetch = self.config.prefetch
        pending = self._gather(hi - 1) if gathered else None
        for u in range(hi - 1, lo - 1, -1):
            if pending is not None:
                buf = pending.wait()
                pending = None
                if prefetch and u > lo:
                    pending = self._gather(u - 1)
                pviews = self.layout.unit_views(u, buf)
            else:
                pviews = self.layout.unit_views(u, self.layout.unit_full(u, self._compute))
            gbuf = self.xp.zeros(self.layout.units[u].padded, dtype=self.dtype)
            self._track(gbuf.nbytes)
            self.units[u].bind(pviews, self.layout.unit_views(u, gbuf))
            dy = self._unit_backward(u, dy, ctx)
            if gathered:
                self._release(u, buf)
                del buf
            else:
                self.units[u].bind(pviews, None)
            self._start_unit(u, gbuf)
            self._progress()
            if gathered and not prefetch and u > lo:
                pending = self._gather(u - 1)
        return dy
