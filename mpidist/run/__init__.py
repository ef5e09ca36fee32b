"""The one training loop of ``mpidist train``: configuration, building a strategy, the loop
and its outputs. Elastic resizing and preemption are events the loop handles between steps.
"""

from mpidist.run.config import STRATEGY_NAMES, TrainConfig, add_train_arguments, load_toml
from mpidist.run.loop import run_training
from mpidist.run.preempt import EXIT_PREEMPTED

__all__ = ["EXIT_PREEMPTED", "STRATEGY_NAMES", "TrainConfig", "add_train_arguments",
           "load_toml", "run_training"]
