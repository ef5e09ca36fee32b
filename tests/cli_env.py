"""The environment the CLI tests run ``mpidist`` (under ``mpiexec``) in: Open MPI as root and
oversubscribed, one thread a rank, and none of the variables that a supervisor, a Slurm job
or an earlier launch would leave (they change what a run resumes or which lock it holds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

INHERITED = ("MPIDIST_RESTART", "MPIDIST_SLOTS", "MPIDIST_RUN_LOCK_TOKEN", "SLURM_JOB_ID",
             "SLURM_RESTART_COUNT")


def cli_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for a CLI test, with ``extra`` on top."""
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    for key in INHERITED:
        e.pop(key, None)
    e.update(extra)
    return e


def wait_for_rows(proc: subprocess.Popen, metrics: Path, rows: int = 3,
                  timeout: float = 120.0) -> None:
    """Wait until the run ``proc`` has written ``rows`` lines of ``metrics`` (or ended, or
    ``timeout`` seconds passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.01)


def crashed_at(run: Path, step: int, dest: Path) -> Path:
    """A new run directory ``dest`` holding only ``run``'s checkpoint of ``step``, as its
    latest: the run as if it had crashed right after that checkpoint."""
    name = f"ckpt-{step:08d}.h5"
    dest.mkdir()
    shutil.copy(run / name, dest)
    (dest / "latest").write_text(name + "\n")
    return dest
