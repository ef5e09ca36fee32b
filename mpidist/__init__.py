"""mpidist: MPI-native distributed training.

The public API is re-exported here; see the submodules for the details.
"""

from mpidist import collectives, data, nn, optim
from mpidist._version import __version__
from mpidist.buffers import Bucket, FlatBuffer, ShardedLayout
from mpidist.launch import abort_on_failure, detect_environment
from mpidist.mesh import ProcessMesh, layout
from mpidist.parallel import (
    AsyncSGDOptimizer,
    DDPModel,
    DDPOptimizer,
    ElasticOptimizer,
    FSDPModel,
    FSDPOptimizer,
    GradientCompressionOptimizer,
    HybridShardedOptimizer,
    LocalSGDOptimizer,
    OptimizationResult,
    ShardingConfiguration,
    ZeRO1Model,
    ZeRO1Optimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
    ZeRO3Model,
    ZeRO3Optimizer,
)

__all__ = [
    "AsyncSGDOptimizer",
    "Bucket",
    "DDPModel",
    "DDPOptimizer",
    "ElasticOptimizer",
    "FSDPModel",
    "FSDPOptimizer",
    "FlatBuffer",
    "GradientCompressionOptimizer",
    "HybridShardedOptimizer",
    "LocalSGDOptimizer",
    "OptimizationResult",
    "ProcessMesh",
    "ShardedLayout",
    "ShardingConfiguration",
    "ZeRO1Model",
    "ZeRO1Optimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
    "__version__",
    "abort_on_failure",
    "collectives",
    "data",
    "detect_environment",
    "layout",
    "nn",
    "optim",
]
