"""What the adapters share: choosing a strategy and a small trainer around it."""

from __future__ import annotations

from typing import Any

from mpidist.optim import Optimizer, create
from mpidist.parallel import STRATEGIES, ShardedModel, ShardedOptimizer, ShardingConfiguration
from mpidist.parallel.engine import OptimizationResult
from mpidist.parallel.registry import DATA_PARALLEL, DEFAULT_STRATEGY

__all__ = ["Trainer", "make_optimizer"]


def make_optimizer(strategy: str | type[ShardedOptimizer] = DEFAULT_STRATEGY,
                   optimizer: Optimizer | str | None = None,
                   config: ShardingConfiguration | None = None, *,
                   loss: Any = None, lr_schedule: Any = None) -> ShardedOptimizer:
    """A strategy optimizer (a data-parallel strategy's name from
    :data:`~mpidist.parallel.registry.DATA_PARALLEL`, default the unsharded one, or a
    :class:`ShardedOptimizer` subclass) around a base optimizer (an ``mpidist.optim``
    instance, or a name such as ``"adamw"`` taking its defaults; default ``Adam()``).
    Not collective."""
    if isinstance(strategy, str):
        if strategy.lower() not in DATA_PARALLEL:
            raise ValueError(f"strategy={strategy!r} is not one of {list(DATA_PARALLEL)}")
        cls = STRATEGIES[strategy.lower()]
    elif isinstance(strategy, type) and issubclass(strategy, ShardedOptimizer):
        cls = strategy
    else:
        raise ValueError(f"strategy={strategy!r} must be a name or a ShardedOptimizer class")
    if optimizer is None:
        optimizer = create("adam")
    elif isinstance(optimizer, str):
        optimizer = create(optimizer)
    return cls(optimizer, config, loss=loss, lr_schedule=lr_schedule)


class Trainer:
    """A wrapped model and its strategy optimizer: ``trainer.step((x, y)) -> loss``.

    Attributes:
        optimizer: the :class:`~mpidist.parallel.ShardedOptimizer` (``timers``,
            ``state_dict``, ``save``/``load`` where available, ...).
        model: the strategy's :class:`~mpidist.parallel.ShardedModel` (flat ``params``,
            ``grads``/``grad_shard``, ``layout``, ``comm``).
        module: the adapter module the strategy runs.
    """

    def __init__(self, module: Any, optimizer: ShardedOptimizer, *, seed: int = 0) -> None:
        self.module = module
        self.optimizer = optimizer
        self.model: ShardedModel = optimizer.wrap(module, seed=seed)

    def step(self, batch: tuple[Any, Any]) -> float:
        """One training step on this rank's local batch ``(inputs, targets)``.

        Collective over the data-parallel group; returns the loss of the whole global batch
        (the same on every rank)."""
        return self.optimizer.step(self.model, batch)

    def optimize(self, data: Any, steps: int, *, global_batch_size: int, seed: int = 0,
                 callback: Any = None) -> OptimizationResult:
        """``ShardedOptimizer.optimize`` on this model. Collective over dp."""
        return self.optimizer.optimize(self.model, data, steps,
                                       global_batch_size=global_batch_size, seed=seed,
                                       callback=callback)

    @property
    def timers(self) -> dict[str, float]:
        """Accumulated seconds: ``compute`` (forward+backward), ``communication`` (gradient
        sync after backward, parameter allgather, loss allreduce) and ``update``."""
        return self.optimizer.timers

    def memory_report(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients, optimizer state. Not collective."""
        return self.optimizer.memory_report()

    def full_parameters(self) -> dict[str, Any]:
        """Every parameter as a full NumPy array (copies). Collective over dp."""
        return self.model.full_parameters()

    @property
    def comm(self) -> Any:
        """The data-parallel communicator."""
        return self.model.comm

    def free(self) -> None:
        """Free the communicators the strategy created. Collective."""
        self.model.free()

    def __repr__(self) -> str:
        return f"Trainer({self.model!r}, {type(self.optimizer).__name__})"
