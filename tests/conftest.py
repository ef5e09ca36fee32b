"""Shared test configuration.

Under ``mpiexec ... pytest --with-mpi`` a failing test on one rank would leave the other
ranks blocked in their next collective. The hook below prints the failure with its rank and
aborts the whole job at once, so a failing MPI test never hangs the suite (the per-test
timeout in setup.cfg covers a rank that blocks without failing).
"""

from __future__ import annotations

import os
import sys

import pytest


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


_WITH_MPI = False


def pytest_configure(config: pytest.Config) -> None:
    global _WITH_MPI
    _WITH_MPI = bool(config.getoption("--with-mpi", default=False))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return
    skip = pytest.mark.skip(reason="CUDA-simulator test: run with NUMBA_ENABLE_CUDASIM=1")
    for item in items:
        if "cudasim" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed:
        return
    if not _WITH_MPI:
        return
    comm = _world()
    if comm.Get_size() <= 1:
        return
    rank = comm.Get_rank()
    text = str(report.longrepr)
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    sys.stderr.write(f"[rank {rank}] FAILED {report.nodeid} ({report.when}); aborting the job\n")
    sys.stderr.flush()
    comm.Abort(1)


@pytest.fixture
def comm():
    """COMM_WORLD for @pytest.mark.mpi tests."""
    return _world()
