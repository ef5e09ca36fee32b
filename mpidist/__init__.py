"""mpidist: MPI-native distributed training.

The public API is re-exported here; see the submodules for the details. The communication
core (``mpidist.core``: mesh, comms, collectives, topology, buffers, devices) is re-exported
module by module, so ``from mpidist import collectives as C`` works as it always has.

Modules that moved keep importing under their old names (``import mpidist.mesh``,
``from mpidist.collectives import allreduce``, ``python -m mpidist.plan``...): a finder on
``sys.meta_path`` gives the module under its new name, the same module object, imported only
when the old name is asked for. Modules that were removed fail with one line saying where
their contents went.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

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
    MeshChanged,
    OptimizationResult,
    ProcessFailure,
    ShardingConfiguration,
    UnrecoverableFailure,
    ZeRO1Model,
    ZeRO1Optimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
    ZeRO3Model,
    ZeRO3Optimizer,
)
from mpidist.run.launch import abort_on_failure, detect_environment

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import CodeType, ModuleType

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
    "MeshChanged",
    "OptimizationResult",
    "ProcessFailure",
    "ProcessMesh",
    "ShardedLayout",
    "ShardingConfiguration",
    "UnrecoverableFailure",
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


# Old module name -> its module now (submodules of a moved package follow it).
_MOVED = {
    "mpidist.buffers": "mpidist.core.buffers",
    "mpidist.collectives": "mpidist.core.collectives",
    "mpidist.comms": "mpidist.core.comms",
    "mpidist.devices": "mpidist.core.devices",
    "mpidist.mesh": "mpidist.core.mesh",
    "mpidist.topology": "mpidist.core.topology",
    "mpidist.kernels": "mpidist.optim.kernels",
    "mpidist.adapters": "mpidist.parallel.adapters",
    "mpidist.plan": "mpidist.parallel.plan",
    "mpidist.launch": "mpidist.run.launch",
    "mpidist.launch.log": "mpidist.run.logs",
    "mpidist.demo": "mpidist.cli.demo",
    "mpidist.tools_cli": "mpidist.cli.tools",
    "mpidist.train": "mpidist.cli.train",
}
# Old module name -> where its contents went (the module itself is gone).
_REMOVED = {
    "mpidist.adapters.torch": "mpidist.torch replaces it (DistributedDataParallel, "
                              "ZeroRedundancyOptimizer, fully_shard)",
    "mpidist.launch.elastic_train": "elastic training is `mpidist train --strategy elastic` "
                                    "(mpidist.run.elastic)",
    "mpidist.parallel.async_sgd": "AsyncSGDOptimizer is in mpidist.parallel "
                                  "(its exchange: mpidist.parallel.hooks.AsyncSGD)",
    "mpidist.parallel.communication": "LocalSGDOptimizer, GradientCompressionOptimizer, "
                                      "AsyncSGDOptimizer and CountingComm are in "
                                      "mpidist.parallel (the codecs: mpidist.parallel.codecs)",
    "mpidist.parallel.ddp": "DDPModel, DDPOptimizer, ZeRO1Model and ZeRO1Optimizer are in "
                            "mpidist.parallel",
    "mpidist.parallel.hybrid": "HybridShardedOptimizer is in mpidist.parallel (its models are "
                               "mpidist.parallel.ShardedModel on a (pp, dp, tp) mesh)",
    "mpidist.parallel.local_sgd": "LocalSGDOptimizer is in mpidist.parallel "
                                  "(its exchange: mpidist.parallel.hooks.LocalSGD)",
    "mpidist.parallel.metered": "the metered exchanges are hooks in mpidist.parallel.hooks "
                                "(bytes_sent), counted by mpidist.parallel.CountingComm",
    "mpidist.parallel.zero": "ZeRO2Model, ZeRO2Optimizer, ZeRO3Model and ZeRO3Optimizer are in "
                             "mpidist.parallel",
}


def _new_name(fullname: str) -> str | None:
    """The module an old name stands for, or None when ``fullname`` is not an old name."""
    parent = fullname
    while "." in parent:
        if parent in _MOVED:
            return _MOVED[parent] + fullname[len(parent):]
        parent = parent.rpartition(".")[0]
    return None


class _MovedModules:
    """The finder and loader of the old names: the module is imported under its new name
    and the same object is entered under the old one (first on ``sys.meta_path``, so that
    a submodule of a moved package is never loaded a second time under its old name)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> ModuleSpec | None:
        if not fullname.startswith("mpidist.") or fullname in sys.modules:
            return None
        if fullname in _REMOVED:
            raise ModuleNotFoundError(f"No module named {fullname!r}: it was removed; "
                                      f"{_REMOVED[fullname]}", name=fullname)
        new = _new_name(fullname)
        if new is None:
            return None
        import importlib.machinery
        import importlib.util

        real = importlib.util.find_spec(new)
        if real is None:
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname, self, origin=real.origin,
            is_package=real.submodule_search_locations is not None)
        spec.submodule_search_locations = real.submodule_search_locations
        return spec

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        import importlib

        module = importlib.import_module(_new_name(spec.name))
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the old name's spec on the module: give it back its own.
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m OLD_NAME`` (runpy)."""
        import importlib.util

        real = importlib.util.find_spec(_new_name(fullname))
        return real.loader.get_code(real.name)


if not any(type(f).__name__ == "_MovedModules" for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
