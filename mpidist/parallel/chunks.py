"""A pipeline stage's units as chunks, and the zero-bubble split of their backward.

:class:`StageChunks` is part of :class:`~mpidist.parallel.model.ShardedModel`. A stage
holds one chunk of consecutive units, or, under the interleaved schedule, ``v`` chunks
(virtual stages ``c * pp + stage``, see :func:`~mpidist.parallel.pipeline.cut_virtual_stages`)
packed one after the other into the stage's one flat layout; ``chunk=`` picks the units a
forward or backward runs.

The zero-bubble split runs a backward in two halves: B (:meth:`StageChunks.backward_input`)
the input gradient, on the pipeline's critical path, and W
(:meth:`StageChunks.backward_weight`) the weight gradients, deferred into the bubble. W
reads only what B kept (the weight products' inputs and upstream gradients) and writes
gradient buffers, never the parameters. So at ZeRO-3 a unit is gathered for F and for B
(as for any backward) but not for W, and a unit's full gradient lives only while its W
runs: a working buffer of the unit, reduce-scattered into the gradient shard straight
after, as every backward does at levels 2 and 3 (a reduce-scatter per micro-batch, no
buffer of the whole stage's gradients held between B and W).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpidist.core.timeline import unit_span

__all__ = ["StageChunks", "chunk_spans"]


def chunk_spans(bounds: list[tuple[int, int]], pp: int, stage: int, virtual_stages: int
                ) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of each chunk of ``stage`` among the stage's units (its
    chunks' units one after the other), from every virtual stage's ``bounds``. Pure."""
    out, start = [], 0
    for c in range(virtual_stages):
        a, b = bounds[c * pp + stage]
        out.append((start, start + b - a))
        start += b - a
    return out


class StageChunks:
    """The chunk-aware half of :class:`~mpidist.parallel.model.ShardedModel`: which units
    a chunk runs, and the zero-bubble B/W split at every level (0-3)."""

    units: list[Any]
    chunks: list[tuple[int, int]]
    level: int
    layout: Any
    dtype: np.dtype
    config: Any
    _recompute: bool
    _kept: dict[tuple[int, Any], Any]

    def chunk_span(self, chunk: int | None = None) -> tuple[int, int]:
        """``(start, stop)`` of chunk ``chunk``'s units on this rank (None: every unit).
        ValueError for a chunk this rank does not hold. Pure."""
        if chunk is None:
            return 0, len(self.units)
        if not 0 <= chunk < len(self.chunks):
            raise ValueError(f"chunk={chunk!r} is not one of this stage's "
                             f"{len(self.chunks)} chunks")
        return self.chunks[chunk]

    def backward_input(self, dy: Any, ctx: Any = None, chunk: int | None = None) -> Any:
        """B: the input gradient of this rank's units (of ``chunk``) for micro-batch
        ``ctx``; what the weight gradients need stays kept until :meth:`backward_weight`.
        Collective over tp, and over the shard group at level 3 (each unit gathered, the
        next one prefetched, as a backward does)."""
        lo, hi = self.chunk_span(chunk)
        gathered = self.level == 3
        prefetch = self.config.prefetch
        pending = self._gather(hi - 1) if gathered and hi > lo else None
        for u in range(hi - 1, lo - 1, -1):
            buf = None
            if pending is not None:
                buf = pending.wait()
                pending = self._gather(u - 1) if prefetch and u > lo else None
                self.units[u].bind(self.layout.unit_views(u, buf), None)
            with unit_span("B", u, micro_batch=ctx):
                if self._recompute:
                    self.units[u].forward(self._kept.pop((u, ctx)), ctx)
                dy = self.units[u].backward_input(dy, ctx)
            if buf is not None:
                self._release(u, buf)
                del buf
                if not prefetch and u > lo:
                    pending = self._gather(u - 1)
        return dy

    def backward_weight(self, ctx: Any = None, chunk: int | None = None) -> None:
        """W: the weight gradients of micro-batch ``ctx`` (after its B). Levels 0-1 add them
        into the gradient buffer (synchronised by ``finish_gradient_sync``); levels 2-3
        hand each unit's to the hook at once, as their backward does (at level 3 without
        gathering the parameters: W does not read them). Collective over the shard group
        at levels 2-3."""
        lo, hi = self.chunk_span(chunk)
        for u in range(hi - 1, lo - 1, -1):
            if self.level < 2:
                with unit_span("W", u, micro_batch=ctx):
                    self.units[u].backward_weight(ctx)
            else:
                gbuf = self.xp.zeros(self.layout.units[u].padded, dtype=self.dtype)
                self._track(gbuf.nbytes)
                gviews = self.layout.unit_views(u, gbuf)
                # Level 3: W reads only gradient buffers (Module.backward_weight), so the
                # gradient views stand in for the parameters, which stay sharded.
                if self.level == 3:
                    pviews = gviews
                else:
                    pviews = self.layout.unit_views(u, self.layout.unit_full(u, self._compute))
                self.units[u].bind(pviews, gviews)
                with unit_span("W", u, micro_batch=ctx):
                    self.units[u].backward_weight(ctx)
                if self.level == 3:
                    self.units[u].unbind()
                else:
                    self.units[u].bind(pviews, None)
                self._start_unit(u, gbuf)
            self._progress()

    # (provided by ShardedModel)
    params: np.ndarray
    _compute: np.ndarray
    xp: Any

    def _gather(self, u: int) -> Any:
        raise NotImplementedError

    def _release(self, u: int, buf: np.ndarray) -> None:
        raise NotImplementedError

    def _track(self, nbytes: int) -> None:
        raise NotImplementedError

    def _start_unit(self, u: int, gbuf: np.ndarray) -> None:
        raise NotImplementedError

    def _progress(self) -> None:
        raise NotImplementedError
