"""The run directory's lock, ``<out>/run.lock``: one run at a time owns ``--out``.

A JSON lease naming its holder, renewed every ``lease`` seconds by a thread and stale
after :data:`STALE_LEASES` leases without renewal (or sooner: a gone process on this host,
an earlier start of the same Slurm job, an ended Slurm job). Taken atomically by linking a
complete file into place; a stale lock is renamed aside and its token checked, so two runs
cannot both take it over. A supervisor hands its lock to its jobs (``MPIDIST_RUN_LOCK_TOKEN``).
Documented in ``docs/runs.md`` ("One run per directory").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from typing import Any

from mpidist.run.preempt import env_count

__all__ = ["LEASE_SECONDS", "LOCK_NAME", "STALE_LEASES", "TOKEN_ENV", "LockHeldError",
           "RunLock", "describe_holder", "lease_seconds", "read_lock", "stale_reason"]

log = logging.getLogger("mpidist.cli.train")

LOCK_NAME = "run.lock"
#: Seconds between two renewals of the lease.
LEASE_SECONDS = 10.0
#: A lock not renewed for this many leases is stale.
STALE_LEASES = 4
#: The environment variable through which a supervisor hands its lock to its jobs.
TOKEN_ENV = "MPIDIST_RUN_LOCK_TOKEN"


class LockHeldError(ValueError):
    """The run directory is held by another run (the message names the holder)."""


def lease_seconds() -> float:
    """The lease period: ``MPIDIST_LOCK_LEASE_S`` or :data:`LEASE_SECONDS`."""
    text = os.environ.get("MPIDIST_LOCK_LEASE_S", "")
    try:
        value = float(text) if text else LEASE_SECONDS
    except ValueError:
        raise ValueError(f"MPIDIST_LOCK_LEASE_S={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"MPIDIST_LOCK_LEASE_S={text!r} must be > 0")
    return value


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _slurm() -> dict[str, Any]:
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    return {"slurm_job_id": job, "slurm_restart_count": env_count("SLURM_RESTART_COUNT")}


def read_lock(directory: str) -> dict[str, Any] | None:
    """The lock's content, or None when there is no lock. Not collective.

    An unreadable or malformed lock file reads as ``{}`` (held by an unknown holder).
    """
    try:
        with open(os.path.join(directory, LOCK_NAME), encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def describe_holder(info: dict[str, Any], now: float | None = None) -> str:
    """``"mpidist train rank 0 (pid 123 on node7, renewed 3 s ago)"``."""
    now = time.time() if now is None else now
    who = info.get("holder", "an unknown holder")
    where = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    renewed = info.get("renewed")
    age = f", renewed {max(0.0, now - renewed):.0f} s ago" \
        if isinstance(renewed, (int, float)) else ""
    return f"{who} ({where}{job}{age})"


def stale_reason(info: dict[str, Any], now: float | None = None) -> str:
    """Why the lock ``info`` is stale, or "" while it is alive. Not collective."""
    now = time.time() if now is None else now
    lease = info.get("lease_s")
    lease = float(lease) if isinstance(lease, (int, float)) and lease > 0 else LEASE_SECONDS
    renewed = info.get("renewed")
    if not isinstance(renewed, (int, float)):
        return ""  # an unknown holder is never assumed dead from the content alone
    age = now - renewed
    if age > STALE_LEASES * lease:
        return f"not renewed for {age:.0f} s"
    if info.get("host") == socket.gethostname() and info.get("pidns") == _pid_namespace() \
            and isinstance(info.get("pid"), int) and not _alive(info["pid"]):
        return f"process {info['pid']} on this host is gone"
    mine = _slurm()
    job = info.get("slurm_job_id")
    if mine and job == mine["slurm_job_id"] \
            and isinstance(info.get("slurm_restart_count"), int) \
            and info["slurm_restart_count"] < mine["slurm_restart_count"]:
        return f"held by an earlier start of Slurm job {job}"
    if mine and job and job != mine["slurm_job_id"] and _slurm_job_ended(str(job)):
        return f"Slurm job {job} has ended"
    return ""


def _slurm_job_ended(job: str) -> bool:
    """Whether Slurm says job ``job`` is no longer running (False when it cannot tell)."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return False
    try:
        proc = subprocess.run([squeue, "-h", "-j", job, "-o", "%T"], capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if proc.returncode != 0:  # an unknown (long finished) job id is an error
        return "invalid job id" in proc.stderr.lower()
    state = proc.stdout.strip().upper()
    return state in ("", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                     "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process nobody has reaped yet is a zombie: gone all the same
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


class RunLock:
    """The lock of one run directory, held by this process. Not collective.

    :meth:`acquire` takes it (or recognises it as the supervisor's, ``token``) and starts
    the renewing thread; :meth:`release` removes it; :meth:`abandon` stops renewing and
    leaves the file to a new holder (an elastic rank 0 that leaves the job).
    ``lost`` is set when another run took the lock over.
    """

    def __init__(self, directory: str, holder: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.holder = holder
        self.token = ""
        self.inherited = False
        self.lost = ""
        self.lease = lease_seconds()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- content ----------------------------------------------------------------------------
    def _content(self, started: float | None = None) -> dict[str, Any]:
        now = time.time()
        return {"holder": self.holder, "host": socket.gethostname(), "pid": os.getpid(),
                "pidns": _pid_namespace(), "token": self.token, "lease_s": self.lease,
                "started": now if started is None else started, "renewed": now, **_slurm()}

    def _rewrite(self, started: Any) -> None:
        os.replace(self._write_temp(self._content(started=started)), self.path)

    def _write_temp(self, content: dict[str, Any]) -> str:
        tmp = os.path.join(self.directory, f".{LOCK_NAME}.tmp-{secrets.token_hex(6)}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(content, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        return tmp

    # -- taking and giving back ------------------------------------------------------------
    def acquire(self, inherit: str | None = None) -> None:
        """Take the lock, or raise :class:`LockHeldError` naming its holder.

        ``inherit``: a supervisor's token; a lock with that token is this run's already.
        """
        self.token = secrets.token_hex(8)
        for _ in range(5):
            tmp = self._write_temp(self._content())
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                pass
            else:
                self._start_renewing()
                return
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
            info = read_lock(self.directory)
            if info is None:
                continue  # released meanwhile
            if inherit and info.get("token") == inherit:
                self.token, self.inherited = inherit, True
                return
            why = stale_reason(info)
            if not why:
                raise LockHeldError(
                    f"--out {self.directory} is in use by {describe_holder(info)}; wait for "
                    f"that run to end, or choose another --out (a lock left by a killed run "
                    f"is stale after {STALE_LEASES * float(info.get('lease_s') or self.lease):.0f}"
                    f" s without renewal)")
            if self._move_aside(info):
                log.warning("took over the lock of %s in %s: %s", describe_holder(info),
                            self.directory, why)
        raise LockHeldError(f"--out {self.directory}: could not take the lock {self.path} "
                            "(other runs keep taking it)")

    def _move_aside(self, info: dict[str, Any]) -> bool:
        """Rename the stale lock ``info`` away; False if the file was another lock."""
        aside = os.path.join(self.directory, f".{LOCK_NAME}.stale-{secrets.token_hex(6)}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            with open(aside, encoding="utf-8") as f:
                moved = json.loads(f.read())
        except (OSError, ValueError):
            moved = {}
        if moved.get("token") != info.get("token"):
            # Another run replaced the stale lock meanwhile: put its lock back.
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        with contextlib.suppress(FileNotFoundError):
            os.remove(aside)
        return moved.get("token") == info.get("token")

    def take_over(self, token: str | None = None) -> None:
        """Become the holder of this run's lock (a new rank 0 of an elastic job)."""
        info = read_lock(self.directory) or {}
        self.token = token or info.get("token") or secrets.token_hex(8)
        self._rewrite(info.get("started"))
        self._start_renewing()

    def _start_renewing(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="mpidist-run-lock",
                                        daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        started = time.time()
        while not self._stop.wait(self.lease):
            try:
                info = read_lock(self.directory)
                if info is None or info.get("token") != self.token:
                    self.lost = describe_holder(info) if info else "nobody (the file was removed)"
                    log.warning("lost the lock of %s to %s", self.directory, self.lost)
                    return
                if info.get("pid") != os.getpid() or info.get("host") != socket.gethostname():
                    return  # handed over to a new rank 0
                self._rewrite(info.get("started", started))
            except OSError as exc:  # a file system hiccup: try again next lease
                log.warning("could not renew the lock of %s: %s", self.directory, exc)

    def _stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def abandon(self) -> None:
        """Stop renewing; the file stays for the next holder."""
        self._stop_renewing()

    def release(self) -> None:
        """Stop renewing and remove the lock if this process holds it."""
        self._stop_renewing()
        if self.inherited or not self.token:
            return
        info = read_lock(self.directory)
        if info and info.get("token") == self.token and info.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        self.token = ""
