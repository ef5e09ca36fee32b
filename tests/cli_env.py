"""The environment the CLI tests run ``mpidist`` (under ``mpiexec``) in: Open MPI as root and
oversubscribed, one thread a rank, and none of the variables that a supervisor, a Slurm job
or an earlier launch would leave (they change what a run resumes or which lock it holds)."""

from __future__ import annotations

import os

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
