"""In-job recovery in ``mpidist train``: the start line, and rank 0's duties after a lost rank.

Where MPI's fault tolerance is on on every rank (Open MPI 5 under ``mpiexec --with-ft
ulfm``, :mod:`mpidist.core.ft`; the ranks agree on it once, at the start) and the strategy
keeps copies (``--redundancy buddy``, the default: ddp, zero1, zero2, zero3), a lost rank
costs the job a recovery of well under a second and the redo of at most one step
(:mod:`mpidist.parallel.recovery`). Elsewhere one line at the start says why in-job
recovery is off, and a lost rank ends the job as it always did.

After a recovery, rank 0's duties move to the lowest surviving rank (rank 0 of the
survivors' communicator): the run directory's lock (taken over with the run's token),
``metrics.jsonl`` and ``events.jsonl`` (the rows of the steps to be redone dropped, a line
the dead rank left half-written removed), the progress line, the summary and the
checkpoints. Each recovery is an event ``recovered`` (the lost ranks, the steps completed,
the new world size, seconds of detect, shrink, rebuild and redo) written when the first
step after it completed, and a row of the summary's ``recoveries``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from mpidist.core.comms import in_place, mpi
from mpidist.core.failure import enable
from mpidist.parallel.recovery import lost_words
from mpidist.run.directory import JSONL_FILES, drop_rows_after
from mpidist.run.lock import RunLock
from mpidist.run.opening import HOLDER
from mpidist.run.outputs import Progress

__all__ = ["RunRecovery"]

log = logging.getLogger("mpidist.cli.train")


class RunRecovery:
    """The recovery side of one run (a loop hook: ``mesh_changed``, ``after_step``).

    Construction is collective over the run's communicator (one allreduce: whether every
    rank has fault tolerance); it sets the optimizer's ``redundancy_mode`` before the model
    is wrapped.
    """

    def __init__(self, run: Any) -> None:
        from mpidist.core.ft import fault_tolerance

        self.run = run
        self.verdict = fault_tolerance()
        on = np.array([1 if self.verdict.available else 0], dtype=np.int64)
        comm = run.comm
        if comm is not None and comm.Get_size() > 1:
            comm.Allreduce(in_place(), on, op=mpi().MIN)
        self.on = bool(on[0])
        if self.on:
            enable()  # a lost rank revokes everything and raises ProcessFailure
        if not self.verdict.available:
            self.why = self.verdict.reason
        elif not self.on:
            self.why = "MPI's fault tolerance is not on on every rank"
        else:
            self.why = ""
        run.opt.redundancy_mode = None if self.on and run.cfg.redundancy == "buddy" \
            else "none"
        self.history: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None

    def line(self) -> str:
        """``in-job recovery on (...)`` or ``in-job recovery off: <why>`` (after wrap)."""
        if self.why:
            return f"in-job recovery off: {self.why}"
        return f"in-job recovery {self.run.opt.recovery_status()}"

    def start_fields(self) -> dict[str, Any]:
        """What the run's start event says of fault tolerance and in-job recovery."""
        return {"fault_tolerance": self.verdict.line(), "recovery": self.line()}

    def announce(self) -> None:
        """Rank 0 prints :meth:`line` (in runs of several ranks). Not collective."""
        run = self.run
        if run.is_root() and run.world_size() > 1:
            print(f"mpidist train: {self.line()}", flush=True)

    # -- loop hooks ------------------------------------------------------------------------------
    def mesh_changed(self, model: Any, changed: Any) -> None:
        """After a recovery, on every survivor: the run goes on on the survivors."""
        run = self.run
        self.flush()
        run.model = model
        run.comm = changed.comm
        if run.is_root():
            self._take_root_duties(changed.step)
        t = changed.timing
        self._pending = {"event": "recovered", "step": int(changed.step),
                         "lost": list(changed.dead), "world_size": int(changed.world_size),
                         "detect_s": t.get("detect", 0.0), "shrink_s": t.get("shrink", 0.0),
                         "rebuild_s": t.get("rebuild", 0.0), "moved_bytes": changed.moved_bytes,
                         "detected_at": t.get("detected_at", 0.0),
                         "recovered_at": t.get("recovered_at", time.time())}
        if run.is_root():
            lost = lost_words(changed.dead) if changed.dead else "a newcomer during a join"
            print(f"mpidist train: lost {lost}; {changed.world_size} "
                  f"rank(s) go on from step {changed.step} (shrink and agree "
                  f"{t.get('shrink', 0.0):.3f} s, rebuild {t.get('rebuild', 0.0):.3f} s)",
                  flush=True)

    def after_step(self, model: Any, rec: Any) -> None:
        """The first step completed after a recovery closes its event (the redo time)."""
        if self._pending is not None:
            self.flush(redone_to=rec.step)

    def flush(self, redone_to: int | None = None) -> None:
        """Write the pending ``recovered`` event (``redo_s`` None when no step completed)."""
        row, self._pending = self._pending, None
        if row is None:
            return
        now = time.time()
        row["redo_s"] = None if redone_to is None else now - row["recovered_at"]
        row["total_s"] = None if redone_to is None else now - row["detected_at"]
        row["time"] = now
        self.history.append({k: v for k, v in row.items() if k != "event"})
        self.run.events.write(**row)

    def _take_root_duties(self, step: int) -> None:
        """The lowest survivor takes rank 0's duties: the lock, the JSON-lines files past
        ``step`` (and a torn last line), the progress line."""
        run = self.run
        opening = run.opening
        if opening.lock is None:  # rank 0 died: its lock is this rank's now
            lock = RunLock(run.cfg.out, HOLDER)
            lock.take_over(opening.token or None)
            opening.lock = lock
        for name in JSONL_FILES:
            n = drop_rows_after(os.path.join(run.cfg.out, name), step)
            if n:
                log.info("%s: dropped %d row(s) past step %d (redone after a lost rank)",
                         name, n, step)
        progress = getattr(run, "progress", None)
        if progress is not None and progress.enabled:
            progress.rewind(step)
        elif progress is not None:
            progress.close()
            run.progress = Progress(run.cfg.steps, step, enabled=run.cfg.progress)
