"""Device arrays go through a host copy when MPI is not CUDA-aware (the staging path).

Runs under the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1), whose device arrays stand in
for real ones (they mark themselves with ``__cuda_ndarray__``), in a 2-rank mpiexec job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from mpi4py import MPI
    from numba import cuda
    from mpidist.core import collectives as C
    from mpidist.run.launch import abort_on_failure

    with abort_on_failure():
        comm = MPI.COMM_WORLD
        n, r = comm.Get_size(), comm.Get_rank()
        assert not C.cuda_aware()
        d = cuda.to_device(np.full(7, r + 1.0))
        assert C._is_device(d)
        assert C.allreduce(d, "sum", comm=comm) is d
        assert (d.copy_to_host() == n * (n + 1) / 2).all()
        C.iallreduce(d, "avg", comm=comm).wait()
        assert (d.copy_to_host() == n * (n + 1) / 2).all()  # the average of equal values
        out = cuda.to_device(np.zeros(4))
        C.reduce_scatter(cuda.to_device(np.arange(8.0)), "sum", comm=comm, out=out)
        assert (out.copy_to_host() == n * np.arange(8.0)[4 * r: 4 * r + 4]).all()
        full = cuda.to_device(np.zeros(4 * n))
        C.allgather(out, comm=comm, out=full)
        assert (full.copy_to_host() == n * np.arange(8.0)).all()
        b = cuda.to_device(np.full(3, float(r)))
        C.broadcast(b, root=1, comm=comm)
        assert (b.copy_to_host() == 1.0).all()
        inbox = cuda.to_device(np.zeros(2))
        outbox = cuda.to_device(np.full(2, r + 5.0))
        C.wait_all([C.irecv(inbox, 1 - r, comm=comm), C.isend(outbox, 1 - r, comm=comm)])
        assert (inbox.copy_to_host() == 1 - r + 5.0).all()

        class Interface:  # any library's device array (CuPy, torch): the interface only
            def __init__(self, a):
                self.a = a
                self.__cuda_array_interface__ = {
                    "shape": a.shape, "typestr": a.dtype.str, "strides": None,
                    "data": (a.ctypes.data, False), "version": 3}

        x = np.full(7, r + 1.0)
        assert C.allreduce(Interface(x), "avg", comm=comm).a is x
        assert (x == (n + 1) / 2).all()
        y = np.arange(5, dtype=np.float32) + r  # 5 elements over n ranks: padded
        shard = np.zeros(-(-5 // n), np.float32)
        C.reduce_scatter(Interface(y), "sum", comm=comm, out=Interface(shard))
        want = np.zeros(-(-5 // n) * n, np.float32)
        want[:5] = sum(np.arange(5, dtype=np.float32) + q for q in range(n))
        assert (shard == want[r * shard.size:(r + 1) * shard.size]).all()
        gathered = np.zeros(n * shard.size, np.float32)
        C.allgather(Interface(shard), comm=comm, out=Interface(gathered))
        assert (gathered == want).all()
        z = np.full(3, float(r), np.int64)
        C.broadcast(Interface(z), root=1, comm=comm)
        assert (z == 1).all()
        if r == 0:
            print("staging path OK")
    """
)


@pytest.mark.cudasim
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not on PATH")
def test_device_arrays_are_staged_through_the_host():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    env.pop("MPIDIST_CUDA_AWARE", None)
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", SCRIPT], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "staging path OK" in proc.stdout


@pytest.mark.cudasim
@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                    reason="needs NUMBA_ENABLE_CUDASIM=1")
def test_device_helpers_on_the_simulator(monkeypatch):
    import numpy as np
    from numba import cuda

    from mpidist.core import devices

    d = cuda.to_device(np.arange(6.0))
    devices.scale(d, 4)  # avg on a device array: a kernel, not ``a *= ...``
    assert d.copy_to_host().tolist() == [k / 4 for k in range(6)]
    i = cuda.to_device(np.array([7, -7, 8]))
    devices.scale(i, 2)
    assert i.copy_to_host().tolist() == [3, -4, 4]
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "1")
    assert devices.cuda_aware()
    buf, back = devices.stage(d)  # CUDA-aware: the device buffer itself, nothing to copy back
    assert buf is d and back is None
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "0")
    host, back = devices.stage(d)
    assert isinstance(host, np.ndarray) and host.tolist() == d.copy_to_host().tolist()
    host[:] = 1.0
    back(host)
    assert (d.copy_to_host() == 1.0).all()
    out = np.zeros(6)
    devices.copy(out, d)
    assert (out == 1.0).all()

    class Strided:
        __cuda_array_interface__ = {"shape": (3,), "typestr": "<f8", "strides": (16,),
                                    "data": (np.zeros(6).ctypes.data, False), "version": 3}

    with pytest.raises(ValueError, match="not C-contiguous"):
        devices.view(Strided())
