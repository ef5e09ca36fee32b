"""Parallel training as composable parts (design idea 11).

* :class:`ShardedModel` — the one sharded data-parallel component: a model on a
  (pp, dp, tp) mesh (tensor parallelism applied, pipeline stages cut), sharded over dp at a
  level 0-3, its gradients communicated by a hook;
* :mod:`~mpidist.parallel.hooks` — gradient communication: allreduce, reduce-scatter,
  :class:`Compression` (codecs with error feedback), :class:`LocalSGD` (periodic
  averaging), :class:`AsyncSGD` (bounded staleness);
* :class:`Placement` — which rank holds which slice of which tensor, with what padding;
* :class:`ShardedOptimizer` — the training step; :class:`ElasticOptimizer` — workers that
  leave and join; :mod:`~mpidist.parallel.recovery` — in-job recovery from a lost rank
  (:class:`MeshChanged`, under MPI's fault tolerance);
* :data:`STRATEGIES` — the registry of strategy names -> builders that the command line,
  the config, the adapters and elastic training read;
* the reference system's names (``DDPOptimizer``, ``ZeRO1Optimizer``...,
  ``HybridShardedOptimizer``, ``LocalSGDOptimizer``, ``GradientCompressionOptimizer``,
  ``AsyncSGDOptimizer``), thin entry points over these parts.
"""

from mpidist.core.failure import ProcessFailure, UnrecoverableFailure
from mpidist.parallel.compression import Compression
from mpidist.parallel.config import ShardingConfiguration
from mpidist.parallel.elastic import ElasticOptimizer
from mpidist.parallel.engine import OptimizationResult, ShardedOptimizer
from mpidist.parallel.exchange import CountingComm
from mpidist.parallel.hooks import AllReduce, AsyncSGD, GradientHook, LocalSGD, ReduceScatter
from mpidist.parallel.model import ShardedModel
from mpidist.parallel.placement import LEVELS, Placement
from mpidist.parallel.recovery import MeshChanged
from mpidist.parallel.registry import STRATEGIES
from mpidist.parallel.strategies import (
    AsyncSGDOptimizer,
    DDPModel,
    DDPOptimizer,
    FSDPModel,
    FSDPOptimizer,
    GradientCompressionOptimizer,
    HybridShardedOptimizer,
    LocalSGDOptimizer,
    ZeRO1Model,
    ZeRO1Optimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
    ZeRO3Model,
    ZeRO3Optimizer,
)

__all__ = [
    "LEVELS",
    "STRATEGIES",
    "AllReduce",
    "AsyncSGD",
    "AsyncSGDOptimizer",
    "Compression",
    "CountingComm",
    "DDPModel",
    "DDPOptimizer",
    "ElasticOptimizer",
    "FSDPModel",
    "FSDPOptimizer",
    "GradientCompressionOptimizer",
    "GradientHook",
    "HybridShardedOptimizer",
    "LocalSGD",
    "LocalSGDOptimizer",
    "MeshChanged",
    "OptimizationResult",
    "Placement",
    "ProcessFailure",
    "ReduceScatter",
    "ShardedModel",
    "ShardedOptimizer",
    "ShardingConfiguration",
    "UnrecoverableFailure",
    "ZeRO1Model",
    "ZeRO1Optimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
]
