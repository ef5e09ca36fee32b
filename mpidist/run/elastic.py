"""Elastic resizing as an event between steps of the one loop (``--strategy elastic``).

At every step boundary but the last:

* a worker that received SIGTERM leaves (its shards move to the others; it exits 0);
* if the file ``<out>/elastic-target`` exists, rank 0 reads a world size from it, deletes
  it, and asks for that size: ``echo 4 > runs/train/elastic-target`` grows the job to 4
  workers by spawning (or shrinks it: the highest ranks leave);
* changes outside ``[--min-workers, --max-workers]`` are refused (logged, an
  ``events.jsonl`` row) and training goes on.

Spawned workers run the same command line and join inside ``wrap``. Under the supervisor
(``mpidist run --elastic``), ``MPIDIST_MIN_WORKERS``/``MPIDIST_MAX_WORKERS`` are the bounds
when the config leaves them at their defaults. A whole elastic job is preempted with
SIGUSR1 (``#SBATCH --signal=USR1@60``), since SIGTERM makes one worker leave.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mpidist.run.config import TrainConfig

__all__ = ["TARGET_FILE", "ElasticHook", "elastic_bounds"]

log = logging.getLogger("mpidist.cli.train")

TARGET_FILE = "elastic-target"


def elastic_bounds(cfg: TrainConfig) -> tuple[int, int]:
    """``(min_workers, max_workers)``: the flags, or the supervisor's environment."""
    lo, hi = cfg.min_workers, cfg.max_workers
    if lo == TrainConfig.default("min_workers") and "MPIDIST_MIN_WORKERS" in os.environ:
        lo = int(os.environ["MPIDIST_MIN_WORKERS"])
    if hi == TrainConfig.default("max_workers") and "MPIDIST_MAX_WORKERS" in os.environ:
        hi = int(os.environ["MPIDIST_MAX_WORKERS"])
    return lo, hi


def read_target(out: str) -> int:
    """The world size asked for in ``<out>/elastic-target`` (deleted), or 0. Not collective."""
    path = os.path.join(out, TARGET_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        os.remove(path)
    except FileNotFoundError:
        return 0
    try:
        return max(0, int(text))
    except ValueError:
        log.warning("%s: %r is not a number of workers; ignored", path, text)
        return 0


class ElasticHook:
    """The loop hook that resizes an :class:`~mpidist.parallel.ElasticOptimizer` job."""

    def __init__(self, opt: Any, cfg: TrainConfig) -> None:
        self.opt = opt
        self.cfg = cfg
        self.left = False

    def between_steps(self, model: Any, record: Any) -> Any:
        """Agree on and carry out membership changes. Collective over the current workers.

        Returns the model to continue with, or None on a worker that left.
        """
        cfg = self.cfg
        if record.step >= cfg.steps:
            return model
        if self.opt.comm.Get_rank() == 0:
            target = read_target(cfg.out)
            if target:
                self.opt.scale_to(target)
        model = self.opt.maybe_rescale(model)
        if model is None:
            self.left = True
            return None
        if cfg.global_batch < model.dp_size * cfg.micro_batches:
            raise ValueError(f"--global-batch {cfg.global_batch} is too small for "
                             f"{model.dp_size} workers x {cfg.micro_batches} micro-batches")
        return model
