"""Elastic resizing as an event between steps of the one loop (``--strategy elastic``).

At every step boundary but the last, a worker that received SIGTERM leaves, and rank 0
asks for the world size written to ``<out>/elastic-target`` (then deletes the file);
changes outside ``[--min-workers, --max-workers]`` are refused and training goes on.
Under the supervisor the bounds default to ``MPIDIST_MIN_WORKERS``/``MPIDIST_MAX_WORKERS``.
See the user guide, "Elastic training".
"""

from __future__ import annotations

import logging
import os
from typing import Any

from mpidist.run.config import TrainConfig

__all__ = ["TARGET_FILE", "ElasticHook", "check_global_batch", "elastic_bounds"]

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


def check_global_batch(cfg: TrainConfig, dp_size: int,
                       ranks: str = "data-parallel ranks") -> None:
    """Raise ValueError unless each of ``dp_size`` ranks gets a sample per micro-batch (any
    split works otherwise: the slices differ by at most one sample). Pure."""
    need = dp_size * cfg.micro_batches
    if cfg.global_batch < need:
        raise ValueError(f"--global-batch {cfg.global_batch} is too small for {dp_size} {ranks} "
                         f"x {cfg.micro_batches} micro-batches (needs at least {need})")


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
        check_global_batch(cfg, model.dp_size, "workers")
        return model
