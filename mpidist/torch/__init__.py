"""PyTorch's data-parallel interfaces over MPI: a training script changes its imports only.

================================================  ==============================================
torch                                             mpidist.torch
================================================  ==============================================
``torch.nn.parallel.DistributedDataParallel``     :class:`DistributedDataParallel`
``torch.distributed.optim.ZeroRedundancyOptimizer``  :class:`ZeroRedundancyOptimizer`
``torch.distributed.fsdp.fully_shard``            :func:`fully_shard` (FSDP2 style)
``torch.distributed`` (rank, size, barrier, ...)  :mod:`mpidist.torch.distributed`
``torch.distributed.checkpoint``                  :func:`save_checkpoint`, :func:`load_checkpoint`
================================================  ==============================================

The communicator is an mpi4py communicator given as ``comm=`` (default: every rank), so
scripts run under ``mpiexec`` or ``srun`` with no rendezvous settings. torch is an optional
extra of mpidist (``pip install mpidist[torch]``); the rest of mpidist never imports it.
"""

from __future__ import annotations

from mpidist.torch.checkpoint import load_checkpoint, save_checkpoint
from mpidist.torch.ddp import DistributedDataParallel
from mpidist.torch.fsdp import FSDPModule, clip_grad_norm_, fully_shard, gathered_bytes
from mpidist.torch.zero import ZeroRedundancyOptimizer

__all__ = [
    "DistributedDataParallel",
    "FSDPModule",
    "ZeroRedundancyOptimizer",
    "clip_grad_norm_",
    "fully_shard",
    "gathered_bytes",
    "load_checkpoint",
    "save_checkpoint",
]
