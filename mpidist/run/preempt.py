"""The between-steps agreement, and preemption, its first user.

Between two steps the ranks of a run agree on everything that must be decided alike with
one collective: :class:`StepAgreement`, a small int64 vector with a slot per user
(:data:`AGREEMENT_SLOTS`: preemption, the asynchronous checkpoint's commit, in-job recovery,
straggler reports), reduced with one ``Allreduce(MAX)`` (a "min" slot travels negated).

Preemption: the handler only records the signal (SIGTERM, or SIGUSR1 as ``#SBATCH
--signal=USR1@T`` sends); between steps the ranks agree on whether any got one, so every
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

__all__ = ["AGREEMENT_SLOTS", "EXIT_PREEMPTED", "PREEMPT_SIGNALS", "Preemption", "StepAgreement",
           "env_count", "requeue_slurm_job", "requeued_start"]

log = logging.getLogger("mpidist.cli.train")

#: Exit status of a preempted run (EX_TEMPFAIL of sysexits.h: "try again later"): every
#: rank finished the same step and the checkpoint of that step is complete.
EXIT_PREEMPTED = 75

#: The signals that preempt a run.
PREEMPT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)


#: The slots of the between-steps agreement, in vector order: (name, "max" or "min"). A new
#: user adds its slot here, so that every rank has the same vector.
#:
#: - ``preempt``: the largest signal number any rank received (0: none);
#: - ``commit``: the smallest number of the asynchronous save every rank finished writing
#:   (its commit may happen now); ``commit_error``: a rank's background write failed;
#: - ``recovery``: a request of in-job recovery (grow back, a membership change);
#: - ``straggler``: the slowest rank's step time, encoded by its user.
AGREEMENT_SLOTS: tuple[tuple[str, str], ...] = (
    ("preempt", "max"), ("commit", "min"), ("commit_error", "max"), ("recovery", "max"),
    ("straggler", "max"))

_NEUTRAL = np.iinfo(np.int64).min + 1  # what a slot holds that no rank set


class StepAgreement:
    """The between-steps agreement: each user's int64 value in one vector, agreed with one
    ``Allreduce(MAX)`` over the run's communicator per step.

    ``set(name, value)`` records this rank's value of a slot (kept until set again);
    :meth:`agree` returns every slot's agreed value: the largest over the ranks for a
    "max" slot, the smallest for a "min" slot; a slot no rank set reads 0. The slots are
    :data:`AGREEMENT_SLOTS` on every rank, so the vector has the same layout everywhere.
    """

    def __init__(self, slots: Sequence[tuple[str, str]] = AGREEMENT_SLOTS) -> None:
        for name, how in slots:
            if how not in ("max", "min"):
                raise ValueError(f"agreement slot {name!r}: reduction {how!r} is not max or min")
        self.slots = tuple(slots)
        self._index = {name: i for i, (name, _) in enumerate(self.slots)}
        self._sign = np.array([1 if how == "max" else -1 for _, how in self.slots],
                              dtype=np.int64)
        self._vec = np.full(len(self.slots), _NEUTRAL, dtype=np.int64)
        self.agreed: dict[str, int] = dict.fromkeys(self._index, 0)
        self.count = 0

    def set(self, name: str, value: int) -> None:
        """This rank's value of slot ``name`` from now on. Not collective."""
        i = self._index[name]
        self._vec[i] = int(value) * self._sign[i]

    def clear(self, name: str) -> None:
        """Take this rank's value of slot ``name`` back (as if never set). Not collective."""
        self._vec[self._index[name]] = _NEUTRAL

    def agree(self, comm: Any) -> dict[str, int]:
        """Every slot's agreed value (also kept in :attr:`agreed`). Collective over
        ``comm`` (None or one rank: this rank's values): every rank of the run calls it at
        the same step boundary."""
        vec = self._vec.copy()
        if comm is not None and comm.Get_size() > 1:
            from mpi4py import MPI

            comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.MAX)
        self.count += 1
        self.agreed = {name: 0 if v == _NEUTRAL else int(v * self._sign[i])
                       for name, i, v in zip(self._index, self._index.values(), vec,
                                             strict=True)}
        return self.agreed


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

    def agreed(self, comm: Any, agreement: StepAgreement | None = None) -> int:
        """The largest signal number any rank received (0: none). Collective over ``comm``:
        it agrees ``agreement`` (every slot of the run's between-steps vector; a vector of
        this slot alone when None)."""
        agreement = StepAgreement((("preempt", "max"),)) if agreement is None else agreement
        agreement.set("preempt", self.signum)
        return agreement.agree(comm)["preempt"]


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
