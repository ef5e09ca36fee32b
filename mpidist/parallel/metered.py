"""What Local SGD, gradient compression and async SGD share: a DDP model whose
strategy-specific exchanges go through a :class:`~mpidist.parallel.exchange.CountingComm`,
and an optimizer base with the measured ``bytes_sent`` counters.

Loss convention (see :mod:`mpidist.parallel.engine`): each rank normalises its local loss
by the global number of samples, so summing gradients over the dp group gives the global
mean gradient, and a rank's own gradient times the dp size is its local-mean gradient.
The base step's control messages (the 16-byte batch-size check and the 8-byte loss
allreduce) do not go through the meter and are not counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from mpidist.parallel.ddp import DDPModel
from mpidist.parallel.engine import ShardedModel, ShardedOptimizer
from mpidist.parallel.exchange import CountingComm, RequestChain

__all__ = ["MeteredModel", "MeteredOptimizer", "check_int"]


class MeteredModel(DDPModel):
    """A DDP model whose strategy-specific exchanges go through a :class:`CountingComm`."""

    #: whether the strategy needs a second communicator for second-phase exchanges
    two_phase = False

    def _allocate(self) -> None:
        super()._allocate()
        self.meter = CountingComm(self.comm)
        self.meter2: CountingComm | None = None
        if self.two_phase and self.dp_size > 1:
            self.meter2 = CountingComm(self.comm.Dup(), totals=self.meter)
        self._gate: deque[RequestChain] = deque()
        self.dense_bytes = 0  # bytes of the uncompressed buffers handed to the exchange

    def free(self) -> None:
        """Free the communicators this wrapper created. Collective over the mesh."""
        if self.meter2 is not None:
            self.meter2.comm.Free()
            self.meter2 = None
        super().free()


class MeteredOptimizer(ShardedOptimizer):
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


def check_int(owner: str, name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{owner}: {name}={value!r} must be an integer >= {low}")
    return int(value)


