"""``mpidist run --elastic``: restart a crashed MPI job from its last checkpoint.

The supervisor is an ordinary process (not under MPI) that runs ``mpiexec -n N COMMAND...``
and, when that exits with a non-zero status other than 2 (refused input), launches it
again with the workers available now, within ``[min_workers, max_workers]``, up to
``--max-restarts`` times; the command continues from its checkpoint (give it ``--resume
auto``). It holds the lock of the command's ``--out`` (:mod:`mpidist.run.lock`) and hands it
to every launch. Available workers: ``--slots-file``, else ``MPIDIST_SLOTS``, else
``SLURM_NTASKS``, else the last launch's size. Events (``launch``, ``crash``, ``restart``,
``gave_up``, ``finished``, with the latest checkpoint's step) go to ``--events``, else the
command's ``--out``/``events.jsonl``. Each launch's environment: :func:`launch_env`. User
guide: "Elastic training".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpidist.data.sampler import checked_int
from mpidist.run.lock import TOKEN_ENV

__all__ = ["Supervisor", "add_parser", "available_slots", "launch_env", "read_slots_file"]

log = logging.getLogger("mpidist.supervisor")


def read_slots_file(path: str) -> int:
    """The number of worker slots a file offers. Not collective.

    Either one integer, or lines ``host slots=K`` (an Open MPI hostfile; a host line
    without ``slots=`` counts 1). Blank lines and ``#`` comments are ignored.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.split("#")[0].strip() for ln in f]
    except FileNotFoundError:
        raise ValueError(f"--slots-file {path!r}: no such file") from None
    lines = [ln for ln in lines if ln]
    if len(lines) == 1 and lines[0].isdigit():
        return int(lines[0])
    total = 0
    for ln in lines:
        slots = [w for w in ln.split() if w.startswith("slots=")]
        try:
            total += int(slots[0].split("=", 1)[1]) if slots else 1
        except ValueError:
            raise ValueError(f"--slots-file {path!r}: bad line {ln!r}") from None
    return total


def available_slots(slots_file: str | None, environ: Mapping[str, str] | None = None
                    ) -> int | None:
    """Workers available now: the slots file, ``MPIDIST_SLOTS``, ``SLURM_NTASKS``, or None."""
    env = os.environ if environ is None else environ
    if slots_file:
        return read_slots_file(slots_file)
    for key in ("MPIDIST_SLOTS", "SLURM_NTASKS"):
        value = env.get(key, "").split("(")[0].strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{key}={env[key]!r} is not an integer") from None
    return None


