"""Preemption: a signal asks the run to stop after the current step with a checkpoint.

The handler only records the signal (SIGTERM, or SIGUSR1 as ``#SBATCH --signal=USR1@T``
sends); between steps the ranks agree (one allreduce) on whether any got one, so every
rank finishes the same step, writes the same checkpoint and exits with
:data:`EXIT_PREEMPTED`. With ``--requeue`` under Slurm rank 0 then requeues the job, whose
next start (``SLURM_RESTART_COUNT`` > 0) resumes. See ``docs/runs.md`` ("Signals").
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["EXIT_PREEMPTED", "PREEMPT_SIGNALS", "Preemption", "env_count", "requeue_slurm_job",
           "requeued_start"]

log = logging.getLogger("mpidist.cli.train")

#: Exit status of a preempted run (EX_TEMPFAIL of sysexits.h: "try again later"): every
#: rank finished the same step and the checkpoint of that step is complete.
EXIT_PREEMPTED = 75

#: The signals that preempt a run.
PREEMPT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Records preemption signals and, between steps, agrees on them over the job.

    ``install()`` sets the handlers (main thread only; elsewhere it is a no-op) and
    ``restore()`` puts the previous ones back.
    """

    def __init__(self, signals: Sequence[int] = PREEMPT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.signum = 0
        self.count = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle ``signals`` from now on. Not collective."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)

    def restore(self) -> None:
        """Put the previous handlers back. Not collective."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handler(self, signum: int, frame: Any) -> None:
        # Only a flag: the step in progress and a save in progress finish first.
        self.count += 1
        if not self.signum:
            self.signum = signum

    def agreed(self, comm: Any) -> int:
        """The largest signal number any rank received (0: none). Collective over ``comm``."""
        vec = np.array([self.signum], dtype=np.int64)
        if comm is not None and comm.Get_size() > 1:
            from mpi4py import MPI

            comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.MAX)
        return int(vec[0])


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15, and so on."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def requeue_slurm_job() -> str:
    """Requeue this Slurm job (``scontrol requeue $SLURM_JOB_ID``); what happened, in words.

    ``MPIDIST_SCONTROL`` names another ``scontrol`` (a site wrapper, or a stand-in in tests).

    Not collective (call on one rank). Outside Slurm, or without ``scontrol``, nothing is
    requeued and the returned text says why.
    """
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not requeued: not running under Slurm (no SLURM_JOB_ID)"
    name = os.environ.get("MPIDIST_SCONTROL", "scontrol")
    exe = shutil.which(name)
    if exe is None:
        return f"not requeued: {name} is not on PATH (job {job})"
    proc = subprocess.run([exe, "requeue", job], capture_output=True, text=True, timeout=20,
                          check=False)
    if proc.returncode != 0:
        return f"scontrol requeue {job} failed: {(proc.stderr or proc.stdout).strip()}"
    return f"requeued Slurm job {job}"


def env_count(name: str) -> int:
    """The integer in environment variable ``name``; 0 when unset, empty or not a number."""
    try:
        return int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0


def requeued_start() -> bool:
    """Whether this is a requeued start of a Slurm job (``SLURM_RESTART_COUNT`` > 0)."""
    return env_count("SLURM_RESTART_COUNT") > 0
