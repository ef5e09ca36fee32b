"""mpidist: MPI-native distributed training.

The public API is re-exported here; see the submodules for the details.
"""

__version__ = "0.1.0"

from mpidist import collectives, data, nn, optim  # noqa: E402
from mpidist.buffers import Bucket, FlatBuffer, ShardedLayout  # noqa: E402
from mpidist.launch import abort_on_failure, detect_environment  # noqa: E402
from mpidist.mesh import ProcessMesh, layout  # noqa: E402
from mpidist.parallel import (  # noqa: E402
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
