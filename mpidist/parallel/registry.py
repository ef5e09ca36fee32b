"""The one registry of strategies: name -> builder.

The command line (``--strategy`` choices and which flags apply), the TOML config, the
adapters and elastic training read :data:`STRATEGIES`; a strategy is a level, a
gradient-communication hook and a mesh, so a builder is a few lines. A new strategy is one
:func:`register` call here (and, if it communicates gradients in a new way, a hook in
:mod:`mpidist.parallel.hooks`).

Every builder is called as ``STRATEGIES[name](base, config=None, *, loss=None,
lr_schedule=None, comm=None, **options)`` with the options it declares (named as the
command line's flags: ``zero_stage``, ``pp``, ``sync_period``...); it is pure and returns
a :class:`~mpidist.parallel.engine.ShardedOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpidist.parallel.placement import LEVEL_NAMES

__all__ = ["DATA_PARALLEL", "DEFAULT_STRATEGY", "STRATEGIES", "Strategy", "register"]


@dataclass(frozen=True)
class Strategy:
    """A registered strategy: its name, a line of help, the options it takes, and how it
    is built."""

    name: str
    help: str
    options: tuple[str, ...]
    build: Callable[..., Any]
    #: the sharding level it always runs at (None: from ``zero_stage``)
    level: int | None = None

    def __call__(self, base: Any, config: Any = None, *, loss: Any = None,
                 lr_schedule: Any = None, comm: Any = None, **options: Any) -> Any:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(f"strategy {self.name!r} takes no option {unknown[0]}="
                             f"{options[unknown[0]]!r} (its options: {list(self.options)})")
        from mpidist.parallel.config import ShardingConfiguration

        config = config if config is not None else ShardingConfiguration()
        return self.build(base, config, loss=loss, lr_schedule=lr_schedule, comm=comm,
                          **options)


STRATEGIES: dict[str, Strategy] = {}


def register(name: str, help: str, options: tuple[str, ...] = (), *,
             level: int | None = None) -> Callable[[Callable[..., Any]], Strategy]:
    """Decorator: register ``build`` under ``name``."""
    def deco(build: Callable[..., Any]) -> Strategy:
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} is registered twice")
        STRATEGIES[name] = Strategy(name, help, options, build, level)
        return STRATEGIES[name]
    return deco


def _level_strategy(level: int, name: str, help: str) -> None:
    @register(name, help, ("dp",), level=level)
    def build(base: Any, config: Any, *, comm: Any = None, dp: int = -1, **common: Any) -> Any:
        from mpidist.parallel import strategies as S

        entry = (S.DDPOptimizer, S.ZeRO1Optimizer, S.ZeRO2Optimizer, S.ZeRO3Optimizer)[level]
        return entry(base, config, comm=comm, data_parallel_size=dp, **common)


for _level, _help in enumerate((
        "replicated; gradients allreduced in buckets during backward",
        "optimizer state sharded over dp",
        "optimizer state and gradients sharded over dp",
        "parameters too (FSDP): each unit gathered just in time")):
    _level_strategy(_level, LEVEL_NAMES[_level], _help)

#: the strategies that are one sharding level with synchronous gradients
DATA_PARALLEL = LEVEL_NAMES
#: the strategy when none is named: level 0 (replicated, gradients allreduced)
DEFAULT_STRATEGY = LEVEL_NAMES[0]


@register("hybrid", "pipeline x data x tensor parallelism, ZeRO over dp",
          ("pp", "tp", "dp", "zero_stage", "schedule"))
def _hybrid(base: Any, config: Any, *, comm: Any = None, pp: int = 1, tp: int = 1,
            dp: int = -1, zero_stage: int = 0, schedule: str = "1f1b", **common: Any) -> Any:
    from mpidist.parallel.strategies import HybridShardedOptimizer

    return HybridShardedOptimizer(base, config, pp, tp, dp, zero_stage, schedule=schedule,
                                  comm=comm, **common)


@register("elastic", "workers may leave and join between steps (dp changes; pp, tp fixed)",
          ("pp", "tp", "zero_stage", "schedule", "min_workers", "max_workers", "events"))
def _elastic(base: Any, config: Any, *, comm: Any = None, pp: int = 1, tp: int = 1,
             zero_stage: int = 0, schedule: str = "1f1b", min_workers: int = 1,
             max_workers: int = 1024, events: Any = None, **common: Any) -> Any:
    from mpidist.parallel.elastic import ElasticOptimizer

    return ElasticOptimizer(base, config, min_workers, max_workers, zero_stage=zero_stage,
                            pipeline_parallel_size=pp, tensor_parallel_size=tp,
                            schedule=schedule, comm=comm, events=events, **common)


@register("localsgd", "replicas step alone and are averaged every --sync-period steps",
          ("dp", "zero_stage", "sync_period", "shard_group"))
def _localsgd(base: Any, config: Any, *, comm: Any = None, dp: int = -1, zero_stage: int = 0,
              sync_period: int = 8, shard_group: int = 1, **common: Any) -> Any:
    from mpidist.parallel.strategies import LocalSGDOptimizer

    return LocalSGDOptimizer(base, config, sync_every=sync_period, zero_stage=zero_stage,
                             shard_group=shard_group, comm=comm, data_parallel_size=dp,
                             **common)


@register("compressed", "gradients exchanged compressed, with error feedback",
          ("dp", "zero_stage", "compression", "topk_ratio", "powersgd_rank"))
def _compressed(base: Any, config: Any, *, comm: Any = None, dp: int = -1,
                zero_stage: int = 0, compression: str = "topk", topk_ratio: float = 0.01,
                powersgd_rank: int = 4, **common: Any) -> Any:
    from mpidist.parallel.strategies import GradientCompressionOptimizer

    return GradientCompressionOptimizer(base, config, method=compression, ratio=topk_ratio,
                                        rank=powersgd_rank, zero_stage=zero_stage, comm=comm,
                                        data_parallel_size=dp, **common)


@register("async", "gradients applied up to --staleness steps late", ("dp", "zero_stage",
                                                                      "staleness"))
def _async(base: Any, config: Any, *, comm: Any = None, dp: int = -1, zero_stage: int = 0,
           staleness: int = 1, **common: Any) -> Any:
    from mpidist.parallel.strategies import AsyncSGDOptimizer

    return AsyncSGDOptimizer(base, config, staleness=staleness, zero_stage=zero_stage,
                             comm=comm, data_parallel_size=dp, **common)
