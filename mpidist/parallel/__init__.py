"""Parallel training strategies: DDP, ZeRO-1/2/3 (FSDP), 3D hybrid,
Local SGD, gradient compression, bounded-staleness asynchronous SGD, and their configuration.

``STRATEGIES`` maps the data-parallel strategy names to their optimizers (all constructed as
``Optimizer(base, config, loss=..., lr_schedule=...)``); ``HybridShardedOptimizer`` also takes
the mesh sizes and the pipeline schedule.
"""

from mpidist.parallel.async_sgd import AsyncSGDOptimizer
from mpidist.parallel.compression import GradientCompressionOptimizer
from mpidist.parallel.config import ShardingConfiguration
from mpidist.parallel.ddp import DDPModel, DDPOptimizer, ZeRO1Model, ZeRO1Optimizer
from mpidist.parallel.elastic import ElasticOptimizer
from mpidist.parallel.engine import OptimizationResult, ShardedModel, ShardedOptimizer
from mpidist.parallel.exchange import CountingComm
from mpidist.parallel.hybrid import (
    HybridDDPModel,
    HybridModel,
    HybridShardedOptimizer,
    HybridZeRO1Model,
    HybridZeRO2Model,
    HybridZeRO3Model,
)
from mpidist.parallel.local_sgd import LocalSGDOptimizer
from mpidist.parallel.zero import (
    FSDPModel,
    FSDPOptimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
    ZeRO3Model,
    ZeRO3Optimizer,
)

STRATEGIES: dict[str, type[ShardedOptimizer]] = {
    "ddp": DDPOptimizer,
    "zero1": ZeRO1Optimizer,
    "zero2": ZeRO2Optimizer,
    "zero3": ZeRO3Optimizer,
}

__all__ = [
    "STRATEGIES",
    "AsyncSGDOptimizer",
    "CountingComm",
    "GradientCompressionOptimizer",
    "LocalSGDOptimizer",
    "DDPModel",
    "DDPOptimizer",
    "ElasticOptimizer",
    "FSDPModel",
    "FSDPOptimizer",
    "HybridDDPModel",
    "HybridModel",
    "HybridShardedOptimizer",
    "HybridZeRO1Model",
    "HybridZeRO2Model",
    "HybridZeRO3Model",
    "OptimizationResult",
    "ShardedModel",
    "ShardedOptimizer",
    "ShardingConfiguration",
    "ZeRO1Model",
    "ZeRO1Optimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
]
