"""The reference system's names, as thin entry points over the components.

Each class below only fixes arguments of :class:`~mpidist.parallel.engine.ShardedOptimizer`
or :class:`~mpidist.parallel.model.ShardedModel` (a level, a hook, the hybrid name) and
adds the accessors its users know (``compression_ratio``, ``flush``...). Nothing here
changes how a step runs: that is the level's and the hook's.
"""

from __future__ import annotations

from typing import Any

from mpidist.parallel.compression import Compression
from mpidist.parallel.config import ShardingConfiguration
from mpidist.parallel.engine import ShardedOptimizer
from mpidist.parallel.hooks import AsyncSGD, LocalSGD, check_int
from mpidist.parallel.model import ShardedModel

__all__ = [
    "AsyncSGDOptimizer",
    "DDPModel",
    "DDPOptimizer",
    "FSDPModel",
    "FSDPOptimizer",
    "GradientCompressionOptimizer",
    "HybridShardedOptimizer",
    "LocalSGDOptimizer",
    "ZeRO1Model",
    "ZeRO1Optimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
]


class DDPModel(ShardedModel):
    """A model whose gradients are averaged over the data-parallel group (PyTorch DDP):
    level 0. Construction is collective over the mesh (parameters broadcast from dp rank 0);
    ``backward`` starts each bucket's allreduce as soon as backward has filled it."""

    default_level = 0


class ZeRO1Model(ShardedModel):
    """DDP's replicated parameters and allreduced gradients, the optimizer state sharded
    over dp (ZeRO stage 1, level 1)."""

    default_level = 1


class ZeRO2Model(ShardedModel):
    """Full parameters, gradients reduce-scattered unit by unit into the local shard, the
    optimizer state sharded (ZeRO stage 2, level 2)."""

    default_level = 2


class ZeRO3Model(ShardedModel):
    """Parameters, gradients and optimizer state all sharded, each unit gathered just in
    time with the next one prefetched (ZeRO stage 3 / FSDP, level 3)."""

    default_level = 3


class DDPOptimizer(ShardedOptimizer):
    """Data-parallel training with gradients averaged by MPI Allreduce (PyTorch DDP).

    Every rank holds the whole model and optimizer state; gradients are bucketed and
    allreduced while backward runs; every rank applies the same fused update.
    """

    default_level = 0


class ZeRO1Optimizer(ShardedOptimizer):
    """ZeRO stage 1: optimizer state sharded over the data-parallel group; gradients
    allreduced as in DDP, each rank updates its shard, parameters allgathered."""

    default_level = 1


class ZeRO2Optimizer(ShardedOptimizer):
    """ZeRO stage 2: gradients reduce-scattered unit by unit into the local shard;
    optimizer state sharded; parameters allgathered after the shard update."""

    default_level = 2


class ZeRO3Optimizer(ShardedOptimizer):
    """ZeRO stage 3 / FSDP: parameters, gradients and optimizer state sharded; each unit
    gathered just in time with the next one prefetched."""

    default_level = 3


FSDPModel = ZeRO3Model
FSDPOptimizer = ZeRO3Optimizer


class HybridShardedOptimizer(ShardedOptimizer):
    """3D-parallel training (pipeline × data × tensor) with ZeRO over dp: the same
    component as every strategy, on a mesh with pp and tp.

    Args:
        base: the optimizer whose fused kernel updates each shard (``mpidist.optim``).
        config: :class:`ShardingConfiguration`; ``config.mesh`` (a ProcessMesh with the
            sizes) or the sizes below; ``micro_batches`` micro-batches per step run through
            the pipeline; ``max_grad_norm`` clips by the norm over the whole mesh.
        pipeline_parallel_size, tensor_parallel_size: pp and tp sizes.
        data_parallel_size: dp size; -1 infers it from the world size.
        zero_stage: the sharding level over dp, 0-3.
        schedule: "1f1b" (default), "gpipe", "interleaved" (Megatron's: each stage holds
            ``virtual_stages`` non-adjacent model chunks, the bubble divided by them;
            micro_batches a multiple of pp) or "zero-bubble" (ZB-H1: the weight
            gradients deferred into the bubble).
        virtual_stages: chunks per stage of the interleaved schedule (None:
            ``config.virtual_stages``, default 1).
        balance: stage split, "uniform" (units) or "parameters" (parameter count).
        comm: communicator to build the mesh on when ``config.mesh`` is None.
        loss, lr_schedule: as for every strategy (with tp > 1 and a vocabulary-sharded
            output the loss must be :class:`~mpidist.nn.CrossEntropyLoss`, run
            vocab-parallel).
        tp_plan: which layers tensor parallelism splits, and how (layer name pattern ->
            "colwise", "rowwise", "vocab", "heads"; see :mod:`mpidist.nn.tp_plan`);
            default the model's own plan (GPT, MLP).

    Construction is pure and raises ValueError (same on every rank) for sizes that do not
    match the world or the mesh, a bad zero_stage, schedule or balance, virtual_stages > 1
    with another schedule than "interleaved", or micro_batches not a multiple of pp under
    it.
    """

    base_name = "hybrid"

    def __init__(self, base: Any, config: ShardingConfiguration | None = None,
                 pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1,
                 data_parallel_size: int = -1, zero_stage: int = 0, *,
                 schedule: str = "1f1b", balance: str = "uniform", comm: Any = None,
                 loss: Any = None, lr_schedule: Any = None, tp_plan: Any = None,
                 virtual_stages: int | None = None) -> None:
        super().__init__(base, config, level=zero_stage, loss=loss, lr_schedule=lr_schedule,
                         tp_plan=tp_plan, virtual_stages=virtual_stages,
                         pipeline_parallel_size=pipeline_parallel_size,
                         tensor_parallel_size=tensor_parallel_size,
                         data_parallel_size=data_parallel_size, schedule=schedule,
                         balance=balance, comm=comm)

    @property
    def zero_stage(self) -> int:
        return self.level

    @property
    def pipeline_parallel_size(self) -> int:
        return self.shape.pp

    @property
    def tensor_parallel_size(self) -> int:
        return self.shape.tp

    @property
    def data_parallel_size(self) -> int:
        return self.shape.dp


