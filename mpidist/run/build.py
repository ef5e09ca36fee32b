"""Building a run from its :class:`~mpidist.run.config.TrainConfig`: the base optimizer,
the learning-rate schedule, the strategy, the model and the data."""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

from mpidist.run.config import TrainConfig

__all__ = ["inner_strategy", "make_data", "make_optimizer", "make_schedule", "make_strategy",
           "make_model"]

_DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")


def make_optimizer(cfg: TrainConfig) -> Any:
    """The base optimizer (:mod:`mpidist.optim`) named by ``cfg.optimizer``. Not collective."""
    from mpidist import optim

    kwargs: dict[str, Any] = {"lr": cfg.lr}
    known = optim.OPTIMIZERS.get(cfg.optimizer)
    if known is not None and "weight_decay" in {f.name for f in fields(known)}:
        kwargs["weight_decay"] = cfg.weight_decay
    return optim.create(cfg.optimizer, **kwargs)


def make_schedule(cfg: TrainConfig) -> Any:
    """Linear warm-up then cosine decay to ``min_lr`` at step ``lr_decay_steps`` (default
    ``steps``), ``min_lr`` after it."""
    from mpidist.optim import WarmupCosineSchedule

    horizon = max(1, cfg.lr_decay_steps or cfg.steps)
    return WarmupCosineSchedule(cfg.lr, total_steps=horizon,
                                warmup_steps=min(cfg.warmup_steps, horizon),
                                min_lr=min(cfg.min_lr, cfg.lr))


def inner_strategy(cfg: TrainConfig) -> str:
    """The data-parallel strategy an elastic run uses at every size."""
    return f"zero{cfg.zero_stage}" if cfg.zero_stage else "ddp"


def _check_combination(cfg: TrainConfig) -> None:
    """Flags that do not go together, raised before anything is built (pure)."""
    if cfg.strategy != "hybrid" and (cfg.pp != 1 or cfg.tp != 1):
        raise ValueError(
            f"--pp {cfg.pp} --tp {cfg.tp} need --strategy hybrid (got --strategy {cfg.strategy})"
        )
    if cfg.zero_stage and cfg.strategy not in ("hybrid", "elastic") \
            and cfg.strategy != f"zero{cfg.zero_stage}":
        raise ValueError(
            f"--zero-stage {cfg.zero_stage} applies to --strategy hybrid or elastic; for data "
            f"parallelism use --strategy zero{cfg.zero_stage} (got --strategy {cfg.strategy})"
        )


def make_strategy(cfg: TrainConfig, comm: Any) -> Any:
    """The strategy optimizer of ``cfg`` on ``comm``. Collective over ``comm`` (the mesh).

    Raises ValueError (the same on every rank, before any communication) for flags that do
    not go together.
    """
    from mpidist.nn import CrossEntropyLoss
    from mpidist.parallel import ShardingConfiguration

    _check_combination(cfg)
    common = {"loss": CrossEntropyLoss(), "lr_schedule": make_schedule(cfg)}
    base = make_optimizer(cfg)
    config = ShardingConfiguration(dtype=cfg.dtype, micro_batches=cfg.micro_batches,
                                   max_grad_norm=cfg.max_grad_norm, bucket_mb=cfg.bucket_mb)
    if cfg.strategy == "hybrid":
        from mpidist.parallel import HybridShardedOptimizer

        return HybridShardedOptimizer(
            base, config, pipeline_parallel_size=cfg.pp, tensor_parallel_size=cfg.tp,
            data_parallel_size=cfg.dp, zero_stage=cfg.zero_stage, schedule=cfg.schedule,
            comm=comm, **common)
    if cfg.strategy == "elastic":
        from mpidist.parallel import ElasticOptimizer
        from mpidist.run.elastic import elastic_bounds

        lo, hi = elastic_bounds(cfg)
        return ElasticOptimizer(base, config, lo, hi, strategy=inner_strategy(cfg), comm=comm,
                                events=os.path.join(cfg.out, "events.jsonl"), **common)
    from mpidist.mesh import ProcessMesh

    config = config.replace(mesh=ProcessMesh(comm, dp=cfg.dp))
    if cfg.strategy in _DATA_PARALLEL:
        from mpidist.parallel import STRATEGIES

        return STRATEGIES[cfg.strategy](base, config, **common)
    from mpidist.parallel import (
        AsyncSGDOptimizer,
        GradientCompressionOptimizer,
        LocalSGDOptimizer,
    )

    if cfg.strategy == "localsgd":
        return LocalSGDOptimizer(base, config, sync_every=cfg.sync_period, **common)
    if cfg.strategy == "compressed":
        return GradientCompressionOptimizer(base, config, method=cfg.compression,
                                            ratio=cfg.topk_ratio, rank=cfg.powersgd_rank,
                                            **common)
    if cfg.strategy == "async":
        return AsyncSGDOptimizer(base, config, staleness=cfg.staleness, **common)
    raise ValueError(f"--strategy {cfg.strategy!r} is not a strategy mpidist train builds")


def make_model(cfg: TrainConfig) -> Any:
    """The GPT of ``cfg`` (unwrapped). Not collective."""
    from mpidist.nn import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                         n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd))


def make_data(cfg: TrainConfig) -> tuple[Any, Any]:
    """The train and validation splits: ``--data PATH`` or the embedded corpus."""
    from mpidist.data import TextCorpus

    return (TextCorpus(cfg.block_size, split="train", path=cfg.data, binary=cfg.data_binary),
            TextCorpus(cfg.block_size, split="validation", path=cfg.data,
                       binary=cfg.data_binary))
