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

All exchanges run on host (NumPy) arrays. This module gathers the three strategies, which
live in :mod:`~mpidist.parallel.local_sgd`, :mod:`~mpidist.parallel.compression` and
:mod:`~mpidist.parallel.async_sgd`, on top of :mod:`~mpidist.parallel.metered` (the shared
bases), :mod:`~mpidist.parallel.exchange` (the byte meter and request chains) and
:mod:`~mpidist.parallel.codecs`.
"""

from __future__ import annotations

from mpidist.parallel.async_sgd import AsyncSGDModel, AsyncSGDOptimizer
from mpidist.parallel.codecs import PowerSGDCodec, TopKCodec, bf16_decode, bf16_encode
from mpidist.parallel.compression import (
    METHODS,
    GradientCompressionModel,
    GradientCompressionOptimizer,
)
from mpidist.parallel.engine import ShardedOptimizer
from mpidist.parallel.exchange import CountingComm
from mpidist.parallel.local_sgd import LocalSGDModel, LocalSGDOptimizer

__all__ = [
    "METHODS",
    "STRATEGY_CLASSES",
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

STRATEGY_CLASSES: dict[str, type[ShardedOptimizer]] = {
    "local_sgd": LocalSGDOptimizer,
    "compression": GradientCompressionOptimizer,
    "async_sgd": AsyncSGDOptimizer,
}
