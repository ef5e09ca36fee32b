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

import contextlib
import os
import time
from typing import Any

from mpidist.checkpoint import CheckpointError
from mpidist.checkpoint.agreement import io_mode
from mpidist.checkpoint.background import AsyncCheckpoint, default_pool
from mpidist.checkpoint.paths import TMP_RE, latest_checkpoint
from mpidist.checkpoint.training import save_training
from mpidist.core.comms import phase
from mpidist.core.failure import ProcessFailure, UnrecoverableFailure, commit, shrink
from mpidist.parallel.recovery import lost_words
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
        self._interrupted: int | None = None  # the step of a save call a rank was lost in
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
        asynchronous = self.cfg.checkpoint_async and not final
        t0 = time.perf_counter()
        try:
            self.wait(step)
            with phase("checkpoint"):
                result = save_training(self.cfg.out, opt, step=step, keep=self.cfg.keep,
                                       comm=comm, extra=extra, async_=asynchronous)
        except ProcessFailure as lost:
            self._lost_during_save(step, comm, lost)
            raise
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

    def _lost_during_save(self, step: int, comm: Any, lost: ProcessFailure) -> None:
        """A rank was lost during the save call of ``step`` (this rank's view). In the
        posix and serial modes the survivors recover in the job (the caller re-raises
        ``lost``): nothing was committed unless every rank had written its bytes, so
        ``latest`` names the previous checkpoint or the complete new one. MPI-IO is not
        promised to survive a failure: under ``mpio`` every survivor ends the job in one
        line instead (the previous checkpoint stays ``latest``), after shrinking ``comm``
        to the survivors so that the line is agreed and the job ends with status 1 (as
        for any failure the recovery cannot cover). Collective over the survivors then."""
        if io_mode(comm, None) == "mpio":
            shrunk = shrink(comm, original_size=comm.Get_size(), original_rank=comm.Get_rank())
            commit(shrunk.comm)
            raise UnrecoverableFailure(
                f"lost {lost_words(shrunk.dead)} during the checkpoint of step {step}, written "
                "with MPI-IO (MPIDIST_CHECKPOINT_IO=mpio), which is not promised to survive a "
                "failure: in-job recovery is off during an mpio save; latest is still "
                f"{self._latest() or 'none'}: restart from the last checkpoint (the "
                "supervisor, --requeue or mpidist train --resume)") from lost
        self._interrupted = step

    def mesh_changed(self, model: Any, changed: Any) -> None:
        """After in-job recovery from a lost rank (a loop hook, after rank 0's duties
        moved): the save in flight, which the recovery abandoned (its communicator was
        revoked; :func:`mpidist.parallel.recovery.recover`), never commits and ``latest``
        stays the previous checkpoint; an event ``checkpoint_abandoned`` says so, as it
        does for a save call a rank was lost in. The new rank 0 deletes the temp files
        those saves left (no save is in progress anywhere now). Not collective."""
        interrupted, self._interrupted = self._interrupted, None
        pending, self.pending = self.pending, None
        if interrupted is not None and (pending is None or pending.committed):
            self.events.write(event="checkpoint_abandoned", step=interrupted,
                              at_step=int(changed.step), latest=self._latest(),
                              reason=f"lost rank(s) {list(changed.dead)} during the save",
                              time=time.time())
        if pending is None:
            self._discard_temp_files()
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
                          latest=self._latest(),
                          reason=f"lost rank(s) {list(changed.dead)} while it was in flight",
                          time=time.time())
        self._discard_temp_files()

    def _latest(self) -> str | None:
        """The checkpoint ``latest`` names now (its file name), or None."""
        path = latest_checkpoint(self.cfg.out)
        return None if path is None else os.path.basename(path)

    def _discard_temp_files(self) -> None:
        """The new rank 0 deletes the hidden temp files of the run directory: after a
        recovery they are partial files of abandoned saves."""
        if not self.events.is_root():
            return
        for entry in os.scandir(self.cfg.out):
            if TMP_RE.match(entry.name) and entry.is_file():
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)

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
