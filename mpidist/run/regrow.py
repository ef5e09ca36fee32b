"""Growing back in ``mpidist train``: after in-job recovery, replacements join at a step boundary.

Where a lost rank is recovered in the job (:mod:`mpidist.run.recovery`), the job goes on
smaller; this hook brings it back (:mod:`mpidist.parallel.regrow`):

* **When.** At every step boundary while the job is smaller than it started (no
  communication otherwise), rank 0 reads ``<out>/elastic-target`` (as the elastic strategy
  does; the file is deleted, the size it asks for is kept) and broadcasts it; the ranks then
  take the same decision (:func:`~mpidist.parallel.regrow.joins_wanted`): spawn the missing
  ranks, up to the size the job started with or the smaller target, never after the last
  step. The first boundary after a recovery (once the interrupted step was redone) grows.
* **A failed join** (a newcomer or a survivor lost during it) is recovered like any lost
  rank, back to the pre-join mesh and state (an event ``join_abandoned``, with the
  recovery's own ``recovered``); the next try waits ``2 ** failures`` steps, and after
  :data:`~mpidist.parallel.regrow.MAX_TRIES` failed joins the run stops trying. A spawn
  that fails by itself (no slots) counts as a failed try (``grow_refused``).
* **Newcomers** run the same command (``sys.executable`` with ``sys.orig_argv``): they
  notice their parent communicator, never lock or decide (as an elastic joiner), receive
  the position and the run's counters from rank 0 and the state from the survivors, and
  train on from the next step. Their output goes where the launcher sends the spawned
  processes' (``mpiexec`` forwards it with the others'); they write no ``train.log``.
  Newcomers of an abandoned join exit at once (status 0, after MPI_Finalize).
* **Records.** An event ``grown`` per join (step, sizes, seconds of spawn and merge,
  transfer, copies, commit and the whole stall, apart from the recovery's), a row of the
  summary's ``grown``, a line from rank 0, and the start line ``growing back on (...)`` or
  ``off: <why>``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from mpidist.core.comms import mpi
from mpidist.parallel.regrow import (
    MAX_TRIES,
    GrowRefused,
    JoinAbandoned,
    grow,
    join,
    joins_wanted,
    next_try,
)
from mpidist.run.elastic import TARGET_FILE, read_target
from mpidist.run.launch.guard import enable_error_agreement, error_agreement_enabled

__all__ = ["RunRegrow", "before_exit"]

log = logging.getLogger("mpidist.cli.train")

_JOINED: list[Any] = [None]  # a newcomer's grown communicator
#: seconds a newcomer waits in MPI_Finalize at its end before it exits without it
FINALIZE_WAIT_S = 10.0


def before_exit(status: int) -> None:
    """In a newcomer: end the process as the survivors end theirs
    (:func:`mpidist.core.failure.leave`: a barrier on the job's communicator), but with
    ``MPI_Finalize``, which a spawned process must call (the launcher fails the job
    otherwise), then ``os._exit(status)``. Collective over the job's communicator;
    returns at once elsewhere (not a newcomer)."""
    from mpidist.core.failure import exit_barrier, job_comm, survived

    if _JOINED[0] is None:
        return
    comm = job_comm() if survived() else _JOINED[0]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    try:
        exit_barrier(comm)
    except Exception:  # noqa: BLE001 - a failure on the way out: leave anyway
        pass
    if survived():  # (Open MPI 5.0's MPI_Finalize crashes after a failure: ompi_dpm)
        os._exit(status)
    _after_the_survivors(comm)
    _finalize_and_exit(status)


def _after_the_survivors(comm: Any, seconds: float = 2.0) -> None:
    """Wait (at most ``seconds``) until this process knows that a survivor ended (they
    leave without MPI_Finalize right after the barrier: a failure to MPI): entered while
    they still run, MPI_Finalize's disconnect from their job waits for them forever."""
    MPI = mpi()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            MPI.Comm.Iprobe(comm, MPI.ANY_SOURCE, MPI.ANY_TAG)  # (progress)
        except MPI.Exception:
            pass
        failed = MPI.Comm.Get_failed(comm)
        n = failed.Get_size()
        failed.Free()
        if n:
            break
        time.sleep(0.01)
    time.sleep(0.05)


def _finalize_and_exit(status: int) -> None:
    """``MPI_Finalize`` (a spawned process must call it, or the launcher fails the job),
    then ``os._exit(status)``. MPI_Finalize disconnects from every job this process is
    connected to; after a failure in one of them it now and then waits forever
    (open-mpi/ompi#11404): the process leaves anyway after :data:`FINALIZE_WAIT_S`."""
    done = threading.Event()
    threading.Thread(target=lambda: done.wait(FINALIZE_WAIT_S) or os._exit(status),
                     daemon=True).start()
    mpi().Finalize()
    done.set()
    os._exit(status)


class RunRegrow:
    """The growing-back side of one run (a loop hook: ``between_steps``, ``mesh_changed``).
    Construction is not collective; :meth:`join` (newcomers) is, with the survivors."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.start = run.comm.Get_size()  # a newcomer learns the job's from the join
        self.target = 0
        self.failures = 0
        self.retry_at = 0
        self.history: list[dict[str, Any]] = []
        self.attempt: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}

    # -- the start ----------------------------------------------------------------------------
    def why_off(self) -> str:
        """Why the run does not grow back after a recovery ("" where it does)."""
        run = self.run
        if run.cfg.regrow == "none":
            return "--regrow none"
        if run.elastic:
            return "the elastic strategy changes its membership itself"
        status = run.recovery.line()
        if "recovery off" in status:
            return "in-job recovery is off"
        model = run.model
        if model.pp_size > 1 or model.tp_size > 1:
            return "meshes with pipeline or tensor parallelism do not grow back yet"
        return ""

    def line(self) -> str:
        """``growing back on (...)`` or ``growing back off: <why>`` (after wrap)."""
        why = self.why_off()
        if why:
            return f"growing back off: {why}"
        return (f"growing back on (after a lost rank, replacements are spawned up to "
                f"{self.start} rank(s) or <out>/{TARGET_FILE})")

    def start_fields(self) -> dict[str, Any]:
        """What the run's start event says of growing back."""
        return {"regrow": self.line()}

    def announce(self) -> None:
        """Rank 0 prints :meth:`line` where the run recovers in-job. Not collective."""
        run = self.run
        if run.is_root() and run.world_size() > 1 and run.recovery.on:
            print(f"mpidist train: {self.line()}", flush=True)

    # -- a newcomer -----------------------------------------------------------------------------
    def join(self, module: Any) -> Any:
        """In a spawned newcomer: join the job (collective with the survivors' ``grow``),
        take the run's counters, and return the model. Exits the process (status 0) when
        the join is abandoned."""
        run = self.run
        try:
            joined = join(run.opt, module, seed=run.cfg.seed)
        except JoinAbandoned as gone:
            log.warning("newcomer: %s; the job went on without this process", gone)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            _finalize_and_exit(0)
        meta = self.meta = joined.meta
        if meta.get("error_agreement"):
            enable_error_agreement(joined.comm)  # as the survivors' commit rebinds theirs
        run.comm = _JOINED[0] = joined.comm
        grow_state = meta["regrow"]
        self.start, self.target = int(grow_state["start"]), int(grow_state["target"])
        self.failures, self.retry_at = int(grow_state["failures"]), int(grow_state["retry_at"])
        run.last_saved = int(meta["run"]["last_saved"])
        run.val_loss = float(meta["run"]["val_loss"])
        log.info("joined the job at step %d (%d ranks) in %.3f s", run.opt.step_count,
                 joined.comm.Get_size(), joined.seconds)
        return joined.model

    def place_sampler(self, sampler: Any) -> None:
        """A newcomer's sampler at the job's position. Not collective."""
        data = self.meta.get("data")
        if data:
            sampler.load_state_dict(data)

    # -- loop hooks ------------------------------------------------------------------------------
    def between_steps(self, model: Any, rec: Any) -> Any:
        """Grow back where the job is below its size (see the module doc). Collective over
        the run's communicator where it is smaller than at the start; nothing otherwise."""
        run = self.run
        size = run.comm.Get_size()
        if size >= self.start or rec.step >= run.cfg.steps or self.why_off():
            return model
        asked = np.array([read_target(run.cfg.out) if run.is_root() else 0], dtype=np.int64)
        run.comm.Bcast(asked, root=0)
        if asked[0]:
            self.target = int(asked[0])
        joins = joins_wanted(size, self.start, self.target, rec.step, run.cfg.steps,
                             failures=self.failures, retry_at=self.retry_at)
        if not joins:
            return model
        run.checkpoints.wait(rec.step)  # a save in flight commits over the pre-join ranks
        self.attempt = {"step": int(rec.step), "from": size, "joins": joins,
                        "t0": time.time()}
        try:
            grown = grow(run.opt, joins, self._extra())
        except GrowRefused as refused:
            self._failed("grow_refused", rec.step, str(refused))
            return model
        self.attempt = None
        run.comm, run.model = grown.comm, grown.model
        s = grown.seconds
        row = {"step": int(rec.step), "from": size, "to": grown.comm.Get_size(),
               "joined": grown.joined, "spawn_s": s["spawn"], "transfer_s": s["transfer"],
               "copies_s": s["copies"], "commit_s": s["commit"], "stall_s": s["stall"],
               "moved_bytes": grown.moved_bytes}
        self.history.append(row)
        run.events.write(event="grown", **row, time=time.time())
        if run.is_root():
            print(f"mpidist train: grown back to {row['to']} rank(s) after step {rec.step} "
                  f"({grown.joined} spawned; the join stalled training {s['stall']:.3f} s: "
                  f"spawn {s['spawn']:.3f} s, state {s['transfer']:.3f} s)", flush=True)
        return grown.model

    def mesh_changed(self, model: Any, changed: Any) -> None:
        """After a recovery: a join in progress was abandoned (back to the pre-join mesh,
        or smaller). Not collective."""
        if self.attempt is not None:
            self._failed("join_abandoned", self.attempt["step"],
                         f"lost world rank(s) {list(changed.dead)} or newcomers during "
                         "the join")

    def _failed(self, event: str, step: int, why: str) -> None:
        attempt, self.attempt = self.attempt or {}, None
        self.failures += 1
        self.retry_at = next_try(step, self.failures)
        run = self.run
        row = {"step": int(step), "from": attempt.get("from"), "joins": attempt.get("joins"),
               "failures": self.failures, "reason": why,
               "retry_at": self.retry_at if self.failures < MAX_TRIES else None}
        run.events.write(event=event, **row, time=time.time())
        if run.is_root():
            then = (f"trying again after step {self.retry_at}" if self.failures < MAX_TRIES
                    else f"no more tries ({MAX_TRIES} failed)")
            print(f"mpidist train: growing back failed after step {step} ({why}); {then}",
                  flush=True)

    def _extra(self) -> dict[str, Any]:
        """What the newcomers receive besides the optimizer's position."""
        run = self.run
        return {"regrow": {"start": self.start, "target": self.target,
                           "failures": self.failures, "retry_at": self.retry_at},
                "run": {"last_saved": int(run.last_saved), "val_loss": float(run.val_loss)},
                "error_agreement": error_agreement_enabled()}
