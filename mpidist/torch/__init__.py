"""PyTorch on MPI: the "mpidist" torch.distributed backend, and torch's data-parallel
interfaces re-implemented over MPI.

``import mpidist.torch`` registers the backend (:mod:`mpidist.torch.backend`): then
``torch.distributed.init_process_group("mpidist")`` under ``mpiexec`` or ``srun`` needs no
rendezvous variables, and torch's own DDP, FSDP2, tensor and pipeline parallelism and
distributed checkpoints run over MPI.

================================================  ==============================================
torch                                             mpidist.torch
================================================  ==============================================
``torch.nn.parallel.DistributedDataParallel``     :class:`DistributedDataParallel`
``torch.distributed.optim.ZeroRedundancyOptimizer``  :class:`ZeroRedundancyOptimizer`
``torch.distributed.fsdp.fully_shard``            :func:`fully_shard` (FSDP2 style)
``torch.distributed``                             :mod:`mpidist.torch.distributed` (a thin layer)
``torch.distributed.checkpoint``                  :func:`save_checkpoint`, :func:`load_checkpoint`
``torch.optim.AdamW``, ``Adam``, ``SGD``           :mod:`mpidist.torch.optim` (fused kernels)
================================================  ==============================================

The wrappers' communicator is an mpi4py communicator given as ``comm=`` (default: every
rank). torch is an optional extra of mpidist (``pip install mpidist[torch]``); the rest of
mpidist never imports it.
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
