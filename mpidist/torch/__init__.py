"""PyTorch on MPI: the "mpidist" torch.distributed backend (registered on import; see
:mod:`mpidist.torch.backend`), and torch's data-parallel interfaces re-implemented over MPI:
:class:`DistributedDataParallel`, :class:`ZeroRedundancyOptimizer`, :func:`fully_shard`
(FSDP2 style), :func:`save_checkpoint`/:func:`load_checkpoint`, :mod:`mpidist.torch.optim`
(fused kernels) and :mod:`mpidist.torch.distributed` (a thin layer over torch's module).

The wrappers' communicator is an mpi4py communicator given as ``comm=`` (default: every
rank). torch is an optional extra (``pip install mpidist[torch]``); the rest of mpidist
never imports it.
"""

from __future__ import annotations

from mpidist.torch.backend import register
from mpidist.torch.checkpoint import load_checkpoint, save_checkpoint
from mpidist.torch.ddp import DistributedDataParallel
from mpidist.torch.fsdp import FSDPModule, clip_grad_norm_, fully_shard, gathered_bytes
from mpidist.torch.zero import ZeroRedundancyOptimizer

register()

__all__ = [
    "DistributedDataParallel",
    "FSDPModule",
    "ZeroRedundancyOptimizer",
    "clip_grad_norm_",
    "fully_shard",
    "gathered_bytes",
    "load_checkpoint",
    "register",
    "save_checkpoint",
]
