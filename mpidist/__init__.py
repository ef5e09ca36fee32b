"""mpidist: MPI-native distributed training.

The public API is re-exported here; see the submodules for the details. The communication
core (``mpidist.core``: mesh, comms, collectives, topology, buffers, devices) is re-exported
module by module, so ``from mpidist import collectives as C`` works as it always has.
"""

from mpidist import data, nn, optim
from mpidist._version import __version__
from mpidist.core import buffers, collectives, comms, devices, mesh, topology
from mpidist.core.buffers import Bucket, FlatBuffer, ShardedLayout
from mpidist.core.mesh import ProcessMesh, layout
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
from mpidist.run.launch import abort_on_failure, detect_environment

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
    "buffers",
    "collectives",
    "comms",
    "data",
    "detect_environment",
    "devices",
    "layout",
    "mesh",
    "nn",
    "optim",
    "topology",
]