class LocalSGDOptimizer(ShardedOptimizer):
    """Local SGD (periodic model averaging; see :class:`~mpidist.parallel.hooks.LocalSGD`):
    each replica steps on its own batch's mean gradient for ``sync_every`` steps, then the
    replicas are averaged with one allreduce. ``zero_stage`` 1-3 shards each replica over
    ``shard_group`` consecutive ranks. ``step`` is collective over dp."""

    def __init__(self, base: Any, config: ShardingConfiguration | None = None, *,
                 sync_every: int = 8, average_optimizer_state: bool = False,
                 sync_loss: bool = True, zero_stage: int = 0, shard_group: int = 1,
                 loss: Any = None, lr_schedule: Any = None, comm: Any = None,
                 data_parallel_size: int = -1) -> None:
        check_int("LocalSGDOptimizer", "sync_every", sync_every, 1)
        hook = LocalSGD(sync_every, shard_group=shard_group,
                        average_optimizer_state=average_optimizer_state, sync_loss=sync_loss)
        super().__init__(base, config, level=zero_stage, hook=hook, loss=loss,
                         lr_schedule=lr_schedule, comm=comm,
                         data_parallel_size=data_parallel_size)

    @property
    def sync_every(self) -> int:
        return self.hook.period

    @property
    def averages(self) -> int:
        """How many times the replicas have been averaged."""
        return self.hook.averages

    def average_replicas(self) -> None:
        """Average the replicas now. Collective over dp."""
        self._require_model()
        self.hook.average_replicas(self)


class GradientCompressionOptimizer(ShardedOptimizer):
    """Data parallelism with compressed gradient exchange at any sharding level (see
    :class:`~mpidist.parallel.compression.Compression` for ``method``, ``ratio`` and
    ``rank``). ``step`` is collective over dp. ``compression_ratio`` = bytes sent / bytes
    of the uncompressed gradient pieces, both measured."""

    def __init__(self, base: Any, config: ShardingConfiguration | None = None, *,
                 method: str = "topk", ratio: float = 0.01, rank: int = 4,
                 zero_stage: int = 0, loss: Any = None, lr_schedule: Any = None,
                 comm: Any = None, data_parallel_size: int = -1) -> None:
        super().__init__(base, config, level=zero_stage,
                         hook=Compression(method, ratio=ratio, rank=rank), loss=loss,
                         lr_schedule=lr_schedule, comm=comm,
                         data_parallel_size=data_parallel_size)

    @property
    def method(self) -> str:
        return self.hook.method

    @property
    def compression_ratio(self) -> float:
        """Measured bytes sent / bytes of the uncompressed gradient pieces exchanged."""
        dense = self.hook.dense_bytes
        return self.bytes_sent / dense if dense else float("nan")


class AsyncSGDOptimizer(ShardedOptimizer):
    """SGD with bounded staleness (see :class:`~mpidist.parallel.hooks.AsyncSGD`): the
    gradient allreduces overlap the next ``staleness`` steps. ``step`` is collective over
    dp; :meth:`state_dict` flushes first (collective). ``zero_stage`` other than 0 is
    refused with the reason (its in-flight gradients are whole copies)."""

    def __init__(self, base: Any, config: ShardingConfiguration | None = None, *,
                 staleness: int = 1, zero_stage: int = 0, loss: Any = None,
                 lr_schedule: Any = None, comm: Any = None,
                 data_parallel_size: int = -1) -> None:
        super().__init__(base, config, level=zero_stage, hook=AsyncSGD(staleness), loss=loss,
                         lr_schedule=lr_schedule, comm=comm,
                         data_parallel_size=data_parallel_size)

    @property
    def staleness(self) -> int:
        return self.hook.staleness

    @property
    def in_flight(self) -> int:
        """Gradient exchanges started but not yet applied."""
        return len(self.hook.inflight)

    @property
    def applied(self) -> int:
        """Gradients applied so far."""
        return self.hook.applied

    def flush(self) -> None:
        """Wait for and apply every in-flight gradient, oldest first. Collective over dp."""
        self._require_model()
        self.hook.flush(self)
