"""The checkpoints of ``mpidist train``: blocking, or asynchronous (``--checkpoint-async``)
with the commit carried by the between-steps agreement.

An asynchronous save (:mod:`mpidist.checkpoint.background`) copies the state into host
memory and returns; a thread on every rank writes that rank's bytes. Between steps each rank
puts into the run's :class:`~mpidist.run.preempt.StepAgreement` the step of the save it has
finished writing (slot ``commit``, the minimum over the ranks) and whether its write failed
(``commit_error``, the maximum), so the one collective the loop makes anyway tells every
rank, alike, when the save can commit: at that boundary every rank joins the commit (the
checksums, rank 0's rename and ``latest``), or raises the failed rank's error, the same
:class:`~mpidist.checkpoint.CheckpointError` a blocking save raises. No collective is added
to a step. At most one save is in flight: the next save, a preemption and the end of the
run wait for it (and an elastic resize, :meth:`mpidist.parallel.ElasticOptimizer.maybe_rescale`,
commits it over the old workers before anything moves). The run's last checkpoint and a
preemption's are written blocking. In-job recovery from a lost rank abandons the save in
flight (event ``checkpoint_abandoned``): ``latest`` stays the previous checkpoint and the
next periodic save writes a new one.
"""

from __future__ import annotations

import os
import time
from typing import Any

from mpidist.checkpoint import CheckpointError
from mpidist.checkpoint.background import AsyncCheckpoint, default_pool
from mpidist.checkpoint.training import save_training
from mpidist.core.comms import phase
from mpidist.run.config import TrainConfig
from mpidist.run.outputs import JsonLines
from mpidist.run.preempt import StepAgreement

__all__ = ["RunCheckpoints"]


class RunCheckpoints:
    """A run's saves: starts them, commits the one in flight, records their events.

    ``blocking_seconds``: the time training stood still for saves (the save calls, waits
    and commits); ``background_seconds``: this rank's background writes. Every method is
    called on every rank at the same point of the run (those that commit are collective
    over the save's ranks).
    """

    def __init__(self, cfg: TrainConfig, events: JsonLines) -> None:
        self.cfg = cfg
        self.events = events
        self.pending: AsyncCheckpoint | None = None
        self._pending_step = 0
        self._pending_event: dict[str, Any] = {}
        self.blocking_seconds = 0.0
        self.background_seconds = 0.0

    @staticmethod
    def snapshot_bytes() -> int:
        """Host memory held for asynchronous saves' snapshots on this rank."""
        return default_pool().nbytes

    def save(self, opt: Any, step: int, comm: Any, world_size: int, *,
             extra: dict[str, Any], final: bool = False, **event: Any) -> None:
        """Save the state of ``step`` with the checkpoint attribute ``extra``
        (asynchronously with ``--checkpoint-async``, unless ``final``: the run's last
        checkpoint or a preemption's). Collective over ``comm``."""
        self.wait(step)
        asynchronous = self.cfg.checkpoint_async and not final
        t0 = time.perf_counter()
        with phase("checkpoint"):
            result = save_training(self.cfg.out, opt, step=step, keep=self.cfg.keep,
                                   comm=comm, extra=extra, async_=asynchronous)
        dt = time.perf_counter() - t0
        self.blocking_seconds += dt
        if not asynchronous:
            self._event(step, world_size, os.path.basename(result), seconds=dt,
                        blocking_seconds=dt, asynchronous=False, **event)
            return
        self.pending, self._pending_step = result, step
        self._pending_event = dict(event, world_size=world_size)
        if result.committed:  # mpio or serial I/O: written before returning
            self._done(result, step)

    def before_agreement(self, agreement: StepAgreement) -> None:
        """Put this rank's progress on the save in flight into ``agreement``. Local."""
        if self.pending is None or self.pending.committed:
            agreement.clear("commit")
            agreement.clear("commit_error")
            return
        done = self.pending.done()
        agreement.set("commit", self._pending_step if done else self._pending_step - 1)
        agreement.set("commit_error", 1 if self.pending.failed() else 0)

    def after_agreement(self, agreement: StepAgreement, step: int) -> None:
        """Commit the save in flight if the agreement says every rank finished writing it,
        or raise a rank's failure on every rank. Collective over the save's ranks then."""
        pending = self.pending
        if pending is None:
            return
        if not pending.committed:
            agreed = agreement.agreed
            t0 = time.perf_counter()
            try:
                with phase("checkpoint"):
                    pending.commit_agreed(all_done=agreed["commit"] >= self._pending_step,
                                          any_failed=agreed["commit_error"] > 0, step=step)
            except CheckpointError as exc:
                self._failed(step, exc)
                raise
            finally:
                self.blocking_seconds += time.perf_counter() - t0
        if pending.committed:
            self._done(pending, pending.commit_step if pending.commit_step is not None
                       else step)

    def wait(self, step: int) -> None:
        """Wait for the save in flight, if any, and commit it. Collective over its ranks."""
        pending = self.pending
        if pending is None:
            return
        t0 = time.perf_counter()
        try:
            with phase("checkpoint"):
                pending.wait(step)
        except CheckpointError as exc:
            self._failed(step, exc)
            raise
        finally:
            self.blocking_seconds += time.perf_counter() - t0
        self._done(pending, pending.commit_step if pending.commit_step is not None else step)

    def mesh_changed(self, model: Any, changed: Any) -> None:
        """After in-job recovery from a lost rank (a loop hook, after rank 0's duties
        moved): the save in flight, which the recovery abandoned (its communicator was
        revoked; :func:`mpidist.parallel.recovery.recover`), never commits and ``latest``
        stays the previous checkpoint; an event ``checkpoint_abandoned`` says so. Not
        collective."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending.committed:  # the lost rank went after the commit: it counts
            self.pending = pending
            self._done(pending, pending.commit_step if pending.commit_step is not None
                       else changed.step)
            return
        pending.abandon()  # already done by the recovery; here in case it was not
        self.background_seconds += pending.background_seconds
        self.events.write(event="checkpoint_abandoned", step=self._pending_step,
                          path=os.path.basename(pending.path), at_step=int(changed.step),
                          reason=f"lost rank(s) {list(changed.dead)} while it was in flight",
                          time=time.time())

    def _done(self, pending: AsyncCheckpoint, commit_step: int) -> None:
        self.pending = None
        self.background_seconds += pending.background_seconds
        self._event(self._pending_step, path=os.path.basename(pending.path),
                    seconds=pending.blocking_seconds + pending.commit_seconds,
                    blocking_seconds=pending.blocking_seconds,
                    background_seconds=pending.background_seconds,
                    commit_seconds=pending.commit_seconds, commit_step=commit_step,
                    asynchronous=True, **self._pending_event)

    def _failed(self, step: int, exc: CheckpointError) -> None:
        self.pending = None
        self.events.write(event="checkpoint_failed", step=self._pending_step, at_step=step,
                          error=str(exc), time=time.time())

    def _event(self, step: int, world_size: int | None = None, path: str = "",
               **fields: Any) -> None:
        if self.events.is_root():
            try:
                fields["bytes"] = os.path.getsize(os.path.join(self.cfg.out, path))
            except OSError:
                pass
        if world_size is not None:
            fields["world_size"] = world_size
        self.events.write(event="checkpoint", step=step, path=path, time=time.time(),
                          **fields)
