"""Opening a run directory: the lock, the decision to start or resume, the settings.

:func:`open_run` is the first collective step of ``mpidist train``: rank 0 creates
``--out`` if needed, takes its lock (:mod:`mpidist.run.lock`) and looks at what it holds;
every rank receives that (one broadcast) and decides the same way
(:mod:`mpidist.run.resume`). Nothing is written before the decision but the directory and
the lock, and both are removed again when the decision is an error or "nothing to do".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from mpidist.core.comms import bcast_json
from mpidist.run.config import TrainConfig
from mpidist.run.directory import inspect_out
from mpidist.run.lock import TOKEN_ENV, RunLock
from mpidist.run.preempt import env_count, requeued_start
from mpidist.run.resume import NothingToDo, decide_start, resolve_settings

__all__ = ["HOLDER", "RunOpening", "open_run", "restart_count", "restart_requested"]

#: The name a training run's lock gives its holder.
HOLDER = "mpidist train rank 0"


def restart_count() -> int:
    """Which restart of its supervisor this launch is (``MPIDIST_RESTART``; 0: the first
    launch, or none)."""
    return env_count("MPIDIST_RESTART")


def restart_requested(cfg: TrainConfig) -> bool:
    """Whether this start is a restart: a supervisor's (``MPIDIST_RESTART`` > 0) or a
    requeued Slurm job's under ``--requeue``. A restart resumes when it can."""
    return restart_count() > 0 or (cfg.requeue and requeued_start())


@dataclass
class RunOpening:
    """The outcome of :func:`open_run` on this rank."""

    cfg: TrainConfig  #: the settings the run uses (restored from the checkpoint on resume)
    mode: str  #: "start", "resume", or "nothing" (the checkpoint is at --steps already)
    state: dict[str, Any]  #: what rank 0 found in --out (see inspect_out)
    token: str = ""  #: the lock's token (every rank knows it)
    message: str = ""  #: the "nothing to do" line
    notes: list[str] = field(default_factory=list)  #: hyperparameters that changed
    lock: RunLock | None = None  #: the lock, on the rank that holds it
    created: bool = False  #: whether rank 0 created --out

    def close(self, failed: bool) -> None:
        """Give the lock back; after a failure remove --out again if this run created it
        and left it empty. Not collective."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if failed and self.created:
            with contextlib.suppress(OSError):
                os.rmdir(self.cfg.out)


def _rank0_look(cfg: TrainConfig, restart: bool) -> tuple[dict[str, Any], RunLock | None]:
    """Rank 0: lock --out (creating it) and look inside; the report for the others."""
    report: dict[str, Any] = {"error": "", "token": "", "created": False, "state": None}
    lock = None
    if cfg.resume is True and not restart and not os.path.isdir(cfg.out):
        report["state"] = inspect_out(cfg.out)  # an error below, and nothing created
        return report, None
    try:
        report["created"] = not os.path.exists(cfg.out)
        os.makedirs(cfg.out, exist_ok=True)
        lock = RunLock(cfg.out, HOLDER)
        lock.acquire(inherit=os.environ.get(TOKEN_ENV) or None)
        report["token"] = lock.token
        report["state"] = inspect_out(cfg.out)
    except OSError as exc:
        report["error"] = f"--out {cfg.out!r} cannot be used: {exc.strerror or exc}"
    except ValueError as exc:
        report["error"] = str(exc)
    if report["error"] and lock is not None:
        lock.release()
        lock = None
    if report["error"] and report["created"]:
        with contextlib.suppress(OSError):
            os.rmdir(cfg.out)
    return report, lock


def _fresh(cfg: TrainConfig) -> TrainConfig:
    """A run's settings as they are stored: the schedule's horizon, the vocabulary (the
    data's when not given) and the data's absolute paths fixed now, so that a resume from
    elsewhere finds them."""
    return dataclasses.replace(
        cfg, lr_decay_steps=cfg.lr_decay_steps or cfg.steps, vocab_size=cfg.data_vocab(),
        data=os.path.abspath(cfg.data) if cfg.data else None,
        data_blend=[[w, os.path.abspath(p)] for w, p in cfg.data_blend]
        if cfg.data_blend else None,
        val_data=os.path.abspath(cfg.val_data) if cfg.val_data else None)


def open_run(cfg: TrainConfig, comm: Any, given: set[str], *, joiner: bool = False
             ) -> RunOpening:
    """Lock ``cfg.out`` and decide how the run begins. Collective over ``comm``.

    Raises the same ValueError on every rank when the directory is in use, when
    ``--resume`` finds no checkpoint, when a new run would mix with another run's
    checkpoints, or when a flag contradicts the checkpoint. A worker spawned into an
    elastic job (``joiner``) only reads the settings, never locks or decides.
    """
    restart = restart_requested(cfg)
    lock = None
    report: dict[str, Any] | None = None
    if comm.Get_rank() == 0:
        if joiner:
            report = {"error": "", "token": "", "created": False, "state": inspect_out(cfg.out)}
        else:
            report, lock = _rank0_look(cfg, restart)
    report = bcast_json(report, comm)
    state = report["state"] or {}
    opening = RunOpening(cfg, "start", state, token=report["token"], lock=lock,
                         created=report["created"])
    if report["error"]:
        raise ValueError(report["error"])
    try:
        if joiner:
            mode = "resume" if (cfg.resume or restart) and state.get("latest") else "start"
        else:
            mode = decide_start(cfg, state, restart)
        if mode == "resume":
            resumed, opening.notes = resolve_settings(cfg, given, state, comm.Get_size())
            opening.cfg = _fresh(resumed)
        else:
            opening.cfg = _fresh(cfg)
        opening.mode = mode
    except NothingToDo as done:
        opening.mode, opening.message = "nothing", str(done)
        opening.close(failed=False)
    except ValueError:
        opening.close(failed=True)
        raise
    return opening
