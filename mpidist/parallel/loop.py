"""The step loop every training run goes through: sample, batch, step, then the hooks.

:func:`run_steps` is the only place where mpidist iterates training steps. It is used by
:meth:`ShardedOptimizer.optimize` (no hooks but a recorder), and by ``mpidist train``
(:mod:`mpidist.run`), whose metrics, progress bar, evaluation, checkpoints, elastic resizing
and preemption are hooks. Every strategy runs through it unchanged.

A hook is any object with some of these methods (each optional):

* ``after_step(model, record)`` — after every step, on every rank, with a
  :class:`StepRecord`;
* ``between_steps(model, record) -> model | None`` — after every ``after_step`` of the
  step, before the next one (also after the last step); returns the model to train on next
  (a new object after an elastic resize) or None to stop the loop on this rank (a worker
  that left the job, or a preempted run after its checkpoint);
* ``mesh_changed(model, changed)`` — after in-job recovery from a lost rank
  (:class:`~mpidist.parallel.recovery.MeshChanged`), on every survivor, with the new model;
  the loop goes on from step ``changed.step + 1``. A survivor the new mesh has no place
  for (``changed.released``) stops instead (the outcome's ``released``), before the hooks.

Hooks run in order; a hook that stops the loop skips those after it. A lost rank seen in a
step or in a hook (:class:`~mpidist.core.failure.ProcessFailure`, under MPI's fault
tolerance) is recovered from by the optimizer
(:meth:`~mpidist.parallel.engine.ShardedOptimizer.recover`): the loop redoes the steps that
not every survivor completed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpidist.core.failure import ProcessFailure
from mpidist.parallel.recovery import MeshChanged

__all__ = ["LoopOutcome", "StepRecord", "recover_in_loop", "run_steps"]


@dataclass(frozen=True)
class StepRecord:
    """What one step produced, as the hooks see it."""

    step: int  #: the optimizer's step count after this step (1 after the first step)
    loss: float  #: the global loss of the step, identical on every rank
    seconds: float  #: wall time of sampling, batching and the step on this rank
    samples: int  #: samples of the global batch
    tokens: int  #: target elements (tokens) of the global batch


@dataclass
class LoopOutcome:
    """How :func:`run_steps` ended."""

    model: Any  #: the model to continue with, or None when a hook stopped the loop
    steps: int  #: steps taken by this call on this rank
    last: StepRecord | None  #: the last step's record (None if no step was taken)
    stopped: bool  #: whether a hook stopped the loop before ``until``
    #: whether a recovery released this rank (no place in the survivors' mesh)
    released: bool = False


def run_steps(opt: Any, model: Any, data: Any, *, until: int, sampler: Any,
              hooks: Sequence[Any] = ()) -> LoopOutcome:
    """Train until ``opt.step_count`` reaches ``until``. Collective over the dp group.

    ``data`` is anything with ``batch(indices) -> (x, y)``; ``sampler`` a
    :class:`~mpidist.data.GlobalBatchSampler`, whose ``next_local`` gives this rank its
    slice of the global batch. The loop condition is the optimizer's step count, not a
    local counter, so that workers joining an elastic job mid-run run the same loop.
    """
    steps = 0
    first = opt.step_count
    last: StepRecord | None = None
    after = [h.after_step for h in hooks if hasattr(h, "after_step")]
    between = [h.between_steps for h in hooks if hasattr(h, "between_steps")]
    while opt.step_count < until:
        try:
            t0 = time.perf_counter()
            idx = sampler.next_local(model.dp_rank, model.dp_size)
            x, y = data.batch(idx)
            loss = opt.step(model, (x, y))
            last = StepRecord(step=int(opt.step_count), loss=float(loss),
                              seconds=time.perf_counter() - t0,
                              samples=sampler.global_batch_size,
                              tokens=int(np.asarray(y).size) // max(len(idx), 1)
                              * sampler.global_batch_size)
            steps += 1
            for fn in after:
                fn(model, last)
            for fn in between:
                model = fn(model, last)
                if model is None:
                    return LoopOutcome(None, steps, last, True)
        except (MeshChanged, ProcessFailure) as lost:
            changed = lost if isinstance(lost, MeshChanged) else recover_in_loop(opt, lost)
            if changed.released:
                return LoopOutcome(None, steps, last, True, released=True)
            model = changed.model
            steps = max(0, opt.step_count - first)  # the steps redone count once
            for h in hooks:
                if hasattr(h, "mesh_changed"):
                    h.mesh_changed(model, changed)
    return LoopOutcome(model, steps, last, False)


def recover_in_loop(opt: Any, lost: ProcessFailure) -> MeshChanged:
    """The optimizer's recovery from ``lost``, a failure seen outside its step (in a hook
    or after the loop); ``lost`` again where the optimizer cannot recover. Collective over
    the survivors."""
    recover = getattr(opt, "recover", None)
    if recover is None:
        raise lost
    return recover(lost)
