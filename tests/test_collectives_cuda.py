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
    from mpidist import collectives as C
    from mpidist.launch import abort_on_failure

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
