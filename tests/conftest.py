"""Shared test configuration.

Under ``mpiexec ... pytest --with-mpi`` a failing test on one rank would leave the other
ranks blocked in their next collective. The hook below prints the failure with its rank and
aborts the whole job at once, so a failing MPI test never hangs the suite (the per-test
timeout in setup.cfg covers a rank that blocks without failing).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading

import numpy as np
import pytest

# Flight-recorder dumps of tests that hang or abort on purpose (the library's default is
# ./mpidist-hang) go to the temporary directory, also from the mpiexec runs tests start.
os.environ.setdefault("MPIDIST_HANG_DIR", os.path.join(tempfile.gettempdir(),
                                                     f"mpidist-test-hang-{os.getuid()}"))


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


@pytest.fixture(autouse=True, scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory):
    """A data cache of the session's own (mpidist.data.cache), so that tests neither read
    a user's cache nor leave entries in it; subprocesses inherit it."""
    old = os.environ.get("MPIDIST_CACHE_DIR")
    os.environ["MPIDIST_CACHE_DIR"] = str(tmp_path_factory.mktemp("mpidist-cache"))
    yield
    if old is None:
        os.environ.pop("MPIDIST_CACHE_DIR", None)
    else:
        os.environ["MPIDIST_CACHE_DIR"] = old


@pytest.fixture(autouse=True, scope="session")
def fast_simulator():
    """The simulator runs every CUDA thread as a Python thread and polls them all at each
    ``syncthreads``: a GIL switch interval of 0.1 ms instead of 5 ms makes these tests ten
    times faster. Short slices also make a race in the simulator likely enough to matter:
    its shared arrays are made on a block's first call at each source line, by an unlocked
    check-then-set, so two threads could each get an array of their own. That allocation
    is locked here. Only under the simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        yield
        return
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    with pytest.MonkeyPatch.context() as mp:
        try:
            from numba.cuda.simulator.kernelapi import FakeCUDAShared
        except ImportError:  # another simulator layout: run unpatched
            FakeCUDAShared = None
        if FakeCUDAShared is not None and hasattr(FakeCUDAShared, "array"):
            mp.setattr(FakeCUDAShared, "array", _locked_shared_array(FakeCUDAShared.array))
        try:
            yield
        finally:
            sys.setswitchinterval(old)


def _locked_shared_array(original):
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None or not hasattr(self, "_allocations"):
            return original(self, shape, dtype, alignment)
        from numba.core import types
        from numba.np.numpy_support import as_dtype

        frame = sys._getframe(1)  # keyed by the calling line, as the simulator does
        key = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(key)
            if res is None:
                dt = as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
                res = self._allocations[key] = np.empty(shape, dt)
        return res

    return array


@pytest.fixture
def comm():
    """COMM_WORLD for @pytest.mark.mpi tests."""
    return _world()