def launch_env(restart: int, min_workers: int, max_workers: int,
               environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one launch. Pure.

    ``MPIDIST_RESTART`` (0 on the first launch, k on the k-th restart),
    ``MPIDIST_MIN_WORKERS``/``MPIDIST_MAX_WORKERS``; for Open MPI
    ``OMPI_MCA_async_mpi_finalize=1`` (a leaving worker exits at once), outside Slurm
    ``OMPI_MCA_rmaps_base_oversubscribe=1``, and as root the run-as-root variables.
    """
    env = dict(os.environ if environ is None else environ)
    env["MPIDIST_RESTART"] = str(restart)
    env["MPIDIST_MIN_WORKERS"] = str(min_workers)
    env["MPIDIST_MAX_WORKERS"] = str(max_workers)
    env.setdefault("OMPI_MCA_async_mpi_finalize", "1")
    if "SLURM_JOB_ID" not in env:
        env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _flag_value(command: Sequence[str], flag: str) -> str | None:
    for i, word in enumerate(command):
        if word == flag and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


@dataclass
class Supervisor:
    """Launch ``command`` on ``n`` workers and restart it from its checkpoint when it fails.

    Not an MPI program itself. :meth:`run` returns the exit status: 0 when a launch
    finished, else the last launch's status (or 1 when too few workers are left).
    """

    command: list[str]
    n: int
    min_workers: int = 1
    max_workers: int = 1024
    max_restarts: int = 3
    slots_file: str | None = None
    events: str | None = None
    checkpoint_dir: str | None = None
    launcher: str = "mpiexec"
    launcher_args: list[str] = field(default_factory=list)
    backoff: float = 0.5
    out: str | None = field(default=None, init=False)  #: the command's --out
    lock_token: str = field(default="", init=False)  #: the token of the lock held

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no COMMAND to run (put it after --)")
        for name in ("n", "min_workers", "max_workers"):
            checked_int(getattr(self, name), name, 1)
        checked_int(self.max_restarts, "max_restarts")
        if self.min_workers > self.max_workers:
            raise ValueError(f"--min-workers {self.min_workers} is above --max-workers "
                             f"{self.max_workers}")
        if not self.min_workers <= self.n <= self.max_workers:
            raise ValueError(f"-n {self.n} is outside [--min-workers {self.min_workers}, "
                             f"--max-workers {self.max_workers}]")
        self.out = out = _flag_value(self.command, "--out")
        if self.checkpoint_dir is None:
            self.checkpoint_dir = out
        if self.events is None:
            self.events = os.path.join(out, "events.jsonl") if out else "events.jsonl"

    # -- pieces ---------------------------------------------------------------------------
    def workers_for(self, attempt: int, previous: int) -> int:
        """How many workers the launch ``attempt`` gets (0: first launch). May be below
        ``min_workers``; :meth:`run` then gives up."""
        avail = available_slots(self.slots_file)
        if attempt == 0:
            return self.n if avail is None else min(self.n, avail)
        return min(self.max_workers, previous if avail is None else avail)

    def latest_step(self) -> int | None:
        """The step of the latest committed checkpoint, or None."""
        if not self.checkpoint_dir or not os.path.isdir(self.checkpoint_dir):
            return None
        from mpidist.checkpoint.io import latest_checkpoint, read_metadata

        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return None
        try:
            return int(read_metadata(path)[0].get("step", 0))
        except Exception:  # noqa: BLE001 - an unreadable file only loses the step number
            return None

    def event(self, kind: str, **fields: Any) -> None:
        row = {"event": kind, "source": "supervisor", "step": self.latest_step(), **fields,
               "time": time.time()}
        level = logging.INFO if kind in ("launch", "finished") else logging.WARNING
        log.log(level, "mpidist run: %s %s", kind,
                " ".join(f"{k}={v}" for k, v in row.items() if k not in ("event", "time")))
        events = self.events or "events.jsonl"  # (set in __post_init__)
        os.makedirs(os.path.dirname(os.path.abspath(events)), exist_ok=True)
        with open(events, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def argv(self, n: int) -> list[str]:
        """The launcher command line for ``n`` workers."""
        launcher = shutil.which(self.launcher) or self.launcher
        return [launcher, "-n", str(n), *self.launcher_args, *self.command]

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> int:
        """Launch, and relaunch after failures; the exit status. Holds the lock of the
        command's ``--out`` meanwhile (:mod:`mpidist.run.lock`), which its jobs inherit;
        raises :class:`~mpidist.run.lock.LockHeldError` when another run holds it."""
        from mpidist.run.lock import RunLock

        lock = None
        if self.out:
            os.makedirs(self.out, exist_ok=True)
            lock = RunLock(self.out, "mpidist run --elastic")
            lock.acquire(inherit=os.environ.get(TOKEN_ENV) or None)
            self.lock_token = lock.token
        try:
            return self._run()
        finally:
            if lock is not None:
                lock.release()

    def _run(self) -> int:
        n = 0
        rc = 1
        for attempt in range(self.max_restarts + 1):
            n = self.workers_for(attempt, n if attempt else self.n)
            if n < self.min_workers:
                self.event("gave_up", attempt=attempt, world_size=n,
                           reason=f"{n} workers available, below --min-workers "
                                  f"{self.min_workers}")
                return rc if attempt else 1
            self.event("restart" if attempt else "launch", attempt=attempt, world_size=n)
            rc = self._launch(n, attempt)
            if rc == 0:
                self.event("finished", attempt=attempt, world_size=n)
                return 0
            self.event("crash", attempt=attempt, world_size=n, returncode=rc)
            if rc in (-signal.SIGINT, 130):
                return rc  # interrupted by the user, not a failure to recover from
            if rc == 2:  # the command refused its input: a restart would too
                self.event("gave_up", attempt=attempt, world_size=n,
                           reason="the command refused its input (exit status 2)")
                return rc
            time.sleep(self.backoff)
        self.event("gave_up", attempt=self.max_restarts, world_size=n,
                   reason=f"--max-restarts {self.max_restarts} used up")
        return rc

    def _launch(self, n: int, attempt: int) -> int:
        env = launch_env(attempt, self.min_workers, self.max_workers)
        if self.lock_token:
            env[TOKEN_ENV] = self.lock_token
        proc = subprocess.Popen(self.argv(n), env=env, start_new_session=True)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            _kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
            return 130
        finally:
            if proc.poll() is None:  # pragma: no cover - only on an unexpected error
                _kill_group(proc, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


# -- command line ------------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    """Register ``mpidist run`` (call from :func:`mpidist.cli.build_parser`)."""
    p = sub.add_parser(
        "run", help="launch an MPI job and restart it from its checkpoint when it fails",
        description=__doc__.split("\n\n")[0],
        usage="mpidist run --elastic --min-workers A --max-workers B -n N "
              "[--max-restarts R] [--slots-file F] [--events FILE] -- COMMAND...")
    a = p.add_argument
    a("--elastic", action="store_true", required=True,
      help="restart from the last checkpoint on failure, with the workers available")
    a("--min-workers", type=int, default=1)
    a("--max-workers", type=int, default=1024)
    a("-n", "--np", dest="n", type=int, required=True, help="workers of the first launch")
    a("--max-restarts", type=int, default=3)
    a("--slots-file", help="file with the number of available workers, re-read at each restart")
    a("--events", help="JSON-lines event log (default: events.jsonl in the command's --out)")
    a("--checkpoint-dir", help="where the job's checkpoints are (default: the command's --out)")
    a("--launcher", default=os.environ.get("MPIDIST_MPIEXEC", "mpiexec"),
      help="the MPI launcher (default mpiexec, or $MPIDIST_MPIEXEC)")
    a("--launcher-arg", action="append", default=[], dest="launcher_args",
      help="extra argument for the launcher (repeatable)")
    a("command", nargs=argparse.REMAINDER, help="-- then the command each worker runs")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from mpidist.run.logs import setup_logging

    setup_logging(0)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    sup = Supervisor(command=command, n=args.n, min_workers=args.min_workers,
                     max_workers=args.max_workers, max_restarts=args.max_restarts,
                     slots_file=args.slots_file, events=args.events,
                     checkpoint_dir=args.checkpoint_dir, launcher=args.launcher,
                     launcher_args=list(args.launcher_args))
    return sup.run()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mpidist.run.launch.supervisor ...`` (the same flags as ``mpidist run``)."""
    parser = argparse.ArgumentParser(prog="mpidist")
    sub = parser.add_subparsers(dest="command_name")
    add_parser(sub)
    args = parser.parse_args(["run", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as exc:
        sys.stderr.write(f"mpidist run: error: {exc}\n")
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
